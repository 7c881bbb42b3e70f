"""Muon's pieces in one process: Newton-Schulz, the scale rule, Q/K/V apart, the update
rule against a hand-written step, AdamW for the rest, ownership balance, and state that
round-trips (optimizer/muon.py, optimizer/muon_layout.py)."""
import copy

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.optimizer.muon import (MuonAdamW, is_muon_param, newton_schulz,
                                     orthogonalized, qkv_split_rows, scale_factor)
from megalite.optimizer.muon_layout import assign_owners

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--mock-data", "--train-iters", "1",
        "--lr", "0.02", "--optimizer", "muon"]


def _o(extra=()):
    return parse_args([*BASE, *extra]).optimizer


def test_newton_schulz_gives_near_orthogonal_factor_of_either_orientation():
    g = torch.Generator().manual_seed(0)
    for shape in ((24, 40), (40, 24), (3, 16, 8)):
        m = torch.randn(*shape, generator=g)
        x = newton_schulz(m, 5)
        s = torch.linalg.svdvals(x)
        # the quintic iteration trades exactness for speed: singular values in ~[0.7, 1.2]
        assert s.min() > 0.6 and s.max() < 1.25, (shape, s.min(), s.max())
        # the same direction as the polar factor U V^T
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        cos = (x * (u @ vh)).sum() / (x.norm() * (u @ vh).norm())
        assert cos > 0.95, (shape, cos)
    m = torch.randn(24, 40, generator=g)
    torch.testing.assert_close(newton_schulz(m.T, 5), newton_schulz(m, 5).T)


def test_scale_modes_follow_megatron():
    assert scale_factor(64, 16, "spectral") == 8.0
    assert scale_factor(64, 16, "unit_rms_norm") == 2.0
    assert scale_factor(16, 64, "shape_scaling") == 1.0
    assert scale_factor(64, 16, "shape_scaling") == 2.0


def test_qkv_is_three_matrices_and_only_linear_weights_are_muons():
    cfg = parse_args([*BASE, "--group-query-attention", "--num-query-groups", "2"])
    rows = qkv_split_rows(cfg.model)        # 2 heads per group, head dim 8
    assert rows == [16, 8, 8]
    o = cfg.optimizer
    w = torch.randn(2 * 32, 32, generator=torch.Generator().manual_seed(1))
    got = orthogonalized(w, o, rows)
    grouped = w.view(2, 32, 32)
    q, k, v = (grouped[:, a:b].reshape(-1, 32) for a, b in ((0, 16), (16, 24), (24, 32)))
    want = [newton_schulz(t, 5) * scale_factor(*t.shape, "spectral") for t in (q, k, v)]
    got_g = got.view(2, 32, 32)
    for (a, b), t in zip(((0, 16), (16, 24), (24, 32)), want):
        torch.testing.assert_close(got_g[:, a:b].reshape(-1, 32), t)
    assert is_muon_param("decoder.layers.0.mlp.linear_fc1.weight", 2)
    assert is_muon_param("decoder.layers.0.mlp.experts.linear_fc1.weight", 3)
    for name, nd in (("embedding.word_embeddings.weight", 2), ("output_layer.weight", 2),
                     ("embedding.position_embeddings.weight", 2),
                     ("decoder.layers.0.input_layernorm.weight", 1),
                     ("decoder.layers.0.self_attention.linear_qkv.bias", 1)):
        assert not is_muon_param(name, nd), name


@pytest.mark.parametrize("nesterov", [False, True])
def test_step_is_momentum_then_scaled_orthogonal_update_with_decoupled_decay(nesterov):
    o = _o(["--muon-nesterov"] if nesterov else [])
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(12, 20, generator=gen)
    b = torch.randn(20, generator=gen)
    pw, pb = (torch.nn.Parameter(t.clone()) for t in (w, b))
    opt = MuonAdamW([{"params": [pb], "weight_decay": 0.0},
                     {"params": [pw], "weight_decay": 0.1, "muon": True}], o)
    opt.orthogonalize = lambda ts, us: [orthogonalized(u, o, None) for u in us]
    ref_b = torch.nn.Parameter(b.clone())
    ref = torch.optim.AdamW([ref_b], lr=0.02, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    m, w_ref, mu = torch.zeros_like(w), w.clone(), o.muon_momentum
    for _ in range(3):
        gw, gb = torch.randn(12, 20, generator=gen), torch.randn(20, generator=gen)
        pw.grad, pb.grad, ref_b.grad = gw.clone(), gb.clone(), gb.clone()
        opt.step()
        ref.step()
        m = mu * m + (1 - mu) * gw
        u = (1 - mu) * gw + mu * m if nesterov else m
        w_ref = w_ref * (1 - 0.02 * 0.1) - 0.02 * newton_schulz(u, 5) * 20 ** 0.5
        torch.testing.assert_close(pw.detach(), w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pb.detach(), ref_b.detach())
    assert set(opt.state[pw]) == {"step", "momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq"} <= set(opt.state[pb])
    # a state dict reloads into a fresh optimizer: the next step is the same
    sd = copy.deepcopy(opt.state_dict())
    pw2, pb2 = (torch.nn.Parameter(t.detach().clone()) for t in (pw, pb))
    opt2 = MuonAdamW([{"params": [pb2], "weight_decay": 0.0},
                      {"params": [pw2], "weight_decay": 0.1, "muon": True}], o)
    opt2.orthogonalize = opt.orthogonalize
    opt2.load_state_dict(sd)
    gw, gb = torch.randn(12, 20, generator=gen), torch.randn(20, generator=gen)
    for p, q, g in ((pw, pw2, gw), (pb, pb2, gb)):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(pw, pw2) and torch.equal(pb, pb2)


def test_owners_are_balanced_by_size_and_the_same_everywhere():
    sizes = [3072, 1024, 2048, 2048, 3072, 1024, 2048, 2048]
    owners = assign_owners(sizes, 4)
    assert owners == assign_owners(list(sizes), 4)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(4)]
    assert max(loads) - min(loads) <= max(sizes), loads
    assert sorted(set(owners)) == [0, 1, 2, 3]


def test_muon_without_a_layout_is_a_bug_not_a_silent_local_step():
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = MuonAdamW([{"params": [p], "muon": True}], _o())
    p.grad = torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="orthogonalize"):
        opt.step()


def test_planner_counts_one_momentum_per_matrix_element():
    """The planner's optimizer bytes for Muon are the trainer's, tensor for tensor
    (RMSNorm, no biases: every non-matrix parameter is a norm or an embedding)."""
    from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)
    from megalite.planner.memory import predict_rank_memory
    from state_bytes import storage_bytes  # noqa: E402

    flags = [*BASE, "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--global-batch-size", "2", "--micro-batch-size", "2"]
    trainer = build_cpu_trainer(flags, 1)
    trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    state = [v for st in trainer.optimizer.inner.state.values() for k, v in st.items()
             if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")]
    muon = predict_rank_memory(trainer.cfg, 0)["optimizer"]
    assert storage_bytes(state) == muon
    matrices = sum(p.numel() for n, p in trainer.model_chunks[0].named_parameters()
                   if is_muon_param(n, p.dim()))
    adam = predict_rank_memory(parse_args(flags + ["--optimizer", "adam"]), 0)["optimizer"]
    assert adam - muon == 4 * matrices          # AdamW's second moment, per matrix element
