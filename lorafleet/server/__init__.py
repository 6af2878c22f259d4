"""The Tinker-compatible HTTP server: many tenants' LoRA adapters on one base model."""
