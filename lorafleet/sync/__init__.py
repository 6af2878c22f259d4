"""Adapter sync to rollout engines (embedded sampler, vLLM, SGLang), verified after every sync.

Import from the submodules (`lorafleet.sync.syncer`, `.embedded`, `.vllm`, ...). This file
stays empty on purpose: `python -m lorafleet.sync.staging_server` runs on engine hosts with
the standard library only, and importing this package must not pull in torch.
"""
