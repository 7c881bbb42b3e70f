"""Context parallelism pieces in one process: the load-balanced batch slice, block attention
with its log-sum-exp merge and backward, the spec swap, and the refusals."""
import pytest
import torch
import torch.nn.functional as F

from megalite.backends import context_parallel_spec, get_layer_spec
from megalite.config import ModelConfig
from megalite.context_parallel import core_attention_class
from megalite.context_parallel.a2a import UlyssesAttention
from megalite.context_parallel.block_attention import block_backward, block_forward, merge
from megalite.context_parallel.load_balance import gathered_order, slice_batch, token_indices
from megalite.context_parallel.ring import RingAttention
from megalite.models.gpt_step import get_batch
from megalite.parallel_state import ParallelState, RankGrid
from megalite.parallel_state import ModelCommGroups
from megalite.transformer.attention import DotProductAttention


def test_rank_holds_chunks_r_and_mirror_with_true_positions():
    assert token_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    batch = {"tokens": torch.arange(16).expand(2, 16) + 100, "labels": torch.zeros(2, 16),
             "loss_mask": torch.ones(2, 16)}
    for r in range(4):
        part = slice_batch(batch, 4, r)
        assert part["position_ids"].tolist() == [token_indices(16, 4, r).tolist()] * 2
        assert (part["tokens"] - 100).tolist() == part["position_ids"].tolist()
        assert part["loss_mask"].shape == (2, 4)
    assert sorted(gathered_order(16, 4).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="divisible by 2 x CP"):
        token_indices(12, 4, 0)


def test_get_batch_slices_only_under_cp():
    batch = {"tokens": torch.arange(8)[None], "loss_mask": torch.ones(1, 8)}
    one = ParallelState.build(RankGrid(1), 0, create_groups=False)
    assert get_batch(batch, one, "cpu")["tokens"].tolist() == [list(range(8))]
    cp2 = ParallelState.build(RankGrid(2, cp=2), 1, create_groups=False)
    got = get_batch(batch, cp2, "cpu")
    assert got["tokens"].tolist() == [[2, 3, 4, 5]] and got["position_ids"].tolist() == [[2, 3, 4, 5]]


@pytest.mark.parametrize("groups", [4, 2])
def test_blocks_merged_by_lse_equal_full_attention_and_backward(groups):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, groups, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, groups, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ref.backward(dout)
    scale = 8 ** -0.5
    with torch.no_grad():
        out, lse = block_forward(q, k[:, :, :5], v[:, :, :5], scale, False)
        out, lse = out.clone(), lse.clone().double()
        merge(out, lse, *block_forward(q, k[:, :, 5:], v[:, :, 5:], scale, False))
        torch.testing.assert_close(out, ref)
        delta = (dout * out).sum(-1)
        parts = [block_backward(dout, q, k[:, :, s], v[:, :, s], lse, delta, scale, False)
                 for s in (slice(0, 5), slice(5, None))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], q.grad)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], 2), k.grad)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], 2), v.grad)


def cfg(**kw):
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                seq_length=16)
    base.update(kw)
    return ModelConfig(**base)


def groups(world=2, cp=2, tp=1):
    state = ParallelState.build(RankGrid(world, cp=cp, tp=tp), 0, create_groups=False)
    return ModelCommGroups.from_parallel_state(state)


def test_spec_swaps_only_core_attention():
    spec = get_layer_spec("local")
    cp = context_parallel_spec(spec, "p2p")
    attn, cp_attn = spec.layer.submodules.self_attention, cp.layer.submodules.self_attention
    assert attn.submodules.core_attention is DotProductAttention
    assert cp_attn.submodules.core_attention is RingAttention
    assert cp_attn.submodules.linear_qkv is attn.submodules.linear_qkv
    assert core_attention_class("a2a") is UlyssesAttention
    with pytest.raises(ValueError, match="--cp-comm-type"):
        core_attention_class("ring")


def test_cp_core_attention_refuses_what_it_cannot_do():
    from megalite.cli.arguments import parse_args
    from megalite.config import ConfigError

    # attention dropout: the feature table's refusal (megalite/cli/features.py), before any group
    with pytest.raises(ConfigError, match="--attention-dropout 0"):
        parse_args(["--world-size", "2", "--context-parallel-size", "2", "--num-layers", "2",
                    "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                    "--vocab-size", "64", "--attention-dropout", "0.1", "--lr", "1e-3",
                    "--global-batch-size", "2", "--micro-batch-size", "1", "--mock-data"])
    with pytest.raises(AssertionError, match="splits heads over TP x CP"):   # validation refuses it
        UlyssesAttention(cfg(num_attention_heads=4, group_query_attention=True,
                             num_query_groups=2), groups(world=4, cp=4))
    with pytest.raises(ValueError, match="masks"):
        RingAttention(cfg(), groups(), attn_mask_type="padding")
    # CP size 1 (a replica of the spec on one rank): plain causal attention
    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    torch.testing.assert_close(RingAttention(cfg(), groups(world=1, cp=1))(q, k, v),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_query_tiles_bound_the_score_matrix_and_change_nothing(monkeypatch):
    from megalite.context_parallel import block_attention

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64)
    whole = block_forward(q, k, v, 0.3, True)
    grads = block_backward(dout, q, k, v, whole[1], (dout * whole[0]).sum(-1), 0.3, True)
    monkeypatch.setattr(block_attention, "TILE_ELEMENTS", 2 * 4 * 40 * 3)   # 3 rows a tile
    assert len(block_attention.query_tiles(q, 40)) == 14
    tiled = block_forward(q, k, v, 0.3, True)
    tiled_grads = block_backward(dout, q, k, v, whole[1], (dout * whole[0]).sum(-1), 0.3, True)
    for a, b in zip(whole + grads, tiled + tiled_grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(whole[0], F.scaled_dot_product_attention(q, k, v, scale=0.3,
                                                                        is_causal=True,
                                                                        enable_gqa=True))
