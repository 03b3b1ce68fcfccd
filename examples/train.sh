#!/usr/bin/env bash
# Train the example on this machine's CPU with 4 processes (gloo). Installs into .venv on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
export OMP_NUM_THREADS=1
torchrun --standalone --nproc-per-node 4 examples/train_engine.py "$@"
