"""Multi-Latent Attention, Multi-Token Prediction and the DeepSeek-V3 adapter in one process.

* the imported tiny DeepSeek-V3 gives transformers' logits and its MTP module transformers'
  ``MtpModel`` loss (yarn rope part, interleaved rope rows, MoE with groups, expert bias and
  scaling, a shared expert); the DeepSeek config refusals are one line naming the key;
* what core attention gets: v narrower than q/k on SDPA's fused kernel (zero-padded) equals
  the unfused kernel; the planner's MLA activation bytes equal what a layer saves (fp32 and
  bf16, fused and unfused kernels, with and without the q latent); its MLA and MTP FLOPs
  are Megatron's terms;
* MTP: the last stage holds a tied copy of the word embedding (and, tied, no output
  weight of its own); one-line refusals of impossible flag combinations.
"""
import dataclasses
import math

import pytest
import torch

from deepseek_v3_fixture import LAYERS, VOCAB, hf_config, hf_deepseek_v3, hf_mtp_logits, rel
from megalite.cli.arguments import ConfigError, parse_args
from megalite.checkpointing import hf
from megalite.checkpointing.hf_adapters import UnsupportedModelError
from megalite.checkpointing.model_io import load_full_state_dict
from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import GPTModel, build_model, single_rank_state
from megalite.param_spec import TIED_COPY, TIED_OWNER
from megalite.planner import flops as fl
from megalite.planner import memory as mem
from megalite.planner.layout import Layout
from megalite.transformer.activation_memory import measure_saved
from megalite.transformer.attention_kernels import unfused_attention
from megalite.transformer.extra_losses import collect_extra_losses

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _megalite(path, **over):
    model_cfg, full = hf.import_hf(path)
    m = ModelConfig(**dict(model_cfg, **over))
    model = build_model(MegaliteConfig(model=m), single_rank_state())
    load_full_state_dict(model, full, single_rank_state())
    return m, model


def test_imported_deepseek_v3_gives_hf_logits_and_mtp_loss(tmp_path):
    ref, head = hf_deepseek_v3(str(tmp_path / "hf"))
    m, model = _megalite(str(tmp_path / "hf"))
    assert (m.multi_latent_attention, m.mtp_num_layers, m.rope_type, m.moe_layer_freq) == \
        (True, 1, "yarn", [0, 1, 1])
    with torch.no_grad():
        assert rel(model.eval()(IDS)[..., :VOCAB], ref(IDS).logits) <= 1e-5
        hf_logits = hf_mtp_logits(ref, head, IDS)        # position i predicts t_{i+2}
    expected = torch.nn.functional.cross_entropy(hf_logits[:, :-2].reshape(-1, VOCAB),
                                                 IDS[:, 2:].reshape(-1))
    labels, mask = torch.roll(IDS, -1, -1), torch.ones(IDS.shape)
    mask[:, -1] = 0
    with collect_extra_losses(("mtp_1_loss",)) as extra, torch.no_grad():
        model.train()(IDS, labels=labels, loss_mask=mask)
    (name, got), = extra.terms
    assert name == "mtp_1_loss" and extra.weights == [0.1]       # --mtp-loss-scaling-factor
    assert abs(got.item() - expected.item()) <= 1e-5 * expected.item()
    # `megalite plan --hf-config` counts the model and the MTP module exactly (the vocabulary
    # rows padded to a multiple of 128 for embedding and output layer)
    from megalite.planner import model_spec as ms

    planned = ms.from_hf_config(str(tmp_path / "hf"))
    own = sum(p.numel() for n, p in head.named_parameters() if n.startswith("layers."))
    padding = 2 * (planned.padded_vocab_size(1) - VOCAB) * planned.hidden_size
    assert ms.total_params(planned) == ref.num_parameters() + own + padding
    assert sum(p.numel() for p in model.parameters()) == ms.total_params(planned)


def test_config_without_mtp_weights_imports_without_mtp(tmp_path, capsys):
    hf_deepseek_v3(str(tmp_path / "hf"), mtp=False)
    m, _ = _megalite(str(tmp_path / "hf"))
    assert m.mtp_num_layers is None
    assert "announces 1 MTP layer(s)" in capsys.readouterr().out


@pytest.mark.parametrize("change,key", [
    ({"attention_bias": True}, "attention_bias"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"topk_group": 2, "num_experts_per_tok": 2}, "top-2"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type 'linear'"),
])
def test_deepseek_config_refusals_are_one_line(change, key):
    cfg = hf_config(**change).to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    with pytest.raises(UnsupportedModelError) as err:
        hf.hf_config_to_model_config(cfg)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_only_the_deepseek_adapter_writes_an_mla_model():
    m = dataclasses.asdict(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       seq_length=8, vocab_size=50, normalization="RMSNorm",
                                       position_embedding_type="rope", swiglu=True,
                                       add_bias_linear=False, multi_latent_attention=True,
                                       qk_layernorm=True, norm_epsilon=1e-6))
    assert hf.adapter_for_model(m).architectures == ("DeepseekV3ForCausalLM",)
    with pytest.raises(UnsupportedModelError, match="--multi-latent-attention"):
        hf.adapter_for_model(m, "LlamaForCausalLM")


# ---- core attention and the planner -----------------------------------------------------

def test_narrow_values_on_sdpa_fused_kernel_equal_unfused():
    from megalite.transformer.attention import DotProductAttention

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 16, 10, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 16, 6, generator=g, requires_grad=True)
    m = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                    attention_backend="flash")
    groups = type("G", (), {"cp": type("C", (), {"size": 1})()})()
    attn = DotProductAttention(m, groups, softmax_scale=0.3)
    out = attn(q, k, v)
    ref = unfused_attention(q, k, v, causal=True, scale=0.3)
    assert out.shape == (2, 4, 16, 6) and rel(out, ref) <= 1e-6
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    refs = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(rel(a, b) <= 1e-5 for a, b in zip(grads, refs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["flash", "unfused"])
@pytest.mark.parametrize("q_lora", [48, None])
def test_planner_mla_layer_bytes_are_what_the_layer_saves(dtype, backend, q_lora):
    m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=100, normalization="RMSNorm", position_embedding_type="rope",
                    swiglu=True, add_bias_linear=False, hidden_dropout=0, attention_dropout=0,
                    multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=32,
                    qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                    qk_layernorm=q_lora is not None, ffn_hidden_size=128,
                    attention_backend=backend)
    model = build_model(MegaliteConfig(model=m), single_rank_state()).to(dtype)
    b, s = 2, 32
    x = torch.randn(s, b, 64, dtype=dtype, requires_grad=True)
    rot = model.rotary(s)
    saved, _ = measure_saved(lambda h: model.decoder.layers["0"](h, rot), x,
                             ignore=list(model.parameters()) + list(rot))
    opts = mem.ActivationOptions(backend == "flash", ("core_attn",),
                                 1 if dtype == torch.bfloat16 else 2, True,
                                 backend == "unfused")
    predicted = mem.layer_activation_bytes(m, Layout(world=1, micro_batch=b, global_batch=b),
                                           False, s, opts, "none")
    assert predicted == sum(saved.values())


def test_planner_mla_and_mtp_flops_are_megatrons_terms():
    m = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=1000, swiglu=True, multi_latent_attention=True, q_lora_rank=24,
                    kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                    position_embedding_type="rope")
    h, a = m.hidden_size, m.num_attention_heads
    # megatron/training/training.py num_floating_point_operations, MLA token-linear term
    # (per forward, without its "+1" norm terms) and MTP: eh_proj, one more layer, the logits
    q = m.q_lora_rank * (h + a * (m.qk_head_dim + m.qk_pos_emb_head_dim))
    kv = m.kv_lora_rank * (h + a * (m.qk_head_dim + m.v_head_dim)) + h * m.qk_pos_emb_head_dim
    assert fl.mla_projection_flops(m) == 2 * (q + kv + a * m.v_head_dim * h)
    with_mtp = dataclasses.replace(m, mtp_num_layers=2)
    one = fl.kind_forward_flops(m, False, m.seq_length)
    extra = fl.forward_flops_per_token(with_mtp, m.seq_length) - \
        fl.forward_flops_per_token(m, m.seq_length)
    assert math.isclose(extra, 2 * (one["linear"] + one["core"] + 4 * h * h +
                                    fl.logits_forward_flops(m)))


# ---- MTP's tied embedding on the last stage; refusals -------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_mtp_last_stage_holds_a_tied_embedding_copy(tied):
    """Word and (learned) position embeddings: owner on the first stage, copy on the last,
    in the same order (their gradients are summed and the copy overwritten pairwise)."""
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=50, mtp_num_layers=1,
                    untie_embeddings_and_output_weights=not tied)
    cfg = MegaliteConfig(model=m)
    first = GPTModel(cfg, single_rank_state(), post_process=False, layer_numbers=[0],
                     device="meta")
    last = GPTModel(cfg, single_rank_state(), pre_process=False, layer_numbers=[1],
                    device="meta")
    word = "embedding.word_embeddings.weight"
    assert first.param_table.specs[word].tied == TIED_OWNER
    assert last.param_table.specs[word].tied == TIED_COPY

    def tied_names(chunk, kind):
        return [n for n, _, spec in chunk.param_table.named(chunk) if spec.tied == kind]
    assert tied_names(first, TIED_OWNER) == tied_names(last, TIED_COPY) == \
        [word, "embedding.position_embeddings.weight"]
    assert ("output_layer.weight" in last.param_table.specs) == (not tied)
    assert last.shared_embedding_weight() is last.embedding.word_embeddings.weight
    assert "mtp.layers.0.eh_proj.weight" in last.param_table.specs


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--train-iters", "1",
        "--lr", "1e-3", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("flags,message", [
    (["--multi-latent-attention", "--position-embedding-type", "learned_absolute"],
     "--position-embedding-type rope"),
    (["--multi-latent-attention", "--position-embedding-type", "yarn"], "--rope-type yarn"),
    (["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"],
     "--group-query-attention does not apply to --multi-latent-attention"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "5"], "must be even"),
    (["--rope-type", "yarn"], "--multi-latent-attention"),
    (["--mtp-num-layers", "0"], "--mtp-num-layers"),
    (["--mtp-num-layers", "1", "--context-parallel-size", "2", "--world-size", "2"],
     "--context-parallel-size > 1"),
])
def test_mla_and_mtp_flag_refusals_are_one_line(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_args([*BASE, *flags])
    assert message in str(err.value) and "\n" not in str(err.value)
