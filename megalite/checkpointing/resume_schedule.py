"""Resuming with another learning-rate / weight-decay schedule than the checkpoint's.

Megatron's ``OptimizerParamScheduler.load_state_dict`` asserts that the resumed run's
schedule (peak and minimum lr, warmup and decay steps, decay style, weight-decay ramp)
equals the checkpoint's, unless ``--override-opt_param-scheduler`` (take the new flags) or
``--use-checkpoint-opt_param-scheduler`` (keep the checkpoint's schedule).  megalite's
schedule is a pure function of the flags (optimizer/lr_schedule.py), so the same comparison
runs before any process group, on the derived schedule: changing ``--train-iters`` while
``--lr-decay-iters`` fixes the decay is no change, as in Megatron.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megalite.config import SECTIONS, ConfigError, MegaliteConfig
from megalite.config.microbatches import BatchSizeSchedule
from megalite.optimizer.lr_schedule import LRScheduler
from megalite.checkpointing.checkpoint_args import read_checkpoint_meta

# derived schedule value -> the flags it is computed from (named in the refusal)
SOURCES = {
    "max_lr": ("lr",), "min_lr": ("min_lr",), "init_lr": ("lr_warmup_init",),
    "warmup_steps": ("lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction",
                     "global_batch_size", "train_iters", "train_samples"),
    "decay_steps": ("lr_decay_iters", "lr_decay_samples", "train_iters", "train_samples",
                    "global_batch_size"),
    "style": ("lr_decay_style",),
    "wsd_decay_steps": ("lr_wsd_decay_iters", "lr_wsd_decay_samples", "global_batch_size"),
    "wsd_decay_style": ("lr_wsd_decay_style",),
    "start_wd": ("start_weight_decay", "weight_decay"),
    "end_wd": ("end_weight_decay", "weight_decay"),
    "wd_incr_steps": ("train_iters", "train_samples", "global_batch_size"),
    "wd_incr_style": ("weight_decay_incr_style",),
    "decoupled_lr": ("decoupled_lr",), "decoupled_min_lr": ("decoupled_min_lr", "min_lr"),
}
_UNIT = {"warmup_steps": "samples", "decay_steps": "samples", "wsd_decay_steps": "samples",
         "wd_incr_steps": "samples"}


def train_iters_of(cfg: MegaliteConfig) -> int:
    t = cfg.training
    if t.train_iters is not None:
        return t.train_iters
    if t.train_samples is None:
        return 0
    dp = cfg.data_parallel_size or 1
    return BatchSizeSchedule.of_run(t, dp, cfg.model.seq_length).train_iters(t.train_samples)


def schedule_of(cfg: MegaliteConfig) -> dict:
    sched = LRScheduler.from_config(cfg, train_iters_of(cfg))
    return {name: getattr(sched, name) for name in SOURCES}


def checkpoint_run_config(meta: dict) -> Optional[MegaliteConfig]:
    """The config the checkpoint's run trained with (its ``args``), or None (a converted
    checkpoint, or one from before args were stored)."""
    args = meta.get("args")
    if not isinstance(args, dict):
        return None
    sections = {}
    for name, klass in SECTIONS.items():
        known = {f.name for f in dataclasses.fields(klass)}
        sections[name] = {k: v for k, v in (args.get(name) or {}).items() if k in known}
    try:
        return MegaliteConfig.from_dict({**sections, "world_size": args.get("world_size", 1)})
    except (TypeError, ValueError):
        return None


def _lookup(cfg: MegaliteConfig, name: str):
    for section in ("optimizer", "training"):
        obj = getattr(cfg, section)
        if hasattr(obj, name):
            return getattr(obj, name)
    raise KeyError(name)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_schedule_matches_checkpoint(cfg: MegaliteConfig, meta: dict, where: str) -> None:
    """A ``ConfigError`` naming the first flag that changes the schedule of the checkpoint
    being resumed, with both values; nothing when the run resumes the same schedule,
    fine-tunes, only evaluates, or says how to treat a change."""
    c, t = cfg.checkpoint, cfg.training
    if c.finetune or t.skip_train or t.dry_run or c.override_opt_param_scheduler or \
            c.use_checkpoint_opt_param_scheduler or cfg.optimizer.lr is None:
        return
    saved = checkpoint_run_config(meta)
    if saved is None or saved.optimizer.lr is None:
        return
    ours, theirs = schedule_of(cfg), schedule_of(saved)
    for key, sources in SOURCES.items():
        a, b = ours[key], theirs[key]
        if a == b or (isinstance(a, float) and isinstance(b, float) and
                      abs(a - b) <= 1e-12 * max(abs(a), abs(b))):
            continue
        changed = [n for n in sources if _lookup(cfg, n) != _lookup(saved, n)] or [sources[0]]
        name = changed[0]
        unit = f" {_UNIT[key]}" if key in _UNIT else ""
        raise ConfigError(
            f"{_flag(name)} {_fmt(_lookup(cfg, name))} changes the schedule of the checkpoint "
            f"in {where} ({key.replace('_', ' ')} {_fmt(a)}{unit}, the checkpoint's "
            f"{_fmt(b)}{unit}; it was trained with {_flag(name)} {_fmt(_lookup(saved, name))}): "
            "give the checkpoint's value, or --override-opt_param-scheduler to use the new "
            "schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def scheduler_for_run(cfg: MegaliteConfig, train_iters: int) -> LRScheduler:
    """The schedule a run steps: the checkpoint's under
    ``--use-checkpoint-opt_param-scheduler`` (Megatron), else the flags'."""
    c = cfg.checkpoint
    if c.use_checkpoint_opt_param_scheduler and c.load and not c.finetune:
        found = read_checkpoint_meta(c.load)
        saved = checkpoint_run_config(found[1]) if found else None
        if saved is not None and saved.optimizer.lr is not None:
            return LRScheduler.from_config(saved, train_iters_of(saved))
        if found is not None:
            raise ConfigError(f"--use-checkpoint-opt_param-scheduler: the checkpoint in "
                              f"{os.path.dirname(os.path.dirname(found[0]))} records no "
                              "schedule (a converted checkpoint); drop the flag")
    return LRScheduler.from_config(cfg, train_iters)
