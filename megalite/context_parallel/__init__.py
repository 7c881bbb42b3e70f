"""Context parallelism: the sequence is split over CP ranks for the whole layer.

* ``load_balance``: which tokens each rank holds (2 CP chunks, rank r keeps r and 2CP-1-r)
  and ``slice_batch``, which the model family's ``get_batch`` calls;
* ``ring``: ``RingAttention``, K/V blocks around the ring (``--cp-comm-type p2p``);
* ``a2a``: ``UlyssesAttention``, heads <-> sequence all-to-alls (``--cp-comm-type a2a``);
* ``block_attention``: one block pair of attention with its log-sum-exp (plain torch).

``core_attention_class(comm_type)`` is what the layer spec puts in the core-attention slot.
"""
from __future__ import annotations

from megalite.context_parallel.ring import RingAttention
from megalite.context_parallel.a2a import UlyssesAttention

CP_COMM_TYPES = ("p2p", "a2a")


def core_attention_class(comm_type: str):
    """The core-attention module for ``--cp-comm-type``."""
    if comm_type == "p2p":
        return RingAttention
    if comm_type == "a2a":
        return UlyssesAttention
    raise ValueError(f"unknown --cp-comm-type '{comm_type}'; choose from {CP_COMM_TYPES}")
