"""``--window-size`` and ``--window-attn-skip-freq``: Megatron's values, parsed without
``eval`` (the layer pattern as ``--moe-layer-freq``'s)."""
from __future__ import annotations

import argparse
from typing import List, Optional, Union

from megalite.config.moe_layer_freq import MoeLayerFreqError, parse_moe_layer_freq


class WindowFlagError(argparse.ArgumentTypeError, ValueError):
    """A bad window flag; argparse prints its message as is."""


def parse_window_size(value) -> Optional[tuple]:
    """'127,0' or '(127,0)' (Megatron's ``tuple_type``) -> (127, 0); a tuple or list as is."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        parts = list(value)
    else:
        parts = str(value).strip().strip("()[]").split(",")
    try:
        out = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise WindowFlagError(f"--window-size: expected 'left,right' integers, got {value!r}") \
            from None
    if len(out) != 2:
        raise WindowFlagError(f"--window-size: expected two numbers 'left,right', got {value!r}")
    return out


def parse_window_skip_freq(value) -> Union[int, List[int], None]:
    """An int N or a 0/1 pattern, as ``--moe-layer-freq`` is written."""
    if value is None:
        return None
    try:
        return parse_moe_layer_freq(value)
    except MoeLayerFreqError as exc:
        raise WindowFlagError(str(exc).replace("--moe-layer-freq",
                                               "--window-attn-skip-freq")) from None
