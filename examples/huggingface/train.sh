#!/usr/bin/env bash
# Fine-tune a small Hugging Face Llama (built from a config, no download) on this machine's CPU:
# 2 processes (gloo), a 2-stage 1F1B pipeline derived from the model's own plan. Installs into
# .venv on first use. Extra arguments go to LightningCLI, e.g.
#   bash examples/huggingface/train.sh --config examples/huggingface/configs/pipe_tp_tp2.yaml
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/venv.sh
export OMP_NUM_THREADS=1   # the processes share the cores: one intra-op thread each
python examples/huggingface/train.py fit --config examples/huggingface/configs/pipe_tp.yaml "$@"
