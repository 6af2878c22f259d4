"""The op types and how they flow: intake, admission, quotas, the scheduler, fair share, futures, metering."""
