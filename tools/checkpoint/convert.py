#!/usr/bin/env python
"""Convert model checkpoints: Hugging Face Llama <-> megalite, and megalite re-layout.

    python tools/checkpoint/convert.py --source-format hf --target-format megalite \
        --load-dir llama-hf/ --save-dir ckpt/ \
        --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2
    python tools/checkpoint/convert.py --source-format megalite --target-format hf \
        --load-dir ckpt/ --save-dir llama-hf-out/

A megalite source may have been saved at any TP/PP; the target layout is independent.
Runs in one process on CPU; needs only torch and safetensors.  Errors are one line,
exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-format", choices=["hf", "megalite"], required=True)
    ap.add_argument("--target-format", choices=["hf", "megalite"], required=True)
    ap.add_argument("--load-dir", required=True, help="Checkpoint to read.")
    ap.add_argument("--save-dir", required=True, help="Where to write the converted checkpoint.")
    ap.add_argument("--target-tensor-parallel-size", type=int, default=1)
    ap.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--load-iteration", type=int, default=None,
                    help="megalite source: iteration to read (default: latest).")
    ap.add_argument("--hf-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of exported Hugging Face weights.")
    return ap


def _check_layout(model_cfg: dict, tp: int, pp: int) -> None:
    from megalite.config import ModelConfig

    m = ModelConfig(**model_cfg)
    if tp < 1 or pp < 1:
        raise ValueError("target TP and PP sizes must be positive")
    for what, n in (("attention heads", m.num_attention_heads),
                    ("query groups", m.resolved_query_groups())):
        if n % tp:
            raise ValueError(f"--target-tensor-parallel-size {tp} does not divide the {n} {what}")
    if pp > m.num_layers:
        raise ValueError(f"--target-pipeline-model-parallel-size {pp} exceeds the "
                         f"{m.num_layers} layers")


def convert(args) -> str:
    from megalite.checkpointing import hf
    from megalite.checkpointing.model_io import (full_state_dict_from_checkpoint,
                                                 read_metadata, write_checkpoint_from_full)

    if not os.path.isdir(args.load_dir):
        raise FileNotFoundError(f"--load-dir '{args.load_dir}' does not exist")
    iteration = 0
    if args.source_format == "hf":
        model_cfg, full = hf.import_hf(args.load_dir)
    else:
        iteration = read_metadata(args.load_dir, args.load_iteration)["iteration"]
        model_cfg, full = full_state_dict_from_checkpoint(args.load_dir, args.load_iteration)
    if args.target_format == "megalite":
        tp, pp = args.target_tensor_parallel_size, args.target_pipeline_model_parallel_size
        _check_layout(model_cfg, tp, pp)
        write_checkpoint_from_full(args.save_dir, model_cfg, full, tp, pp, iteration)
        return f"wrote megalite checkpoint (TP={tp}, PP={pp}, iteration {iteration}) to {args.save_dir}"
    hf.export_hf(args.save_dir, model_cfg, full, dtype=getattr(torch, args.hf_dtype))
    return f"wrote Hugging Face Llama checkpoint to {args.save_dir}"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        print(convert(args))
    except (FileNotFoundError, ValueError, KeyError) as exc:  # UnsupportedModelError is a ValueError
        msg = exc.args[0] if exc.args else str(exc)
        parser.exit(2, f"convert.py: error: {msg}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
