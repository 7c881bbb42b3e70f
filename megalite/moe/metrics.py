"""Per-step MoE statistics for the log, and the expert-bias update that needs them.

Called by the loop after each optimizer step (``ModelFamily.after_train_step``).  Every
rank fills the rows of the MoE layers it holds -- expert counts (already summed over the
TP and CP ranks that hold parts of the same tokens), summed aux / z terms and the number
of micro-batches -- then the table is summed over dp-cp (other tokens of the global batch;
each CP rank's counts are the same whole-sequence counts, so their sum is divided by CP)
and pp (other layers): ``transformer/loss_reduction.reduce_moe_step_table``.  So every rank ends with the global-batch statistics of every MoE
layer, the expert bias moves identically on every rank that holds a layer, and the writer
(last stage) can log the layers of all stages.
"""
from __future__ import annotations

import torch

from megalite.moe.moe_layer import moe_layers
from megalite.transformer.loss_reduction import reduce_moe_step_table


def moe_step_metrics(chunks, cfg, state) -> dict:
    m = cfg.model
    if not m.num_experts:
        return {}
    ids = [n for n in range(m.num_transformer_layers()) if m.is_moe_layer(n)]  # + MTP's
    E = m.num_experts
    held = moe_layers(chunks)
    device = next(iter(chunks[0].parameters())).device
    table = torch.zeros(len(ids), E + 3, dtype=torch.float64, device=device)
    for row, n in enumerate(ids):
        stats = held[n].step_stats if n in held else None
        if stats is not None:
            table[row, :E] = stats["counts"]
            table[row, E:] = torch.tensor([float(stats["aux_loss"]),
                                           float(stats["z_loss"]), stats["micro_batches"]],
                                          dtype=torch.float64)
    reduce_moe_step_table(table, E, state)
    out = {}
    ratios = []
    for row, n in enumerate(ids):
        counts, (aux, z, mbs) = table[row, :E], table[row, E:].tolist()
        if mbs == 0:
            continue
        if n in held:
            held[n].update_expert_bias(counts, m.moe_router_bias_update_rate)
            held[n].step_stats = None
        ratio = float(counts.max() / counts.mean().clamp_min(1e-12))
        ratios.append(ratio)
        out[f"moe_layer_{n}_aux_loss"] = aux / mbs
        out[f"moe_layer_{n}_z_loss"] = z / mbs
        out[f"moe_layer_{n}_tokens_per_expert"] = [int(c) for c in counts.tolist()]
        out[f"moe_layer_{n}_load_balance"] = ratio
    if ratios:
        out["moe_load_balance"] = max(ratios)   # worst layer's max/mean tokens per expert
    return out
