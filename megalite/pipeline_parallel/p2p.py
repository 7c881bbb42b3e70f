"""Activations and their gradients between neighbouring pipeline stages.

Shapes are known ahead, so no shape handshake is needed: every message is the hidden
state of one micro-batch, ``[s / cp / (tp if SP), b, h]`` -- with sequence parallelism
only this rank's sequence shard travels (its TP peers send theirs on their own pp group).
Each call is one ``comm.batch_send_recv``: sends and receives posted together so two
neighbours that both send and receive never deadlock.  Which messages go in which call is
decided by ``pipeline_schedules.plan``; ``exchange`` waits for the batch, ``exchange_async`` leaves
the waiting to the caller (the executor's asynchronous p2p).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from megalite import comm


def activation_shape(cfg, state) -> Tuple[int, int, int]:
    """[s, b, h] of the tensor crossing a stage boundary on this rank."""
    m, p = cfg.model, cfg.parallel
    seq = m.seq_length // state.cp.size
    if p.sequence_parallel_active:
        seq //= state.tp.size
    return seq, cfg.training.micro_batch_size, m.hidden_size


class StageLink:
    """Sends and receives of one pipeline rank; peers are given as pp ranks."""

    def __init__(self, state, shape, dtype, device):
        self.group = state.pp
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def exchange(self, sends: Sequence[Tuple[object, torch.Tensor, int]],
                 recvs: Sequence[Tuple[object, int]]) -> Dict[object, torch.Tensor]:
        """Send ``(key, tensor, peer)`` and receive ``(key, peer)``; returns key -> tensor."""
        buffers, pending = self.exchange_async(sends, recvs)
        pending.wait()
        return buffers

    def exchange_async(self, sends: Sequence[Tuple[object, torch.Tensor, int]],
                       recvs: Sequence[Tuple[object, int]]):
        """``exchange`` that returns at once: (key -> receive buffer, ``PendingP2P``); the
        buffers are valid after ``wait()``."""
        ranks = self.group.ranks
        out_sends: List[tuple] = []
        for _, tensor, peer in sends:
            if tuple(tensor.shape) != self.shape:
                raise RuntimeError(f"pipeline send of shape {tuple(tensor.shape)}, expected "
                                   f"{self.shape} ([s/cp/(tp if SP), micro-batch, hidden])")
            out_sends.append((tensor.detach().to(self.dtype), ranks[peer]))
        buffers = {key: torch.empty(self.shape, dtype=self.dtype, device=self.device)
                   for key, _ in recvs}
        pending = comm.batch_send_recv_async(
            out_sends, [(buffers[key], ranks[peer]) for key, peer in recvs], self.group,
            keys=[key for key, _, _ in sends] + [key for key, _ in recvs])
        return buffers, pending
