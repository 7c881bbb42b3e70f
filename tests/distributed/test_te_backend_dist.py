"""The TE layer spec at TP=2 (with and without SP) on real gloo ranks, through the stand-in
TE package (``tests/te_fake.py``: TE's constructor contract and parameter names, megalite's
collectives): every TE parameter holds this rank's shard of the single-process local model's
value (same canonical names, same split specs), and the loss and the (SP-summed) gradients
equal the single-process local model's within 1e-5."""
import dataclasses

import torch
import torch.distributed as torch_dist

import te_fake
from tiny_model import tiny_forward_backward, tiny_model_cfg  # noqa: E402  (tests/ is on sys.path)
from megalite.config import MegaliteConfig, ParallelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.param_spec import group_coords
from megalite.parallel_state import ParallelState, RankGrid

WORLD, V, S, B, TOL = 2, 70, 8, 2, 1e-5


def model_cfg(arch):
    return tiny_model_cfg(arch, seq_length=S, vocab_size=V)


def step(model, state=None):
    return tiny_forward_backward(model, V, B, S, state)


def _te_at_tp2(cases):
    state = ParallelState.build(RankGrid(WORLD, tp=2), torch_dist.get_rank())
    coords = group_coords(state)
    worst = {}
    with te_fake.installed():
        for arch, sp in cases:
            m = model_cfg(arch)
            ref_cfg = MegaliteConfig(model=m)
            ref = build_model(ref_cfg, single_rank_state())
            ref_loss = step(ref)
            ref_params = dict(ref.canonical_named_parameters())
            cfg = MegaliteConfig(model=dataclasses.replace(m, transformer_impl="transformer_engine"),
                                 world_size=WORLD, parallel=ParallelConfig(
                                     tensor_model_parallel_size=2, sequence_parallel=sp))
            te = build_model(cfg, state, device="cpu")      # TE modules default to cuda
            kinds = {type(te.decoder.layers["0"].self_attention.linear_qkv).__name__,
                     type(te.decoder.layers["0"].mlp.linear_fc2).__name__}
            assert kinds == {"LayerNormLinear", "Linear"}, kinds
            loss = step(te, state)
            err = (loss - ref_loss).abs().max().item()
            for name, p, spec in te.param_table.named(te):
                cut = tuple(slice(0, n) for n in spec.full_shape)     # vocab padding off
                full, grad = ref_params[name].detach()[cut], ref_params[name].grad[cut]
                assert torch.equal(p.detach(), spec.shard(full, coords)), name
                err = max(err, (p.grad - spec.shard(grad, coords)).abs().max().item())
            worst[(arch, sp)] = err
    return worst


def test_te_spec_at_tp2_matches_single_process_local(dist):
    cases = [("llama", False), ("llama", True), ("gpt2", True)]
    for rank_result in dist.run(WORLD, _te_at_tp2, cases):
        for case, err in rank_result.items():
            print(f"TE spec at TP=2 {case}: max |loss/grad - local| = {err:.2e}")
            assert err <= TOL, (case, err)
