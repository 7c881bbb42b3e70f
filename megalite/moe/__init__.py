"""Mixture of experts: top-k router, token dispatchers over the EP group, grouped local
experts, the MoE layer that fills a transformer layer's ``moe_mlp`` slot, and the per-step
load statistics (docs/moe.md)."""
