"""``python -m lightning_pipe.consolidate CKPT_DIR OUT.ckpt``: a sharded pipe_tp checkpoint as one
ordinary Lightning checkpoint file (for inference with ``strategy="auto"``, or to resume on one
device). Runs in one process without torch.distributed; needs memory for the whole model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_pipe.checkpoint.consolidate import consolidate_checkpoint
from lightning_pipe.checkpoint.metadata import CheckpointError, CheckpointMetadata
from lightning_pipe.mesh import ParallelLayout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.consolidate",
        description="Consolidate a sharded lightning_pipe checkpoint directory into one Lightning "
        "checkpoint file.",
    )
    parser.add_argument("checkpoint", help="the sharded checkpoint directory (e.g. epoch=3-step=120.ckpt)")
    parser.add_argument("output", help="the single-file checkpoint to write (e.g. model.ckpt)")
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="leave out the optimizer, LR-scheduler and callback states (smaller; for inference)",
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = consolidate_checkpoint(args.checkpoint, args.output, weights_only=args.weights_only)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    layout = ParallelLayout(**CheckpointMetadata.read(Path(args.checkpoint)).layout)
    tensors = sum(v.numel() for v in checkpoint["state_dict"].values() if hasattr(v, "numel"))
    print(
        f"{args.output}: {len(checkpoint['state_dict'])} state-dict entries ({tensors:,} elements), "
        f"{len(checkpoint.get('optimizer_states', []))} optimizer state(s), epoch {checkpoint.get('epoch')}, "
        f"global step {checkpoint.get('global_step')}; saved with {layout}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
