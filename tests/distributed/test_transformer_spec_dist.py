"""Spec slots under TP=2 + sequence parallelism on real gloo ranks: fused norm+linear slots
and a core attention in the [s, b, heads, d] layout give the single-process loss and norm
gradients (the fused norms see only their sequence shard, like the separate ones)."""
import dataclasses

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

import megalite.models.gpt as gpt
from tiny_model import tiny_forward_backward, tiny_model_cfg  # noqa: E402  (tests/ is on sys.path)
from megalite.backends import get_layer_spec
from megalite.backends.local import fuse_norms
from megalite.config import MegaliteConfig, ParallelConfig
from megalite.parallel_state import ParallelState, RankGrid

WORLD, V, S, B, RTOL = 2, 70, 8, 2, 1e-5


class SbhdAttention(nn.Module):
    """Causal attention on q [s, b, heads, d], k/v [s, b, groups, d] (this rank's heads)."""
    qkv_format = "sbhd"

    def __init__(self, model_cfg, comm_groups, *, layer_number, attn_mask_type):
        super().__init__()

    def forward(self, q, k, v):
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)


def model_cfg(arch):
    return tiny_model_cfg(arch, seq_length=S, vocab_size=V)


def spec_under_test(m):
    spec = fuse_norms(get_layer_spec("local"), m)
    layer = spec.layer.submodules
    attn = layer.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, core_attention=SbhdAttention))
    layer = dataclasses.replace(layer, self_attention=attn)
    return dataclasses.replace(spec, layer=dataclasses.replace(spec.layer, submodules=layer))


def loss_and_norm_grads(model, state=None):
    loss = tiny_forward_backward(model, V, B, S, state)
    grads = {n.replace("self_attention.linear_qkv.layer_norm.", "input_layernorm.")
              .replace("mlp.linear_fc1.layer_norm.", "pre_mlp_layernorm."): p.grad.clone()
             for n, p in model.named_parameters() if "norm" in n}
    return loss.detach(), grads


def _fused_and_sbhd_at_tp2(archs):
    state = ParallelState.build(RankGrid(WORLD, tp=2), torch_dist.get_rank())
    out = []
    original = gpt.spec_choices
    try:
        for arch in archs:
            m = model_cfg(arch)
            gpt.spec_choices = lambda cfg, state, m=m: spec_under_test(m)
            cfg = MegaliteConfig(model=m, world_size=WORLD, parallel=ParallelConfig(
                tensor_model_parallel_size=2, sequence_parallel=True))
            out.append(loss_and_norm_grads(gpt.build_model(cfg, state), state))
    finally:
        gpt.spec_choices = original
    return out


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def test_fused_norms_and_sbhd_attention_match_single_process(dist):
    archs = ["llama", "gpt2"]
    results = dist.run(WORLD, _fused_and_sbhd_at_tp2, archs)
    for i, arch in enumerate(archs):
        ref_loss, ref_grads = loss_and_norm_grads(
            gpt.build_model(MegaliteConfig(model=model_cfg(arch)), gpt.single_rank_state()))
        for loss, grads in (r[i] for r in results):
            assert rel(loss, ref_loss) <= RTOL, arch
            assert set(grads) == set(ref_grads)
            for name, grad in grads.items():
                assert rel(grad, ref_grads[name]) <= RTOL, (arch, name)
