"""Field domains that are not ranges (a blend list, a split string, a checkpoint folder):
``(value, cfg) -> one-line problem or None``, named by ``opt(check=...)`` beside the field.

Each carries ``invalid`` example values, so the walk over every field
(tests/unit/test_field_domains.py) can step outside the domain without a second table.
Imports nothing of the config package but the per-layer pattern parser and the batch-size
schedule (the section modules import this one).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional

from megalite.config.checkpoint_folders import ITERATION, not_converted_problem
from megalite.config.microbatches import rampup_values_problem, step_schedule_problem
from megalite.config.data_flags import parse_data_path, parse_split_numbers
from megalite.config.moe_layer_freq import MoeLayerFreqError, parse_layer_pattern


def domain_check(*invalid):
    """Mark a ``(value, cfg) -> problem`` function as a field domain, with example values
    outside it (for the walk in tests/unit/test_field_domains.py)."""
    def mark(fn: Callable) -> Callable:
        fn.invalid = list(invalid)
        return fn
    return mark


@domain_check(1.5)
def whole_number_problem(value, cfg) -> Optional[str]:
    """a whole number"""
    if int(value) != value:
        return f"--loss-scale-window must be a whole number, got {value}"
    return None


@domain_check("[1,0,1]", 0)
def moe_layer_freq_problem(value, cfg) -> Optional[str]:
    """an int N >= 1 (every N-th layer) or a 0/1 pattern with one entry per layer"""
    return _layer_pattern_problem(value, cfg, "--moe-layer-freq")


@domain_check("[1,0,1]", 0)
def no_rope_freq_problem(value, cfg) -> Optional[str]:
    """an int N >= 1 (every N-th layer skips RoPE) or a 0/1 pattern with one entry per layer"""
    return None if value is None else _layer_pattern_problem(value, cfg, "--no-rope-freq")


def rotary_dim(head_dim: int, rotary_percent: float = 1.0) -> int:
    """Channels of a head that rotate under ``--rotary-percent``: int(head_dim * percent), as
    Megatron-Core's ``RotaryEmbedding`` and HF's ``partial_rotary_factor`` round (the one rule
    ``transformer/rotary.py`` and this check read)."""
    return int(head_dim * rotary_percent) if rotary_percent < 1.0 else head_dim


@domain_check(0.1)
def rotary_percent_problem(value, cfg) -> Optional[str]:
    """a fraction of --kv-channels that rotates an even number >= 2 of channels"""
    m = cfg.model
    if value >= 1.0 or m.hidden_size is None or m.num_attention_heads is None:
        return None
    head_dim = m.resolved_kv_channels()
    rot = rotary_dim(head_dim, value)
    if rot < 2 or rot % 2:
        return (f"--rotary-percent {value} of --kv-channels {head_dim} rotates {rot} "
                "channels; give a fraction that rotates an even number >= 2 of them")
    return None


def _layer_pattern_problem(value, cfg, flag: str) -> Optional[str]:
    try:
        freq = parse_layer_pattern(value, flag)
    except MoeLayerFreqError as exc:
        return str(exc)
    layers = cfg.model.num_layers
    if isinstance(freq, list) and layers is not None and len(freq) != layers:
        return f"{flag} pattern has {len(freq)} entries for --num-layers {layers}; " \
               "give one 0/1 per layer"
    return None


def blend_problem(flag: str) -> Callable:
    """The domain of a ``--data-path``-style blend list, its messages naming ``flag``
    (``--data-path`` and Megatron's per-split ``--train/valid/test-data-path``)."""
    @domain_check(["-1", "corpus"], ["/nonexistent-megalite-walk/corpus"])
    def problem(value, cfg) -> Optional[str]:
        """[w1] p1 [w2] p2 ...: finite non-negative weights, prefixes with .bin and .idx"""
        for item in value:
            try:
                weight = float(item)
            except ValueError:
                continue
            if not (math.isfinite(weight) and weight >= 0):
                return f"{flag} weight {item!r} must be a finite, non-negative number"
        try:
            _, prefixes = parse_data_path(value, flag) if value else (None, [])
        except ValueError as exc:        # an odd number of items, a weight without prefix
            return str(exc)
        for item in prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(item + ext):
                    return f"{flag}: '{item}{ext}' does not exist; run " \
                           "tools/preprocess_data.py to create it"
        return None
    return problem


data_blend_problem = blend_problem("--data-path")


@domain_check("90,5,4,1", "0,0,0")
def split_problem(value, cfg) -> Optional[str]:
    """1-3 non-negative weights with a positive sum (Megatron's parsing)"""

    try:
        parse_split_numbers(value)
    except ValueError as exc:
        return str(exc)
    return None


@domain_check(["8", "x", "100"], ["0", "8", "100"])
def rampup_problem(value, cfg) -> Optional[str]:
    """START >= 1, INCREMENT >= 1, SAMPLES >= 0"""

    return rampup_values_problem(value)


@domain_check(["100-16"], ["2.4X:320"], ["1T:16"], ["0:16", "0:32"], ["0:0"])
def step_batch_schedule_problem(value, cfg) -> Optional[str]:
    """THRESHOLD:BATCH pairs (K/M/B/T suffixes, tokens), from 0 up; not with --rampup-batch-size

    Megatron-LM's parsing and checks (``megalite/config/microbatches.py``)."""
    if value and cfg.training.rampup_batch_size:
        return "--step-batch-size-schedule replaces --rampup-batch-size (Megatron-LM " \
               "deprecated the ramp for it); give only one of them"
    return step_schedule_problem(value, cfg.model.seq_length)


def warmup_problem(unit: str) -> Callable:
    """``--lr-warmup-iters`` / ``--lr-warmup-samples`` below the decay it warms up to
    (``--lr-decay-{unit}``, default ``--train-{unit}``): Megatron-Core's scheduler asserts
    warmup steps < decay steps."""
    @domain_check(10 ** 12)
    def problem(value, cfg) -> Optional[str]:
        """smaller than --lr-decay-UNIT (default --train-UNIT), as Megatron requires"""
        if unit == "samples" and value and cfg.training.train_iters is not None:
            # iteration-based runs warm up in iterations (the schedule ignores samples here)
            return "--lr-warmup-samples is for --train-samples runs; with --train-iters give " \
                   "--lr-warmup-iters, as Megatron-LM requires"
        decay = getattr(cfg.optimizer, f"lr_decay_{unit}") or getattr(cfg.training,
                                                                      f"train_{unit}")
        if value and decay and value >= decay:
            source = f"--lr-decay-{unit}" if getattr(cfg.optimizer, f"lr_decay_{unit}") \
                else f"--train-{unit}"
            words = "iterations" if unit == "iters" else unit
            return f"--lr-warmup-{unit} ({value}) must be smaller than the {words} the lr " \
                   f"decays over ({decay}, {source}), as Megatron-LM requires"
        return None
    return problem


@domain_check("/nonexistent-megalite-walk/ckpt")
def load_dir_problem(value, cfg) -> Optional[str]:
    """the folder a run saved with --save (not one of its iter_* folders, not a Hugging Face one)

    ``--load X --save X`` may name a folder the first run has not created yet."""
    if not os.path.exists(value) and value == cfg.checkpoint.save:
        return None
    if not os.path.exists(value):
        return f"--load: '{value}' does not exist; give the folder a run saved with --save"
    if not os.path.isdir(value):
        return f"--load: '{value}' is not a folder; give the folder a run saved with --save"
    hf = not_converted_problem("--load", value)
    if hf:
        return hf
    name = os.path.basename(os.path.normpath(value))
    match = ITERATION.fullmatch(name)
    if match:
        parent = os.path.dirname(os.path.normpath(value)) or "."
        return f"--load: '{value}' is one checkpoint of a run; pass its parent folder: " \
               f"--load {parent} --ckpt-step {int(match.group(1))}"
    return None


@domain_check((5, 3), (-2, 0))
def window_size_problem(value, cfg) -> Optional[str]:
    """left >= 0 (or -1: no window), right 0 (the models are causal)"""
    if value is None:
        return None
    left, right = value
    if left < -1 or right != 0:
        return f"--window-size {left},{right}: give 'left,0' with left >= 0 (keys i-left .. i " \
               "of a causal model; -1 for no window)"
    return None


@domain_check([1, 0, 1])
def window_skip_freq_problem(value, cfg) -> Optional[str]:
    """an int N >= 1 or a 0/1 pattern with one entry per layer"""
    layers = cfg.model.num_layers
    if isinstance(value, list) and layers is not None and len(value) != layers:
        return f"--window-attn-skip-freq pattern has {len(value)} entries for --num-layers " \
               f"{layers}; give one 0/1 per layer"
    return None
