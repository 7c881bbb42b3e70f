#!/usr/bin/env python
"""Convert model checkpoints: Hugging Face <-> megalite, and megalite re-layout.

    python tools/checkpoint/convert.py --source-format hf --target-format megalite \
        --load-dir llama-hf/ --save-dir ckpt/ \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --source-format megalite --target-format hf \
        --load-dir ckpt/ --save-dir llama-hf-out/

The megalite checkpoint written is the one format training writes
(``torch.distributed.checkpoint`` files + metadata.json + manifest + marker; weights only),
so ``pretrain_gpt.py``/``pretrain_moe.py --load`` and ``python -m megalite.generate`` read
it at ANY layout: DCP reshards on load.  The ``--target-*`` layout flags (Megatron's
names; the same layout flags as pretrain_gpt.py's) are checked against the model and say
which pieces each tensor is cut into: a run at that layout reads exactly its own pieces,
any other layout reads and reslices them.  A megalite source may be a training checkpoint
(any layout, MoE included) or a pre-DCP one.  Hugging Face models go through the adapter
registered for their architecture (``megalite.checkpointing.hf_adapters``: Llama,
Mistral, Qwen2, Qwen3, Mixtral, Qwen-MoE, DeepSeek-V3, Phi-3, SmolLM3, OLMo 2;
docs/models.md).  Runs in one process on CPU.  Errors are one
line, exit status 2.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script from anywhere: use this checkout's megalite
    sys.path.insert(0, _ROOT)

from megalite.cli.boundary import run_cli  # noqa: E402  (after the path: this checkout's)
from megalite.errors import CheckpointError, Interrupted  # noqa: E402

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-format", choices=["hf", "megalite"], required=True)
    ap.add_argument("--target-format", choices=["hf", "megalite"], required=True)
    ap.add_argument("--load-dir", required=True, help="Checkpoint to read.")
    ap.add_argument("--save-dir", required=True, help="Where to write the converted checkpoint.")
    ap.add_argument("--target-tensor-parallel-size", type=int, default=1)
    ap.add_argument("--target-pipeline-model-parallel-size", "--target-pipeline-parallel-size",
                    dest="target_pipeline_model_parallel_size", type=int, default=1)
    ap.add_argument("--target-expert-model-parallel-size", "--target-expert-parallel-size",
                    dest="target_expert_model_parallel_size", type=int, default=1,
                    help="Expert-parallel size (EP) of the target layout (MoE models).")
    ap.add_argument("--target-expert-tensor-parallel-size", type=int, default=None,
                    help="Tensor-parallel size inside the experts (default: the target TP).")
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


# the runtime's layout flags, as this tool spells them
_TARGET_FLAGS = {"--tensor-model-parallel-size": "--target-tensor-parallel-size",
                 **{f"--{f}": f"--target-{f}" for f in (
                     "pipeline-model-parallel-size", "expert-model-parallel-size",
                     "expert-tensor-parallel-size", "num-virtual-stages-per-pipeline-rank",
                     "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers",
                     "account-for-embedding-in-pipeline-split",
                     "account-for-loss-in-pipeline-split")}}
_FLAG_RE = re.compile("|".join(map(re.escape, _TARGET_FLAGS)) + r"\b")


def target_config(model_cfg: dict, args):
    """The target layout as a ``MegaliteConfig``, checked by the runtime's own layout rules
    (``megalite.cli.validation``), so a checkpoint is refused here exactly when a run at that
    layout would refuse it; messages name this tool's ``--target-*`` flags."""
    from megalite.cli import validation
    from megalite.config import (ConfigError, MegaliteConfig, ModelConfig, ParallelConfig,
                                 all_fields)
    from megalite.config.domains import field_problem

    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_model_parallel_size
    ep, etp = args.target_expert_model_parallel_size, args.target_expert_tensor_parallel_size
    parallel = ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        num_virtual_stages_per_pipeline_rank=args.target_num_virtual_stages_per_pipeline_rank,
        decoder_first_pipeline_num_layers=args.target_decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.target_decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.target_account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.target_account_for_loss_in_pipeline_split,
        sequence_parallel=tp > 1)          # MoE with TP needs it; it changes no weight
    cfg = MegaliteConfig(model=ModelConfig(**model_cfg), parallel=parallel)
    try:
        for section, f in all_fields():        # the layout flags' declared domains
            if section == "parallel":
                problem = field_problem(cfg, section, f, getattr(parallel, f.name))
                if problem:
                    raise ConfigError(problem)
        cfg.world_size = math.lcm(tp, ep * parallel.etp) * pp     # both grids tile it
        for check in (validation.check_layout_features,        # the engine's layout rules
                      validation.check_virtual_stages, validation.check_stage_split,
                      validation.check_attention_shape, validation.check_experts):
            check(cfg)
    except ConfigError as exc:
        raise ValueError("target layout: " + _FLAG_RE.sub(lambda m: _TARGET_FLAGS[m.group(0)],
                                                         str(exc))) from None
    return cfg


def train_hint(save_dir: str, model_cfg: dict, cfg) -> str:
    """The pretrain_gpt.py flags for the written checkpoint: its model flags (what
    --use-checkpoint-args would read) and the layout it was cut for (any other works)."""
    import shlex

    from megalite.checkpointing.checkpoint_args import model_flags

    p, layout = cfg.parallel, []
    for flag, value, default in (("--tensor-model-parallel-size", p.tp, 1),
                                 ("--pipeline-model-parallel-size", p.pp, 1),
                                 ("--expert-model-parallel-size", p.ep, 1),
                                 ("--expert-tensor-parallel-size",
                                  p.expert_tensor_parallel_size, None),
                                 ("--num-virtual-stages-per-pipeline-rank",
                                  p.num_virtual_stages_per_pipeline_rank, None),
                                 ("--decoder-first-pipeline-num-layers",
                                  p.decoder_first_pipeline_num_layers, None),
                                 ("--decoder-last-pipeline-num-layers",
                                  p.decoder_last_pipeline_num_layers, None)):
        if value != default:
            layout += [flag, str(value)]
    for flag, on in (("--account-for-embedding-in-pipeline-split",
                      p.account_for_embedding_in_pipeline_split),
                     ("--account-for-loss-in-pipeline-split",
                      p.account_for_loss_in_pipeline_split),
                     ("--sequence-parallel", p.tp > 1 and bool(cfg.model.num_experts))):
        if on:
            layout.append(flag)
    flags = " ".join(shlex.quote(f) for f in model_flags(model_cfg) + layout)
    return (f"model flags for pretrain_gpt.py (or give --use-checkpoint-args instead):\n"
            f"  --load {shlex.quote(save_dir)} {flags}")


def hf_tokenizer(directory: str, vocab_size: int):
    """The HF directory as a HuggingFaceTokenizer, when it holds a tokenizer (so
    --use-checkpoint-args and megalite.generate find it); None otherwise."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(directory, n)) for n in names):
        return None
    return {"tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": os.path.abspath(directory), "vocab_size": vocab_size}


def convert(args) -> str:
    from megalite.checkpointing import hf, hf_files
    from megalite.checkpointing.model_io import full_state_dict_from_checkpoint, read_metadata

    if not os.path.isdir(args.load_dir):
        raise FileNotFoundError(f"--load-dir '{args.load_dir}' does not exist")
    iteration, info = 0, {"converted_from": {"format": args.source_format,
                                             "path": os.path.abspath(args.load_dir)}}
    if args.source_format == "hf":
        model_cfg, full = hf.import_hf(args.load_dir)
        tok = hf_tokenizer(args.load_dir, model_cfg["vocab_size"])
        info["extra"] = {"hf": hf_files.side_files_record(args.load_dir)}
        if tok:
            info["extra"]["tokenizer"] = tok
            info["args"] = {"model": model_cfg, "data": {k: tok[k] for k in
                                                         ("tokenizer_type", "tokenizer_model")}}
    else:
        meta = read_metadata(args.load_dir, args.load_iteration)
        iteration = meta["iteration"]
        model_cfg, full = full_state_dict_from_checkpoint(args.load_dir, args.load_iteration)
        # what the source says beyond its tensors: its run's flags and tokenizer (MoE expert
        # biases travel in ``full``, as the HF adapters read and write them)
        kept = {k: v for k, v in (meta.get("extra") or {}).items()
                if k in ("consumed_samples", "tokenizer", "hf")}
        info["extra"] = kept
        if isinstance(meta.get("args"), dict):
            info["args"] = dict(meta["args"], model=model_cfg)
    if args.target_format == "megalite":
        from megalite.checkpointing.checkpoint import save_model_checkpoint

        cfg = target_config(model_cfg, args)
        p = cfg.parallel
        sizes = {"tp": p.tp, "pp": p.pp, "ep": p.ep, "expert-tp": p.etp,
                 "vpp": p.virtual_stages(cfg.model.num_layers)}
        save_model_checkpoint(args.save_dir, model_cfg, full, sizes, iteration, info)
        names = {"tp": "TP", "pp": "PP", "ep": "EP", "expert-tp": "expert-TP", "vpp": "VPP"}
        cut = ", ".join(f"{names[k]}={v}" for k, v in sizes.items() if v > 1 or k in ("tp", "pp"))
        return (f"wrote megalite checkpoint (iteration {iteration}, weights only; cut for "
                f"{cut}, loads at any layout) to {args.save_dir}\n"
                + train_hint(args.save_dir, model_cfg, cfg))
    side = hf_files.export_record(info.get("extra") or {})
    adapter = hf.export_hf(args.save_dir, model_cfg, full, dtype=getattr(torch, args.hf_dtype),
                           architecture=args.hf_architecture, side=side)
    done = f"wrote Hugging Face {adapter.architectures[0]} checkpoint to {args.save_dir}"
    missing = hf_files.missing_side_files(side)
    if missing:
        done += (f"\nnote: not copied (gone since the import): {', '.join(missing)}; copy "
                 f"them into {args.save_dir} for AutoTokenizer")
    return done


def _convert(argv) -> int:
    args = build_parser().parse_args(argv)
    existed, started = os.path.isdir(args.save_dir), time.time()
    try:
        print(convert(args))
    except (FileNotFoundError, ValueError, KeyError) as exc:  # UnsupportedModelError is a ValueError
        raise CheckpointError(exc.args[0] if exc.args else str(exc)) from None
    except BaseException as exc:
        # Ctrl-C while reading or writing (DCP hands it on as the cause of its own error)
        if not isinstance(exc, KeyboardInterrupt) and \
                not isinstance(exc.__cause__, KeyboardInterrupt):
            raise
        _remove_partial(args.save_dir, existed, started)
        raise Interrupted(f"interrupted by Ctrl-C while converting {args.load_dir}; nothing "
                          f"was written to {args.save_dir}") from None
    return 0


def _remove_partial(save_dir: str, existed: bool, started: float) -> None:
    """What an interrupted conversion wrote: the folder it created, or (a folder that was
    there before) the files it wrote since ``started`` (a megalite target's iteration folder
    is already gone: save_model_checkpoint removes it)."""
    if not existed:
        shutil.rmtree(save_dir, ignore_errors=True)
        return
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if os.path.isfile(path) and os.path.getmtime(path) >= started:
            os.remove(path)


def main(argv=None) -> int:
    """Behind the entry points' boundary: a mistake (a missing or truncated file, a layout
    that does not fit) is one line, exit status 2; Ctrl-C is ``Interrupted``; a closed
    output pipe (``| head -1``) ends quietly."""
    return run_cli(_convert, argv, prog="convert.py")


if __name__ == "__main__":
    sys.exit(main())
