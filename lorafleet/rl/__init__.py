"""RL (GRPO-style) and SFT loops that drive a Tinker-compatible server through the `tinker` SDK."""
