#!/usr/bin/env bash
# Creates (once) the separate venv that holds TRL's GRPOTrainer + PEFT, the peer that
# bench/rl.py compares our RL step against (bench/trl_grpo.py runs inside it). Its own venv so
# TRL's dependencies (accelerate, datasets, ...) never enter .venv. Versions as in
# ../shared/PEERS.md. Idempotent: a stamp file marks a finished install.
set -euo pipefail
TRL_VERSION=1.16.0
VENV="${LORAFLEET_TRL_VENV:-$HOME/.cache/lorafleet-peers/trl-$TRL_VERSION}"
STAMP="$VENV/.lorafleet-ready"
if [ -f "$STAMP" ]; then
  echo "$VENV"
  exit 0
fi
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, alone: pip then keeps the local CPU wheel instead of resolving a CUDA one.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "trl==$TRL_VERSION" peft==0.21.2 transformers==5.24.0 torch==2.13.0
"$VENV/bin/python" -c "import trl, peft, transformers, torch, sys; print('trl', trl.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, file=sys.stderr)"
touch "$STAMP"
echo "$VENV"
