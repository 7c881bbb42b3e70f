"""Partial rotary (``--rotary-percent``, HF's ``partial_rotary_factor``): the leading
int(d * p) channels of each head rotate (half-split pairs inside them), the rest pass
through -- equal bit for bit to transformers' GLM-4.5 (``Glm4Moe``) rotary and to
Megatron-Core's; the same rotation in the TE spec as in the local one; the flag's domain."""
import dataclasses

import pytest
import torch

import te_fake
from tiny_model import tiny_model_cfg  # noqa: E402  (tests/ is on sys.path)
from megalite.backends import transformer_engine as te_backend
from megalite.cli.arguments import parse_args
from megalite.config import ConfigError, MegaliteConfig
from megalite.models.gpt import build_chunk, single_rank_state
from megalite.transformer import rotary

transformers = pytest.importorskip("transformers")
from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm  # noqa: E402

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "8", "--vocab-size", "70", "--mock-data", "--train-iters", "1",
        "--lr", "1e-3", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("head_dim,factor", [(16, 0.5), (128, 0.5), (64, 0.25), (24, 0.75)])
def test_tables_and_rotation_equal_glm4_moe_bit_for_bit(head_dim, factor):
    seq = 40
    cfg = transformers.Glm4MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                                     rope_parameters=dict(rope_type="default",
                                                          rope_theta=10000.0,
                                                          partial_rotary_factor=factor))
    hf_emb = hf_glm.Glm4MoeRotaryEmbedding(cfg)
    cos, sin = hf_emb(torch.zeros(1, seq, head_dim), torch.arange(seq)[None])
    m = tiny_model_cfg("llama", kv_channels=head_dim, rotary_percent=factor, seq_length=seq)
    emb = rotary.RotaryEmbedding.from_config(m)
    assert emb.inv_freq.numel() * 2 == rotary.rotary_dim(head_dim, factor) == cos.shape[-1]
    c, s = emb(seq)
    torch.testing.assert_close(c[0, 0], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(s[0, 0], sin[0], rtol=0, atol=0)

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, seq, head_dim, generator=g) for _ in range(2))
    hq, hk = hf_glm.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rotary.apply_rotary(q, c, s), hq, rtol=0, atol=0)
    torch.testing.assert_close(rotary.apply_rotary(k, c, s), hk, rtol=0, atol=0)
    rot = cos.shape[-1]
    assert torch.equal(rotary.apply_rotary(q, c, s)[..., rot:], q[..., rot:])


def test_partial_rotation_equals_megatron_core_and_its_gradient_is_the_inverse():
    mcore = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    g = torch.Generator().manual_seed(1)
    emb = rotary.RotaryEmbedding(8, 10000)                       # 8 of 16 channels
    c, s = emb(6)
    x = torch.randn(6, 2, 3, 16, generator=g)                     # sbhd
    freqs = torch.cat((emb.inv_freq, emb.inv_freq))[None] * torch.arange(6.)[:, None]
    theirs = mcore._apply_rotary_pos_emb_bshd(x, freqs[:, None, None], rotary_interleaved=False)
    ours = rotary.apply_rotary(x, c[0, 0][:, None, None], s[0, 0][:, None, None])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    xd = torch.randn(2, 6, 16, dtype=torch.double, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: rotary.apply_rotary(t, c.double()[0],
                                                                 s.double()[0]), (xd,))


@pytest.fixture
def fake_te(monkeypatch):
    for cached in (te_backend.delayed_scaling_recipe, te_backend.autocast_group_keyword):
        cached.cache_clear()
    yield te_fake.install(monkeypatch)
    for cached in (te_backend.delayed_scaling_recipe, te_backend.autocast_group_keyword):
        cached.cache_clear()


def _model(m, impl):
    cfg = MegaliteConfig(model=dataclasses.replace(m, transformer_impl=impl))
    cfg.training.seed = 7
    return build_chunk(cfg, single_rank_state(), device="cpu")


def test_partial_rotary_changes_the_model_and_the_te_spec_matches_local(fake_te):
    full = tiny_model_cfg("llama", kv_channels=8)
    half = dataclasses.replace(full, rotary_percent=0.5)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 70, (2, 8), generator=g) for _ in range(2))
    local, te = _model(half, "local"), _model(half, "transformer_engine")
    lloss, tloss = local(ids, labels=labels), te(ids, labels=labels)
    torch.testing.assert_close(tloss, lloss, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(_model(full, "local")(ids, labels=labels), lloss)
    tloss.mean().backward()
    lloss.mean().backward()
    lgrads = {n: p.grad for n, p in local.canonical_named_parameters()}
    for n, p in te.canonical_named_parameters():
        torch.testing.assert_close(p.grad, lgrads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_rotary_percent_parses_and_its_domain_is_one_line():
    assert parse_args(BASE + ["--rotary-percent", "0.3"]).model.rotary_percent == 0.3  # 2 of 8
    for value, rot in (("0.1", 0), ("0.4", 3)):
        with pytest.raises(ConfigError, match=rf"^--rotary-percent {value} of --kv-channels 8 "
                                              rf"rotates {rot} channels; give a fraction"):
            parse_args(BASE + ["--rotary-percent", value])
    with pytest.raises(ConfigError, match="^--rotary-percent 0.5 with --multi-latent-attention"):
        parse_args(BASE + ["--rotary-percent", "0.5", "--multi-latent-attention",
                           "--normalization", "RMSNorm"])
