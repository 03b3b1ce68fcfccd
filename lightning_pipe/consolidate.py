"""``python -m lightning_pipe.consolidate CKPT_DIR OUT.ckpt``: a sharded pipe_tp checkpoint as one
ordinary Lightning checkpoint file (for inference with ``strategy="auto"``, or to resume on one
device); with ``--to-huggingface``, the Hugging Face model it holds as a directory that
``AutoModelForCausalLM.from_pretrained`` loads. Runs in one process without torch.distributed;
needs memory for the whole model."""

from __future__ import annotations

import argparse
import sys

from lightning_pipe.checkpoint.metadata import CheckpointError
from lightning_pipe.checkpoint.reader import CheckpointDirectory
from lightning_pipe.checkpoint.single_file import consolidate_checkpoint
from lightning_pipe.mesh import ParallelLayout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.consolidate",
        description="Consolidate a sharded lightning_pipe checkpoint directory into one Lightning "
        "checkpoint file.",
    )
    parser.add_argument("checkpoint", help="the sharded checkpoint directory (e.g. epoch=3-step=120.ckpt)")
    parser.add_argument(
        "output",
        help="the single-file checkpoint to write (e.g. model.ckpt), or with --to-huggingface a directory",
    )
    parser.add_argument(
        "--to-huggingface",
        action="store_true",
        help="write the Hugging Face model the checkpoint holds as a directory for from_pretrained "
        "(config.json, safetensors shards and index, the tokenizer files of the model's source directory)",
    )
    parser.add_argument(
        "--config",
        help="with --to-huggingface: a directory with the model's config.json, "
        "for a checkpoint that records none",
    )
    parser.add_argument(
        "--prefix", help="with --to-huggingface: the model's key prefix (default: recorded, or 'model.')"
    )
    parser.add_argument("--tokenizer", help="with --to-huggingface: a directory to copy tokenizer files from")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --to-huggingface, for a model trained with PEFT adapters: write the merged model "
        "(from_pretrained) instead of the adapter directory (adapter_config.json, adapter_model.safetensors)",
    )
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="leave out the optimizer, LR-scheduler and callback states (smaller; for inference)",
    )
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="read the Lightning state with torch.load(weights_only=False), for hyper-parameters or "
        "callback states that hold arbitrary objects; this can run code stored in the checkpoint, so "
        "use it only for checkpoints you trust",
    )
    args = parser.parse_args(argv)
    if args.merge and not args.to_huggingface:
        parser.error("--merge applies to --to-huggingface (a model trained with PEFT adapters)")
    if args.to_huggingface:
        from lightning_pipe.huggingface.export import export_huggingface

        try:
            out = export_huggingface(
                args.checkpoint,
                args.output,
                config=args.config,
                prefix=args.prefix,
                tokenizer=args.tokenizer,
                trust_pickle=args.trust_pickle,
                merge=args.merge,
            )
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        kind = "PEFT adapter" if (out / "adapter_config.json").is_file() else "Hugging Face model"
        print(f"{out}: a {kind} directory ({', '.join(sorted(p.name for p in out.iterdir()))})")
        return 0
    try:
        # The layout first: OUTPUT may be the checkpoint directory itself, which consolidating replaces.
        layout = ParallelLayout(**CheckpointDirectory(args.checkpoint).metadata.layout)
        checkpoint = consolidate_checkpoint(
            args.checkpoint, args.output, weights_only=args.weights_only, trust_pickle=args.trust_pickle
        )
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    tensors = sum(v.numel() for v in checkpoint["state_dict"].values() if hasattr(v, "numel"))
    print(
        f"{args.output}: {len(checkpoint['state_dict'])} state-dict entries ({tensors:,} elements), "
        f"{len(checkpoint.get('optimizer_states', []))} optimizer state(s), epoch {checkpoint.get('epoch')}, "
        f"global step {checkpoint.get('global_step')}; saved with {layout}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
