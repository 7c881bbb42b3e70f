"""Document masking of packed sequences (--reset-attention-mask, --reset-position-ids).

The contract: a packed sample's loss equals the token-weighted sum of its documents'
losses run one by one (the local kernels here; CP, TP and PP in
tests/distributed/test_document_mask_dist.py); the masks follow Megatron's ``get_ltor_masks_and_position_ids``.
"""
import pytest
import torch
import torch.nn.functional as F

from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.context_parallel.block_attention import block_backward, block_forward
from megalite.models.gpt import build_model, single_rank_state
from megalite.transformer.attention_kernels import unfused_attention
from megalite.transformer.attention_masks import (document_ids, document_position_ids, keep,
                                                  mark_documents)

V, EOD = 50, 49


def megatron_masks(tokens, eod):
    """Megatron's get_ltor_masks_and_position_ids (reset both), the loop form."""
    b, s = tokens.shape
    allowed = torch.tril(torch.ones(b, s, s, dtype=torch.bool))
    pos = torch.arange(s).repeat(b, 1)
    for i in range(b):
        prev = 0
        for j in (tokens[i] == eod).nonzero().flatten().tolist():
            allowed[i, j + 1:, :j + 1] = False
            pos[i, j + 1:] -= j + 1 - prev
            prev = j + 1
    return allowed, pos


def packed(seed=0, b=2, s=24, docs=4):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V - 1, (b, s + 1), generator=g)
    for i in range(b):  # EODs at random places (one sample ends on an EOD)
        cut = torch.randperm(s - 1, generator=g)[:docs - 1] + 1
        tokens[i, cut] = EOD
    tokens[0, s - 1] = EOD
    return tokens


def test_masks_and_positions_match_megatron():
    tokens = packed()[:, :-1]
    allowed, pos = megatron_masks(tokens, EOD)
    docs = document_ids(tokens, EOD)
    s = tokens.shape[1]
    ar = torch.arange(s)
    assert torch.equal(keep(ar, ar, True, docs, docs), allowed)
    assert torch.equal(document_position_ids(docs), pos)
    batch = {"tokens": tokens, "position_ids": ar.expand_as(tokens)}
    out = mark_documents(batch, EOD, reset_position_ids=True, reset_attention_mask=False)
    assert torch.equal(out["position_ids"], pos) and "document_ids" not in out
    out = mark_documents(batch, EOD, reset_position_ids=False, reset_attention_mask=True)
    assert torch.equal(out["document_ids"], docs) and out["position_ids"] is batch["position_ids"]


@pytest.mark.parametrize("backend", ["flash", "unfused"])
def test_packed_loss_is_the_sum_of_the_documents_losses(backend):
    """Both local kernels: the packed micro-batch's loss sum equals the documents' loss sums
    run one at a time (positions restarted); gradients agree as well."""
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24,
                    vocab_size=V, make_vocab_size_divisible_by=1, hidden_dropout=0.0,
                    attention_dropout=0.0, normalization="RMSNorm",
                    position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                    group_query_attention=True, num_query_groups=2,
                    attention_backend="unfused" if backend == "unfused" else "flash")
    cfg = MegaliteConfig(model=m, parallel=ParallelConfig())
    model = build_model(cfg, single_rank_state())
    raw = packed()
    batch = mark_documents({"tokens": raw[:, :-1], "labels": raw[:, 1:]}, EOD, True, True)
    loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                 document_ids=batch["document_ids"])
    total = loss.sum()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    one_by_one = 0.0
    for i in range(raw.shape[0]):
        docs = batch["document_ids"][i]
        for d in docs.unique().tolist():
            sel = (docs == d).nonzero().flatten()
            toks, labels = batch["tokens"][i, sel][None], batch["labels"][i, sel][None]
            part = model(toks, torch.arange(sel.numel())[None], labels=labels).sum()
            part.backward()
            one_by_one = one_by_one + part.detach()
    assert torch.allclose(total.detach(), one_by_one, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6), n


def test_block_attention_and_unfused_with_a_document_mask_match_sdpa():
    """The kernels' masked forms against SDPA with the boolean mask: values and gradients
    (the ring's block pairs, fully masked rows included, and the unfused GQA layout)."""
    g = torch.Generator().manual_seed(1)
    b, h, groups, s, d = 2, 4, 2, 16, 8
    q, k, v, dout = (torch.randn(b, n, s, d, generator=g) for n in (h, groups, groups, h))
    tokens = packed(b=b, s=s)[:, :-1]
    docs = document_ids(tokens, EOD)
    ar = torch.arange(s)
    mask = keep(ar, ar, True, docs, docs)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask[:, None], enable_gqa=True)
    ref.backward(dout)
    un_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    un = unfused_attention(*un_in, causal=True, keep_mask=mask)
    un.backward(dout)
    assert torch.allclose(un, ref, atol=1e-5)
    for a, r in zip(un_in, ref_in):
        assert torch.allclose(a.grad, r.grad, atol=1e-5)
    # a block pair of later queries vs earlier keys: some rows see no key at all
    qb, kb, vb = q[:, :, s // 2:], k[:, :, :s // 2], v[:, :, :s // 2]
    blk = keep(ar[s // 2:], ar[:s // 2], True, docs[:, s // 2:], docs[:, :s // 2])
    assert not blk.all(-1).all()
    out, lse = block_forward(qb, kb, vb, d ** -0.5, False, blk)
    assert torch.isfinite(out).all()
    rows = blk.any(-1)[:, None].expand_as(lse)
    assert torch.isneginf(lse[~rows]).all() and (out[~rows] == 0).all()
