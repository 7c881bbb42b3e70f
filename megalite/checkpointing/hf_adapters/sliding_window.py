"""Hugging Face sliding windows <-> ``--window-size`` / ``--window-attn-skip-freq``.

transformers keeps key k for query q when q - W < k <= q (``masking_utils``), so its
``sliding_window: W`` is megalite's (and Megatron's) ``--window-size W-1,0``.  Which layers
slide: ``layer_types`` ("sliding_attention" / "full_attention") when the config has them,
else Mistral's every layer, Qwen2's ``use_sliding_window`` from ``max_window_layers`` on.
"""
from __future__ import annotations

from typing import List, Optional

from megalite.checkpointing.hf_adapters.base import UnsupportedModelError

KINDS = ("sliding_attention", "full_attention")


def windows_from_hf(hf: dict, window: Optional[int], default: List[bool]) -> dict:
    """The window fields of a config whose window is ``window`` (None: off) and whose
    windowed layers are ``layer_types`` or else ``default`` (one bool per layer)."""
    types = hf.get("layer_types")
    if types:
        other = sorted({t for t in types if t not in KINDS})
        if other:
            raise UnsupportedModelError(f"layer_types {other} are not supported (only "
                                        f"{' and '.join(KINDS)})")
        slides = [t == "sliding_attention" for t in types]
    else:
        slides = default
    if window is None or not any(slides):
        if types and any(slides):
            raise UnsupportedModelError("layer_types has sliding_attention layers but the "
                                        "config sets no sliding_window")
        return {"window_size": None, "window_attn_skip_freq": None}
    if int(window) < 1:
        raise UnsupportedModelError(f"sliding_window {window} is not supported (>= 1)")
    return {"window_size": (int(window) - 1, 0),
            "window_attn_skip_freq": None if all(slides) else [int(s) for s in slides]}


def layer_windows(mc) -> List[Optional[int]]:
    """Each layer's window (None: full attention) of a ``ModelConfig``."""
    return [mc.layer_window(i) for i in range(mc.num_layers)]


def hf_window(mc) -> Optional[int]:
    """transformers' ``sliding_window`` of the model (None when no layer slides)."""
    windows = {w for w in layer_windows(mc) if w is not None}
    return next(iter(windows)) + 1 if windows else None


def layer_types(mc) -> List[str]:
    return [KINDS[w is None] for w in layer_windows(mc)]
