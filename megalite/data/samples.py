"""One training sample from ``seq_length + 1`` tokens: inputs, shifted labels, loss mask.

Shared by the packed (``gpt_dataset``) and random-window (``random_windows``) datasets, so
both hand the model the same dict and neither imports the other.
"""
from __future__ import annotations

import numpy as np
import torch


def make_sample(tokens: np.ndarray, eod_token: int | None, eod_mask_loss: bool) -> dict:
    """``seq_length + 1`` tokens -> the model's input dict (all tensors of length seq_length)."""
    tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    inputs, labels = tokens[:-1].contiguous(), tokens[1:].contiguous()
    loss_mask = torch.ones(inputs.shape, dtype=torch.float32)
    if eod_mask_loss:
        if eod_token is None:
            raise ValueError("eod_mask_loss needs the tokenizer's eod id (eod_token)")
        loss_mask[inputs == eod_token] = 0.0  # Megatron: no loss on predictions made from an eod
    return {
        "tokens": inputs,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(inputs.numel(), dtype=torch.int64),
    }
