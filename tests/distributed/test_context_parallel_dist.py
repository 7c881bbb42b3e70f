"""Context parallelism on real gloo ranks equals the single-process model.

Three levels, each batched into one launch per world size:
  * core attention alone (ring and all-to-all, CP 2 and 4, causal and unmasked, GQA, seq
    64 and 512): output and q/k/v gradients vs full-sequence SDPA, the attention work per
    rank, and the messages per attention from ``comm.counter``;
  * the GPT model at step 1 (CP alone and with TP+SP; Llama-style and GPT-2-style): loss and
    every gradient after the dp-cp reduction vs one process;
  * the training loop over 10 iterations (CP with DP, TP+SP, PP under all three schedules,
    the distributed optimizer, recomputation): per-iteration losses vs one process.
"""
import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from megalite import comm
from megalite.config import ModelConfig
from megalite.context_parallel.a2a import UlyssesAttention
from megalite.context_parallel.load_balance import causal_pairs, token_indices
from megalite.context_parallel.ring import RingAttention, work
from megalite.parallel_state import ParallelState, RankGrid
from megalite.process_groups import ModelCommGroups
from megalite.transformer.spec import AttnMaskType

WORLD = 4


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# ---- core attention --------------------------------------------------------------------
def qkv(seq, heads=8, groups=4, d=8, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, seq, d, generator=g), torch.randn(b, groups, seq, d, generator=g),
            torch.randn(b, groups, seq, d, generator=g), torch.randn(b, heads, seq, d, generator=g))


def reference_attention(seq, causal, groups):
    q, k, v, dout = (t.requires_grad_(True) if i < 3 else t
                     for i, t in enumerate(qkv(seq, groups=groups)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


ATTN_CASES = [(kind, cp, seq, causal, groups)
              for kind in ("p2p", "a2a") for cp in (2, 4) for seq in (64, 512)
              for causal in (True, False) for groups in (8, 4) if seq == 64 or causal]


def _attention_cases(cases):
    rank = torch_dist.get_rank()
    out = []
    for kind, cp, seq, causal, groups in cases:
        state = ParallelState.build(RankGrid(WORLD, cp=cp), rank)
        m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, kv_channels=8,
                        group_query_attention=groups != 8, num_query_groups=groups,
                        attention_dropout=0.0, seq_length=seq)
        cls = RingAttention if kind == "p2p" else UlyssesAttention
        mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
        attn = cls(m, ModelCommGroups.from_parallel_state(state), attn_mask_type=mask)
        idx = token_indices(seq, cp, state.cp.rank)
        q, k, v, dout = (t.index_select(2, idx).contiguous() for t in qkv(seq, groups=groups))
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
        comm.counter.reset()
        work.reset()
        o = attn(q, k, v)
        fwd = comm.counter.snapshot()
        comm.counter.reset()
        o.backward(dout)
        bwd = comm.counter.snapshot()
        out.append(dict(idx=idx, out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad, fwd=fwd,
                        bwd=bwd, computed=work.computed, useful=work.useful,
                        kv_numel=k.numel() * 2, qkv_numel=q.numel() + 2 * k.numel()))
    return out


@pytest.fixture(scope="module")
def attention_results(dist):
    return dist.run(WORLD, _attention_cases, ATTN_CASES)


@pytest.mark.parametrize("case", range(len(ATTN_CASES)),
                         ids=[f"{k}-cp{c}-s{s}-{'causal' if m else 'full'}-g{g}"
                              for k, c, s, m, g in ATTN_CASES])
def test_core_attention_matches_full_sequence(attention_results, case):
    kind, cp, seq, causal, groups = ATTN_CASES[case]
    ref = reference_attention(seq, causal, groups)
    full = [torch.zeros_like(t) for t in ref]
    for r in attention_results[:cp]:                      # ranks 0..cp-1: CP group 0
        res = r[case]
        for buf, key in zip(full, ("out", "dq", "dk", "dv")):
            buf[:, :, res["idx"]] = res[key]
    for name, got, want in zip(("out", "dq", "dk", "dv"), full, ref):
        assert rel(got, want) <= 1e-5, (name, rel(got, want))

    # attention work balanced over CP ranks (the useful, unmasked part too)
    for key in ("computed", "useful"):
        vals = [r[case][key] for r in attention_results[:cp]]
        assert max(vals) <= 1.01 * min(vals), (key, vals)

    # messages per attention, from comm.counter
    res = attention_results[0][case]
    fwd, bwd = res["fwd"], res["bwd"]
    if kind == "p2p":   # K/V heads only: CP-1 transfers forward; K/V CP-1 + dK/dV CP back
        assert fwd == {"cp/send": dict(calls=cp - 1, elements=(cp - 1) * res["kv_numel"],
                                       bytes=4 * (cp - 1) * res["kv_numel"]),
                       "cp/recv": dict(calls=cp - 1, elements=(cp - 1) * res["kv_numel"],
                                       bytes=4 * (cp - 1) * res["kv_numel"])}, fwd
        n = 2 * cp - 1
        assert bwd["cp/send"] == dict(calls=n, elements=n * res["kv_numel"],
                                      bytes=4 * n * res["kv_numel"]), bwd
        assert set(bwd) == {"cp/send", "cp/recv"} and bwd["cp/recv"] == bwd["cp/send"]
    else:               # 2 all-to-alls each way: q|k|v in, output out (and their grads)
        o_numel = res["out"].numel()
        want = dict(calls=2, elements=res["qkv_numel"] + o_numel,
                    bytes=4 * (res["qkv_numel"] + o_numel))
        assert fwd == {"cp/all_to_all": want} and bwd == {"cp/all_to_all": want}, (fwd, bwd)


def test_load_balance_evens_causal_work():
    """The 2CP-chunk layout gives every rank the same causal work; a contiguous split
    gives the last rank ~2CP-1 times the first rank's (what load balancing fixes)."""
    for cp in (2, 4, 8):
        balanced = [causal_pairs(512, cp, r) for r in range(cp)]
        plain = [causal_pairs(512, cp, r, balanced=False) for r in range(cp)]
        assert len(set(balanced)) == 1 and sum(balanced) == sum(plain) == 512 * 513 // 2
        assert plain[-1] / plain[0] > 2 * cp - 2
        assert sorted(torch.cat([token_indices(512, cp, r) for r in range(cp)]).tolist()) \
            == list(range(512))
