"""Llama 4's attention on one process: chunked local attention (``--attention-chunk-size``)
keeps each query inside its chunk on the layers that rotate, NoPE layers stay global with
their queries temperature-scaled (``--attn-temperature-tuning``), ``--qk-l2-norm`` scales the
rotating layers' q and k to unit RMS; the kernels agree under the chunk mask.  CP / TP
layouts: tests/distributed/test_document_mask_dist.py; against transformers' Llama 4:
tests/unit/test_hf_families.py (family ``llama4``)."""
import dataclasses
import math

import pytest
import torch

from tiny_model import tiny_model_cfg  # noqa: E402  (tests/ is on sys.path)
from megalite.config import MegaliteConfig
from megalite.models.gpt import build_chunk, single_rank_state
from megalite.transformer import rotary
from megalite.transformer.attention import DotProductAttention
from megalite.transformer.attention_masks import chunk_documents, keep

S, C, V = 24, 8, 70


def _model(m):
    cfg = MegaliteConfig(model=m)
    cfg.training.seed = 3
    return build_chunk(cfg, single_rank_state(), device="cpu").eval()


def test_chunk_documents_keep_exactly_the_pairs_of_one_chunk_and_one_document():
    pos = torch.arange(S)
    docs = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * S])
    ids = chunk_documents(docs, S, C, 2)
    got = keep(pos, pos, True, ids, ids)
    want = (pos[:, None] >= pos[None]) & (pos[:, None] // C == pos[None] // C) & \
        (docs[:, :, None] == docs[:, None, :])
    assert torch.equal(got, want)
    assert bool((ids[:, 1:] >= ids[:, :-1]).all())            # non-decreasing, as documents
    alone = chunk_documents(None, S, C, 3)
    assert alone.shape == (3, S) and torch.equal(alone[0], pos // C)


@pytest.mark.parametrize("no_rope", [None, 2])
def test_a_query_never_sees_an_earlier_chunk_on_chunked_layers(no_rope):
    """All layers chunked: the logits of chunk 2 ignore tokens of chunks 0 and 1.  Every
    other layer NoPE (global): they do not."""
    m = tiny_model_cfg("llama", seq_length=S, vocab_size=V, attention_chunk_size=C,
                       no_rope_freq=no_rope)
    model = _model(m)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, S), generator=g)
    other = ids.clone()
    other[:, :2 * C] = torch.randint(0, V, (2, 2 * C), generator=g)
    with torch.no_grad():
        a, b = model(ids), model(other)
    same = torch.allclose(a[:, 2 * C:], b[:, 2 * C:], rtol=0, atol=1e-6)
    assert same == (no_rope is None)
    assert not torch.allclose(a[:, :2 * C], b[:, :2 * C])


@pytest.mark.parametrize("backend", ["unfused", "flash"])
def test_kernels_agree_under_the_chunk_mask(backend):
    m = tiny_model_cfg("llama", seq_length=S, attention_chunk_size=C)
    ref = tiny_model_cfg("llama", seq_length=S, attention_chunk_size=C, attention_backend="unfused")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, S, 4, generator=g)
    k, v = (torch.randn(2, 4, S, 4, generator=g) for _ in range(2))
    ids = chunk_documents(None, S, C, 2)
    groups = type("G", (), {"cp": type("C", (), {"size": 1})()})()
    got = DotProductAttention(dataclasses.replace(m, attention_backend=backend), groups)(
        q, k, v, document_ids=ids)
    want = DotProductAttention(ref, groups)(q, k, v, document_ids=ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # chunk by chunk, plain causal attention of the chunk alone
    for j in range(S // C):
        part = slice(j * C, (j + 1) * C)
        alone = DotProductAttention(ref, groups)(q[:, :, part], k[:, :, part], v[:, :, part])
        torch.testing.assert_close(got[:, :, part], alone, rtol=1e-5, atol=1e-6)


def test_nope_layers_scale_their_queries_by_the_temperature_of_their_positions():
    pos = torch.tensor([0, 7, 8, 15, 16, 100])
    want = [math.log1p(math.floor((p + 1) / 8)) * 0.1 + 1 for p in pos.tolist()]
    torch.testing.assert_close(rotary.query_temperature(pos, 8, 0.1),
                               torch.tensor(want), rtol=1e-7, atol=0)
    m = tiny_model_cfg("llama", seq_length=S, no_rope_freq=2, attn_temperature_tuning=True,
                       attn_temperature_floor_scale=4)
    emb = rotary.RotaryEmbedding.from_config(m)
    tables = emb(S)
    assert isinstance(tables, rotary.PositionTables) and tables.query_scale.shape == (1, S)
    nope = rotary.nope_tables(tables)
    assert nope[0] is None and nope.query_scale is tables.query_scale
    assert rotary.nope_tables((tables[0], tables[1])) is None          # no temperature
    assert [m.layer_query_temperature(i) for i in range(2)] == [None, (4, 0.1)]
    plain = dataclasses.replace(m, attn_temperature_tuning=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, S), generator=g)
    with torch.no_grad():
        assert not torch.allclose(_model(m)(ids), _model(plain)(ids))


def test_qk_l2_norm_unit_rms_on_the_rotating_layers_only():
    m = tiny_model_cfg("llama", seq_length=S, no_rope_freq=2, qk_l2_norm=True)
    model = _model(m)
    seen = {}
    for i, layer in enumerate(model.decoder.layers.values()):
        att = layer.self_attention
        att.register_forward_hook(lambda mod, args, out, i=i: seen.setdefault(i, mod.l2_norm_eps))
        q = torch.randn(2, 3, 5, 8) * 7
        normed, _ = att._l2_norm_qk(q, q)
        if att.l2_norm_eps is not None:
            torch.testing.assert_close(normed.pow(2).mean(-1), torch.ones(2, 3, 5), rtol=1e-4,
                                       atol=0)
    with torch.no_grad():
        model(torch.randint(0, V, (1, S)))
    assert seen == {0: m.norm_epsilon, 1: None}


def test_the_planner_counts_the_pairs_the_chunks_keep():
    """The attention core of a model whose layer 0 is chunked (16 of 64) and layer 1 NoPE
    (global): the mean over the layers of the causal pairs each keeps, as the mask counts."""
    from megalite.planner.flops import kind_forward_flops

    m = tiny_model_cfg("llama", seq_length=64, attention_chunk_size=16, no_rope_freq=2)
    plain = dataclasses.replace(m, attention_chunk_size=None)
    pos = torch.arange(64)
    ids = chunk_documents(None, 64, 16, 1)
    kept = float(keep(pos, pos, True, ids, ids).sum()) / (64 * 65 / 2)
    ratio = kind_forward_flops(m, False, 64)["core"] / kind_forward_flops(plain, False, 64)["core"]
    assert ratio == pytest.approx((kept + 1) / 2, rel=1e-12)
    assert kind_forward_flops(dataclasses.replace(m, attention_chunk_size=64), False, 64) == \
        kind_forward_flops(plain, False, 64)                   # a chunk of the whole sequence


def test_te_spec_packs_the_chunks_and_matches_local(monkeypatch):
    """Transformer Engine without CP: the chunks reach TE's packed (THD) format as documents
    (the stand-in TE attends each segment of ``cu_seqlens`` on its own)."""
    import te_fake
    from megalite.backends import transformer_engine as te_backend

    for cached in (te_backend.delayed_scaling_recipe, te_backend.autocast_group_keyword):
        cached.cache_clear()
    te_fake.install(monkeypatch)
    m = tiny_model_cfg("llama", seq_length=S, vocab_size=V, attention_chunk_size=C,
                       no_rope_freq=2, attn_temperature_tuning=True, qk_l2_norm=True)
    local = _model(m)
    te = _model(dataclasses.replace(m, transformer_impl="transformer_engine"))
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(te(ids), local(ids), rtol=1e-5, atol=1e-5)
    for cached in (te_backend.delayed_scaling_recipe, te_backend.autocast_group_keyword):
        cached.cache_clear()
