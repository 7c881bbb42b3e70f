"""Attention sinks (--softmax-type, Megatron's field; gpt-oss's learned per-head logit in the
softmax denominator): every local core attention gives Hugging Face's eager formula (the
sink as a last score column, dropped after the softmax), forward and gradients, with a
causal mask and a sliding window; ring attention's log-sum-exp fold equals it.  CP and TP
are held to the single-process run in tests/distributed/test_attention_sinks_dist.py."""
import types

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.config import ModelConfig
from megalite.context_parallel.a2a import UlyssesAttention
from megalite.context_parallel.ring import RingAttention
from megalite.transformer.attention import DotProductAttention
from megalite.transformer.attention_masks import additive

B, H, G, S, D = 2, 4, 2, 12, 8


def _groups(tp=1, cp=1):
    size = lambda n: types.SimpleNamespace(size=n, rank=0, name="tp", ranks=[0])  # noqa: E731
    return types.SimpleNamespace(tp=size(tp), cp=size(cp))


def _cfg(softmax_type, window=None):
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=H,
                       group_query_attention=True, num_query_groups=G, seq_length=S,
                       attention_dropout=0.0, softmax_type=softmax_type,
                       window_size=window, window_attn_skip_freq=None)


def hf_eager(q, k, v, sinks, mask):
    """transformers' gpt_oss eager_attention_forward on bhsd tensors."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    w = q @ k.transpose(2, 3) * D ** -0.5 + additive(mask, q.dtype)[:, None]
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([w, col], dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)
    return probs[..., :-1] @ v


def causal(window=None):
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = j <= i
    return (ok & (i - j <= window) if window is not None else ok)[None]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa
    return mk(B, H, S, D), mk(B, G, S, D), mk(B, G, S, D)


@pytest.mark.parametrize("window", [None, (3, 0)])
@pytest.mark.parametrize("core", [DotProductAttention, RingAttention])
def test_local_and_ring_cores_equal_hf_eager(core, window):
    attn = core(_cfg("learnable", window), _groups(), layer_number=0).double()
    assert attn.softmax_offset.shape == (H,)
    with torch.no_grad():
        attn.softmax_offset.copy_(torch.linspace(-2, 3, H))
    q, k, v = _inputs()
    out = attn(q, k, v)
    sinks = attn.softmax_offset.detach().clone().requires_grad_(True)
    ref = hf_eager(q, k, v, sinks, causal(window and window[0]))
    delta = (out - ref).abs().max().item()
    print(f"{core.__name__} window={window}: max |dout| {delta:.2e}")
    assert delta < 1e-12
    if core is RingAttention:     # its CP1 path is forward only (the spec uses it at CP > 1)
        return
    grad = torch.randn_like(out)
    mine = torch.autograd.grad(out, [q, k, v, attn.softmax_offset], grad)
    theirs = torch.autograd.grad(ref, [q, k, v, sinks], grad)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_off_by_one_is_a_zero_sink_and_no_parameter():
    attn = DotProductAttention(_cfg("off-by-one"), _groups()).double()
    assert "softmax_offset" not in dict(attn.named_parameters())
    assert "softmax_offset" not in attn.state_dict()
    q, k, v = _inputs(1)
    ref = hf_eager(q, k, v, torch.zeros(H, dtype=torch.float64), causal())
    torch.testing.assert_close(attn(q, k, v), ref)
    vanilla = DotProductAttention(_cfg("vanilla"), _groups())
    assert vanilla.softmax_offset is None


def test_sinks_split_over_tp_and_all_to_all_takes_its_block():
    tp2 = DotProductAttention(_cfg("learnable"), _groups(tp=2))
    assert tp2.softmax_offset.shape == (H // 2,)
    ulysses = UlyssesAttention(_cfg("learnable"), _groups(), layer_number=0)
    assert ulysses.softmax_offset.shape == (H,)


def test_sdpa_backends_refuse_sinks_in_one_line(capsys):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--train-iters", "1",
            "--lr", "1e-3", "--softmax-type", "learnable", "--attention-backend", "flash",
            ]
    with pytest.raises((SystemExit, ValueError)) as exc:
        parse_args(argv)
    text = (str(exc.value) + capsys.readouterr().err).strip()
    assert "--softmax-type learnable" in text and "unfused" in text, text
    assert parse_args(argv[:-2]).model.softmax_type == "learnable"


def test_te_backend_passes_its_own_sinks_and_names_them_as_local(monkeypatch):
    """With TE layers the sinks are TE's (``softmax_type`` given to its DotProductAttention,
    its ``softmax_offset`` parameter recorded with megalite's spec): the canonical names,
    the name-seeded init, the loss and every gradient equal the local layers' (the stand-in
    TE computes with megalite's kernel; real TE's is in its own tests)."""
    import dataclasses

    import te_fake
    from tiny_model import tiny_model_cfg

    from megalite.backends import te_names
    from megalite.config import MegaliteConfig
    from megalite.models.gpt import build_chunk, single_rank_state

    te_fake.install(monkeypatch)
    m = tiny_model_cfg("llama", seq_length=8, vocab_size=70, num_layers=2, num_query_groups=2,
                       softmax_type="learnable")

    def build(impl):
        cfg = MegaliteConfig(model=dataclasses.replace(m, transformer_impl=impl))
        return build_chunk(cfg, single_rank_state(), device="cpu")

    local, te = build("local"), build("transformer_engine")
    attn = te.decoder.layers["0"].self_attention.core_attention.attention
    assert attn.kwargs["softmax_type"] == "learnable"
    name = "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert te_names.te_to_local_name(
        "decoder.layers.0.self_attention.core_attention.attention.softmax_offset") == name
    assert name in local.param_table.specs and \
        local.param_table.specs[name] == te.param_table.specs[name]
    lsd = local.state_dict()
    te_sd = te_names.to_local_names(te.state_dict())
    torch.testing.assert_close(te_sd[name], lsd[name], rtol=0, atol=0)   # same init
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 70, (2, 8), generator=g) for _ in range(2))
    lloss, tloss = local(ids, labels=labels), te(ids, labels=labels)
    torch.testing.assert_close(tloss, lloss, rtol=1e-6, atol=1e-6)
    lloss.mean().backward()
    tloss.mean().backward()
    grads = {n: p.grad for n, p in local.canonical_named_parameters()}
    for n, p in te.canonical_named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)
    assert grads[name].abs().sum() > 0


def test_sinks_are_named_only_by_their_field_entry_and_kind():
    """The structure target (docs/extending.md, "The attention-variant table"): the sinks are
    their field (config/model.py) and their variant entry (config/attention_variants.py);
    the core attentions, the CP ring and all-to-all, the unfused kernel and TE reach them
    through the softmax-denominator kind (transformer/softmax_denominator.py), which names
    no variant.  The families that use sinks (HF adapter, presets) are not counted."""
    import pathlib
    import megalite
    root = pathlib.Path(megalite.__file__).parent
    skip = {"checkpointing/hf_adapters/gpt_oss.py", "cli/presets.py"}
    naming = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                    if str(p.relative_to(root)) not in skip
                    and "sink" in p.read_text().lower())
    assert naming == ["config/attention_variants.py", "config/model.py"], naming
