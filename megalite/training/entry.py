"""What pretrain_gpt.py / pretrain_moe.py call: flags -> validated config -> loop.

Validation (megalite.cli.validation) runs before any process group exists; a bad flag is one
line on stderr and exit status 2 (megalite/cli/boundary.py), printed once however many ranks.
"""
from __future__ import annotations

import sys

from megalite.cli import compat_flags
from megalite.cli.arguments import parse_args
from megalite.cli.boundary import run_cli
from megalite.errors import UserError
from megalite.cli.validation import missing_logging_packages
from megalite.config.megatron_fsdp import describe
from megalite.elastic.relayout import release_spares, wait_as_spare
from megalite.models.gpt_step import GPT_FAMILY
from megalite.parallel_state import RankGrid, launch_env
from megalite.pipeline_parallel.split import pipeline_split
from megalite.pipeline_parallel.stages import layers_of_stage
from megalite.training.dry_run import dry_run
from megalite.training.faults import abort_all_ranks
from megalite.training.loop import pretrain


def describe_run(cfg) -> str:
    return RankGrid.from_config(cfg).describe() + "\n" + describe_batch(cfg)


def describe_batch(cfg) -> str:
    """Batch, vocabulary and pipeline-split lines of the dry run."""
    m, t = cfg.model, cfg.training
    lines = [f"micro-batch {t.micro_batch_size} x {cfg.num_micro_batches} micro-batches x "
             f"DP {cfg.data_parallel_size} = global batch {t.global_batch_size}"]
    if m.vocab_size:
        lines.append(f"vocabulary {m.vocab_size} padded to {cfg.padded_vocab_size}")
    if cfg.parallel.pp > 1:
        lines.append(describe_pipeline_split(cfg))
    return "\n".join(lines)


def describe_pipeline_split(cfg) -> str:
    """One line: the transformer layers of each (pipeline rank, virtual stage)."""
    p = cfg.parallel
    v = p.virtual_stages(cfg.model.num_layers)
    split = pipeline_split(cfg)

    def span(r, c):
        layers = layers_of_stage(cfg, r, c)
        if not layers:                  # a chunk of only the embedding or only the loss
            return "embedding" if split.holds_embedding(r, c) else \
                "loss" if split.holds_output(r, c) else "(no layers)"
        return str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
    ranks = [" | ".join(span(r, c) for c in range(v)) for r in range(p.pp)]
    if cfg.model.mtp_num_layers:        # the MTP modules sit with the loss, on the last stage
        ranks[-1] += f" + MTP x{cfg.model.mtp_num_layers}"
    extra = [name for name, on in (("embedding", p.account_for_embedding_in_pipeline_split),
                                   ("loss", p.account_for_loss_in_pipeline_split)) if on]
    each = "each " if len(extra) > 1 else ""
    note = f" ({' and '.join(extra)} {each}counted as a pipeline layer)" if extra else ""
    if p.pipeline_model_parallel_layout:
        note = f" (--pipeline-model-parallel-layout {p.pipeline_model_parallel_layout})"
    head = "layers per pipeline rank" + (" (virtual stages split by |)" if v > 1 else "")
    return f"{head}: " + "; ".join(f"{r}: {s}" for r, s in enumerate(ranks)) + note


def main(argv=None, prog: str = "pretrain_gpt.py", defaults: dict | None = None,
         family=None):
    """``family``: the ``ModelFamily`` to train (default GPT, ``models/gpt_step.py``)."""
    def _run(argv):
        cfg = parse_args(argv, prog=prog, defaults=defaults)
        if cfg.training.dry_run:
            if cfg.accepted_flags:
                print(compat_flags.describe(cfg.accepted_flags))
            if cfg.parallel.use_megatron_fsdp:
                print(describe(cfg))
            for line in missing_logging_packages(cfg):
                print(f"> note: {line} (not installed here)")
            return dry_run(cfg, argv if argv is not None else sys.argv[1:], describe_batch(cfg))

        rank = launch_env().rank
        if cfg.parallel.elastic and rank >= cfg.world_size:   # the layout trains on fewer
            return wait_as_spare(rank, cfg.world_size)
        try:
            status = pretrain(cfg, family or GPT_FAMILY)
            release_spares(cfg, rank)
            return status
        except UserError:
            raise                       # the boundary: one line, and every rank ends
        except Exception as exc:
            if cfg.world_size > 1:      # end every rank now, not after the timeout
                abort_all_ranks(exc)
            raise

    return run_cli(_run, argv, prog="megalite")
