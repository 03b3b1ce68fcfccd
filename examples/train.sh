#!/usr/bin/env bash
# Train the example character-level GPT on this machine's CPU: 4 processes (gloo), a 4-stage 1F1B
# pipeline. Installs into .venv on first use. Extra arguments go to LightningCLI, e.g.
#   bash examples/train.sh --trainer.max_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
export OMP_NUM_THREADS=1   # 4 processes share the cores: one intra-op thread each
python examples/gpt/train.py fit --config examples/gpt/configs/pipe_tp.yaml "$@"
