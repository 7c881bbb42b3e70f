#!/usr/bin/env python
"""Convert model checkpoints: Hugging Face <-> megalite, and megalite re-layout.

    python tools/checkpoint/convert.py --source-format hf --target-format megalite \
        --load-dir llama-hf/ --save-dir ckpt/ \
        --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2
    python tools/checkpoint/convert.py --source-format megalite --target-format hf \
        --load-dir ckpt/ --save-dir llama-hf-out/

A megalite source may have been saved at any TP/PP; the target layout is independent and
may be uneven, interleaved or count the embedding/loss as pipeline layers (the same
``--target-*`` flags as pretrain_gpt.py's layout flags): each stage file then holds exactly
what that stage of a run at that layout builds.  Hugging Face models go through the adapter
registered for their architecture (``megalite.checkpointing.hf_adapters``: Llama,
Mistral, Qwen2, Qwen3, Mixtral; docs/models.md).
Runs in one process on CPU; needs only torch and safetensors.  Errors are one line,
exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script from anywhere: use this checkout's megalite
    sys.path.insert(0, _ROOT)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-format", choices=["hf", "megalite"], required=True)
    ap.add_argument("--target-format", choices=["hf", "megalite"], required=True)
    ap.add_argument("--load-dir", required=True, help="Checkpoint to read.")
    ap.add_argument("--save-dir", required=True, help="Where to write the converted checkpoint.")
    ap.add_argument("--target-tensor-parallel-size", type=int, default=1)
    ap.add_argument("--target-pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--target-num-virtual-stages-per-pipeline-rank", type=int, default=None,
                    help="Virtual pipeline stages per rank of the target layout.")
    ap.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                    help="Layers on the first pipeline stage of the target (uneven split).")
    ap.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                    help="Layers on the last pipeline stage of the target (uneven split).")
    ap.add_argument("--target-account-for-embedding-in-pipeline-split", action="store_true",
                    help="Target counts the embedding as a pipeline layer.")
    ap.add_argument("--target-account-for-loss-in-pipeline-split", action="store_true",
                    help="Target counts the output layer and loss as a pipeline layer.")
    ap.add_argument("--load-iteration", type=int, default=None,
                    help="megalite source: iteration to read (default: latest).")
    ap.add_argument("--hf-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of exported Hugging Face weights.")
    ap.add_argument("--hf-architecture", default=None, metavar="NAME",
                    help="Hugging Face architecture to export as (e.g. MistralForCausalLM); "
                    "default: the first registered family that can write the model.")
    return ap


def target_split(model_cfg: dict, args):
    """The target layout's pipeline split (the runtime's rule); one-line errors."""
    from megalite.config import ModelConfig
    from megalite.pipeline_parallel.split import split_layers

    m = ModelConfig(**model_cfg)
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_model_parallel_size
    vpp = args.target_num_virtual_stages_per_pipeline_rank or 1
    if tp < 1 or pp < 1 or vpp < 1:
        raise ValueError("target TP, PP and virtual-stage sizes must be positive")
    for what, n in (("attention heads", m.num_attention_heads),
                    ("query groups", m.resolved_query_groups())):
        if n % tp:
            raise ValueError(f"--target-tensor-parallel-size {tp} does not divide the {n} {what}")
    try:
        return split_layers(m.num_layers, pp, vpp, args.target_decoder_first_pipeline_num_layers,
                            args.target_decoder_last_pipeline_num_layers,
                            args.target_account_for_embedding_in_pipeline_split,
                            args.target_account_for_loss_in_pipeline_split)
    except ValueError as exc:
        raise ValueError(f"target pipeline layout: {exc}") from None


def train_hint(save_dir: str, model_cfg: dict, tp: int, pp: int) -> str:
    """The pretrain_gpt.py flags for the written checkpoint: its model flags (what
    --use-checkpoint-args would read) and the layout it was written for (any other works)."""
    import shlex

    from megalite.checkpointing.checkpoint_args import model_flags

    layout = []
    if tp > 1:
        layout += ["--tensor-model-parallel-size", str(tp)]
    if pp > 1:
        layout += ["--pipeline-model-parallel-size", str(pp)]
    flags = " ".join(shlex.quote(f) for f in model_flags(model_cfg) + layout)
    return (f"model flags for pretrain_gpt.py (or give --use-checkpoint-args instead):\n"
            f"  --load {shlex.quote(save_dir)} {flags}")


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
        split = target_split(model_cfg, args)
        write_checkpoint_from_full(args.save_dir, model_cfg, full, tp, pp, iteration, split)
        vpp = f", VPP={split.vpp}" if split.vpp > 1 else ""
        return (f"wrote megalite checkpoint (TP={tp}, PP={pp}{vpp}, iteration {iteration}) to "
                f"{args.save_dir}\n" + train_hint(args.save_dir, model_cfg, tp, pp))
    adapter = hf.export_hf(args.save_dir, model_cfg, full, dtype=getattr(torch, args.hf_dtype),
                           architecture=args.hf_architecture)
    return f"wrote Hugging Face {adapter.architectures[0]} checkpoint to {args.save_dir}"


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
