"""Sliding-window attention (--window-size left,0 and --window-attn-skip-freq): the layer
rule is Megatron's ``is_layer_window_attention``, the mask is transformers' (a window W is
keys q-W < k <= q, i.e. left = W-1), and every local kernel applies it.  CP is held to the
single-process run in tests/distributed/test_document_mask_dist.py."""
import pytest
import torch
import torch.nn.functional as F

from megalite.cli.arguments import parse_args
from megalite.config import ModelConfig
from megalite.transformer.attention import DotProductAttention
from megalite.transformer.attention_masks import keep


def megatron_is_window(window_size, freq, layer_number):
    """megatron/core/transformer/utils.py is_layer_window_attention (1-based layers)."""
    if not window_size:
        return False
    if freq is None:
        return True
    if isinstance(freq, int):
        return layer_number % freq != 0
    return bool(freq[layer_number - 1])


@pytest.mark.parametrize("freq", [None, 2, 6, "[0,0,1,1,1,0]"])
def test_layer_pattern_is_megatrons(freq):
    argv = ["--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--train-iters", "1", "--lr", "1e-3", "--window-size", "127,0"]
    if freq is not None:
        argv += ["--window-attn-skip-freq", str(freq)]
    m = parse_args(argv).model
    assert m.window_size == (127, 0)
    want = freq if not isinstance(freq, str) else eval(freq)
    for layer in range(6):
        assert (m.layer_window(layer) == 127) == megatron_is_window((127, 0), want, layer + 1)
        assert m.layer_window(layer) in (127, None)


def test_bad_window_flags_are_one_line(capsys):
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--train-iters", "1", "--lr", "1e-3"]
    for extra, words in ((["--window-size", "8,3"], "left,0"),
                         (["--window-size", "a,b"], "left,right"),
                         (["--window-size", "8,0", "--window-attn-skip-freq", "[1,0]"],
                          "one 0/1 per layer")):
        with pytest.raises((SystemExit, ValueError)) as exc:
            parse_args(base + extra)
        text = str(exc.value) + capsys.readouterr().err
        assert words in text, (extra, text)


@pytest.mark.parametrize("backend", ["flash", "unfused"])
def test_windowed_attention_is_transformers_mask(backend):
    """W = 5 (HF) = left 4: key k is seen from query q when q - 5 < k <= q."""
    s, W = 24, 5
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=s,
                    vocab_size=64, attention_dropout=0.0, attention_backend=backend,
                    window_size=(W - 1, 0), window_attn_skip_freq=2)
    groups = type("G", (), {"cp": type("C", (), {"size": 1})()})()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, s, 8, generator=g) for _ in range(3))
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    hf = (ki <= qi) & (ki > qi - W)                                # masking_utils' rule
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=hf)
    assert torch.equal(keep(torch.arange(s), torch.arange(s), True, window=W - 1)[0], hf)
    windowed = DotProductAttention(m, groups, layer_number=0)      # layer 1 of 2: windowed
    full = DotProductAttention(m, groups, layer_number=1)          # layer 2: full
    assert torch.allclose(windowed(q, k, v), ref, atol=1e-5)
    assert torch.allclose(full(q, k, v), F.scaled_dot_product_attention(q, k, v,
                                                                         is_causal=True),
                          atol=1e-5)


SWA = {   # transformers config class, model class, config: windows 6 < the 40 positions
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True,
                                                      sliding_window=6, max_window_layers=1,
                                                      num_hidden_layers=3)),
    # Phi-3-mini-4k's sliding_window (2047 there) on every layer, as Mistral's
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=6, pad_token_id=None,
                                                   bos_token_id=1, eos_token_id=2)),
}


def _swa_model(family):
    transformers = pytest.importorskip("transformers")
    from hf_families import COMMON
    config_cls, model_cls, extra = SWA[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("family", list(SWA))
def test_hf_sliding_windows_import_exactly_and_export_back(tmp_path, family):
    """Mistral and Phi-3 (every layer) and Qwen2 (from max_window_layers on): transformers'
    logits on 40 positions past the window of 6, and the exported config slides the same
    layers."""
    from hf_families import VOCAB, rel
    from megalite.checkpointing import hf
    from megalite.checkpointing.model_io import load_full_state_dict
    from megalite.config import MegaliteConfig
    from megalite.models.gpt import build_model, single_rank_state

    ref = _swa_model(family)
    ref.save_pretrained(str(tmp_path))
    model_cfg, full = hf.import_hf(str(tmp_path))
    assert tuple(model_cfg["window_size"]) == (5, 0)
    m = ModelConfig(**model_cfg)
    types = getattr(ref.config, "layer_types", None) or ["sliding_attention"] * m.num_layers
    want = [t == "sliding_attention" for t in types]                 # Mistral: every layer
    assert [m.layer_window(i) is not None for i in range(m.num_layers)] == want
    assert any(want) and (family in ("mistral", "phi3")) == all(want)
    model = build_model(MegaliteConfig(model=m), single_rank_state())
    load_full_state_dict(model.eval(), full, single_rank_state())
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = model(ids)[..., :VOCAB], ref(ids).logits
    assert rel(got, expected) <= 1e-5
    back = hf.adapter_for_model(model_cfg, SWA[family][1]).config_to_hf(model_cfg, "float32") \
        if family == "phi3" else hf.model_config_to_hf_config(model_cfg)   # Phi-3: when asked
    assert back["architectures"] == [SWA[family][1]]
    assert back["sliding_window"] == 6
    if family == "qwen2":
        assert back["use_sliding_window"] and back["max_window_layers"] == 1
        assert back["layer_types"] == ref.config.layer_types


@pytest.mark.parametrize("seq,window,documents", [(64, None, 4), (64, 7, 1), (64, 7, 4),
                                                  (60, 100, 3)])
def test_planner_counts_the_pairs_the_mask_keeps(seq, window, documents):
    """The planner's closed form (attention_work_fraction) is the share of causal pairs the
    real mask keeps; a windowed layer's core FLOPs scale by it, a full layer's do not."""
    from megalite.planner.flops import attention_work_fraction, kind_forward_flops
    pos = torch.arange(seq)
    docs = (pos // (seq // documents))[None]
    mask = keep(pos, pos, True, docs, docs, window)
    assert attention_work_fraction(seq, window, documents) == \
        pytest.approx(float(mask.sum()) / (seq * (seq + 1) / 2))
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=seq,
                vocab_size=64)
    full = kind_forward_flops(ModelConfig(**base), False, seq)
    windowed = kind_forward_flops(ModelConfig(**base, window_size=(7, 0),
                                              window_attn_skip_freq=2), False, seq)
    assert windowed["linear"] == full["linear"]
    assert windowed["core"] == pytest.approx(
        full["core"] * (1 + attention_work_fraction(seq, 7)) / 2)   # half the layers slide
