"""``--moe-layer-freq`` and ``--no-rope-freq``: Megatron's per-layer int-or-pattern values,
parsed without ``eval``."""
from __future__ import annotations

import argparse
import ast
from typing import List, Union


class MoeLayerFreqError(argparse.ArgumentTypeError, ValueError):
    """A bad --moe-layer-freq / --no-rope-freq; argparse prints its message as is."""


def _list_pattern(node) -> list:
    """Evaluate a list expression of int literals, ``+`` and ``*`` (no ``eval``)."""
    if isinstance(node, ast.List):
        values = [_list_pattern(e) for e in node.elts]
        if not all(isinstance(v, int) for v in values):
            raise MoeLayerFreqError("list entries must be 0 or 1")
        return values
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_pattern(node.left), _list_pattern(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            return left * right
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
    raise MoeLayerFreqError("use a list of 0/1 with + and *, e.g. '[1,0]*2' or '([1]*3+[0])*2'")


def parse_moe_layer_freq(value) -> Union[int, List[int]]:
    """``--moe-layer-freq`` as Megatron reads it: an int N (layers 0, N, 2N, ... are MoE) or a
    pattern with one 0/1 per layer, written as a Python list expression ("[1,0]*2")."""
    return parse_layer_pattern(value, "--moe-layer-freq")


def parse_no_rope_freq(value) -> Union[int, List[int]]:
    """``--no-rope-freq`` as Megatron reads it: an int N (layers N-1, 2N-1, ... skip RoPE) or
    a 0/1 pattern with one entry per layer, 1 = no RoPE ("([0]*3+[1])*2")."""
    return parse_layer_pattern(value, "--no-rope-freq")


def parse_layer_pattern(value, flag: str) -> Union[int, List[int]]:
    """Megatron's per-layer int-or-pattern value of ``flag``: an int N >= 1, or a 0/1 list
    written as a Python list expression, parsed without ``eval``."""
    if isinstance(value, bool):
        raise MoeLayerFreqError(f"{flag}: expected an int or a 0/1 list, got {value}")
    if isinstance(value, int):
        if value < 1:
            raise MoeLayerFreqError(f"{flag} must be >= 1, got {value}")
        return value
    if isinstance(value, (list, tuple)):
        pattern = list(value)
    else:
        text = str(value).strip()
        if "[" not in text:
            try:
                number = int(text)
            except ValueError:
                raise MoeLayerFreqError(f"{flag}: '{text}' is neither an int nor "
                                        "a list pattern") from None
            return parse_layer_pattern(number, flag)
        try:
            pattern = _list_pattern(ast.parse(text, mode="eval").body)
        except SyntaxError:
            raise MoeLayerFreqError(f"{flag}: cannot parse '{text}'") from None
        if not isinstance(pattern, list):
            raise MoeLayerFreqError(f"{flag}: '{text}' is not a list")
    if any(type(v) is not int or v not in (0, 1) for v in pattern):
        raise MoeLayerFreqError(f"{flag}: pattern entries must be 0 or 1, got {pattern}")
    return pattern
