#!/usr/bin/env bash
# The GPU acceptance run (issue 33) in one command, on one CUDA device:
#   1. tests/test_cuda.py (the fused kernel, graph replay, mixed steps on the device);
#   2. bench/gpu.py on qwen3-1.7b-shape: train MFU, mixed / base sampling, graph vs eager decode;
#   3. bench/rl.py: `lorafleet rl`-style GRPO steps through the HTTP server on the device, 1 and
#      4 tenants (tenants4_throughput_over_1).
# Each step's JSON and log, and a summary (gpu_check.json: the figures against the issue's
# targets, each step's exit status and time), go to $OUT when it is set (the device machine),
# else to a fresh temp dir. Exits non-zero if a step failed. About 5 minutes on one H200; each
# step has its own time limit, 8 minutes in all.
#
#   bash scripts/gpu_check.sh            # on a CUDA machine
#   bash scripts/gpu_check.sh --smoke    # the same steps at toy sizes on the CPU (in the suite)
#
# Python: $PYTHON, else .venv/bin/python, else python3. Packages the machine lacks can come as
# wheels in $LORAFLEET_WHEELS (default .whl, made by scripts/gpu_wheels.sh), installed with
# --no-index into a private dir first (machines with no package index, as the lent GPU boxes).
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
case "${1:-}" in
  --smoke) SMOKE=1 ;;
  "") ;;
  *) echo "usage: $0 [--smoke]" >&2; exit 2 ;;
esac

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
RESULTS=${OUT:-$(mktemp -d -t lorafleet-gpu-check-XXXXXX)}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0
export PYTHONUNBUFFERED=1

WHEELS=${LORAFLEET_WHEELS:-.whl}
if [ -d "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d -t lorafleet-site-XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels in $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH#"$PWD"}"
fi

if [ "$SMOKE" = 1 ]; then DEVICE=cpu; else DEVICE=${GPU_CHECK_DEVICE:-cuda}; fi
# What the steps import, checked before any of them runs (a missing one is named, with the
# command that fetches it as a wheel).
"$PY" - "$DEVICE" <<'EOF' || exit 2
import importlib.util, sys
need = ["torch", "transformers", "safetensors", "tokenizers", "tinker", "fastapi", "uvicorn",
        "httpx", "pytest", "pyrage", "prometheus_client", "rich", "matplotlib"]
if sys.argv[1] != "cpu":
    need.append("triton")
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages {missing}; fetch them as wheels with "
             "`bash scripts/gpu_wheels.sh` (where pip reaches an index) and keep .whl beside this script")
import torch
if sys.argv[1] != "cpu" and not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device (use --smoke on a CPU)")
print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, device {sys.argv[1]}")
EOF

declare -A STATUS SECONDS_TAKEN
run_step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  STATUS[$name]=$?
  SECONDS_TAKEN[$name]=$((SECONDS - start))
  tail -n 25 "$RESULTS/$name.log"
  echo "== $name: exit ${STATUS[$name]} after ${SECONDS_TAKEN[$name]} s"
}

if [ "$SMOKE" = 1 ]; then
  run_step test_cuda 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
  run_step gpu 300 "$PY" -m bench.gpu --smoke --device cpu --no-peft --json "$RESULTS/gpu.json"
  run_step rl 300 "$PY" -m bench.rl --device cpu --base-model tiny-qwen3 --repeats 1 \
    --max-tokens 4 --torch-threads 1 --trl-venv /nonexistent --json "$RESULTS/rl.json"
else
  run_step test_cuda 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py
  run_step gpu 210 "$PY" -m bench.gpu --device "$DEVICE" --repeats 2 --no-peft \
    --json "$RESULTS/gpu.json"
  run_step rl 150 "$PY" -m bench.rl --device "$DEVICE" --base-model qwen3-1.7b-shape \
    --repeats 2 --max-tokens 32 --trl-venv /nonexistent --json "$RESULTS/rl.json"
fi

steps=""
for name in test_cuda gpu rl; do
  steps="$steps $name=${STATUS[$name]}:${SECONDS_TAKEN[$name]}"
done
"$PY" scripts/gpu_check_summary.py --results "$RESULTS" --smoke "$SMOKE" --steps $steps
