"""DeepSeek-V3-architecture configs as they are released, through the DeepSeek-V3 adapter,
in one process: an ``rms_norm_eps`` other than the 1e-6 transformers keeps in the q/kv
latent norms (``--mla-latent-norm-epsilon``), Moonlight (``model_type: deepseek_v3``, no q
latent, 2 shared experts, ``rms_norm_eps`` 1e-5) and Kimi K2 (``model_type: kimi_k2``,
YaRN written as the old ``rope_scaling.type``); each gives transformers' logits, and
exports back to a folder transformers reads with the same logits.  The configs are
written by hand at tiny sizes with the released files' keys (Moonlight-16B-A3B and
Kimi-K2-Instruct config.json); what such a config holds that megalite does not build
(the FP8 ``quantization_config`` of Kimi K2 and DeepSeek-V3) is one line naming the key.
"""
import json

import pytest
import torch

from deepseek_v3_fixture import rel
from megalite.checkpointing import hf
from megalite.checkpointing.hf_adapters import UnsupportedModelError
from megalite.checkpointing.model_io import load_full_state_dict
from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state

transformers = pytest.importorskip("transformers")
VOCAB = 96
IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=8,
            topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
            hidden_act="silu", attention_bias=False, attention_dropout=0.0,
            tie_word_embeddings=False, initializer_range=0.02, num_nextn_predict_layers=0,
            architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16")
# training-only keys of the released files (megalite has its own flags for them)
RELEASED = dict(aux_loss_alpha=0.001, seq_aux=True, ep_size=1, pretraining_tp=1,
                auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
                use_cache=True, transformers_version="4.48.3")
CONFIGS = {
    # a DeepSeek-V3 whose other norms use a large epsilon, so the latent norms' 1e-6 shows
    "deepseek_v3_eps": dict(TINY, model_type="deepseek_v3", q_lora_rank=16, n_group=2,
                            topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                            routed_scaling_factor=2.5, rms_norm_eps=0.05, rope_theta=10000.0,
                            max_position_embeddings=32),
    "moonlight": dict(TINY, **RELEASED, model_type="deepseek_v3", q_lora_rank=None, n_group=1,
                      topk_group=1, num_experts_per_tok=3, n_shared_experts=2,
                      routed_scaling_factor=2.446, rms_norm_eps=1e-05, rope_theta=50000.0,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2),
    "kimi_k2": dict(TINY, **RELEASED, model_type="kimi_k2", q_lora_rank=16, n_group=1,
                    topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
                    routed_scaling_factor=2.827, rms_norm_eps=1e-06, rope_theta=50000.0,
                    max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                    rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 1.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "original_max_position_embeddings": 8}),
}
EXPECT = {"deepseek_v3_eps": dict(norm_epsilon=0.05, mla_latent_norm_epsilon=1e-6,
                                  moe_router_num_groups=2),
          "moonlight": dict(norm_epsilon=1e-5, mla_latent_norm_epsilon=1e-6, q_lora_rank=None,
                            moe_shared_expert_intermediate_size=32, moe_router_num_groups=None),
          "kimi_k2": dict(norm_epsilon=1e-6, mla_latent_norm_epsilon=None, rope_type="yarn",
                          rotary_scaling_factor=4.0, moe_router_topk_scaling_factor=2.827)}


def _save(name, path):
    """The transformers model of CONFIGS[name], saved with the hand-written config.json."""
    cfg = CONFIGS[name]
    built = {k: v for k, v in cfg.items() if k not in ("model_type", "auto_map")}
    torch.manual_seed(0)
    ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**built)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:          # away from 1: a swapped or mis-scaled norm shows
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.dim() > 1:        # large enough that the latents' epsilon matters
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for n, b in ref.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_((torch.rand(b.shape, generator=g) - 0.5) / 10)
    ref.save_pretrained(path)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return ref


def _logits(model_cfg, full, **over):
    m = ModelConfig(**dict(model_cfg, **over))
    model = build_model(MegaliteConfig(model=m), single_rank_state())
    load_full_state_dict(model, full, single_rank_state())
    with torch.no_grad():
        return model.eval()(IDS)[..., :VOCAB]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_released_deepseek_v3_configs_give_transformers_logits_both_ways(tmp_path, name):
    ref = _save(name, str(tmp_path / "hf"))
    model_cfg, full = hf.import_hf(str(tmp_path / "hf"))
    for key, value in EXPECT[name].items():
        assert model_cfg[key] == value, key
    with torch.no_grad():
        expected = ref(IDS).logits
    assert rel(_logits(model_cfg, full), expected) <= 1e-5
    if model_cfg["mla_latent_norm_epsilon"] is not None:   # without the field: past 1e-5
        assert rel(_logits(model_cfg, full, mla_latent_norm_epsilon=None), expected) > 1e-5
    hf.export_hf(str(tmp_path / "out"), model_cfg, full)
    out_cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert out_cfg["rms_norm_eps"] == CONFIGS[name]["rms_norm_eps"]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert rel(again(IDS).logits, expected) <= 1e-6


def test_what_the_released_files_hold_and_megalite_does_not_build_is_one_line():
    fp8 = dict(CONFIGS["kimi_k2"], quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedModelError, match=r"quantization_config \(fp8\) is not "
                       "supported") as err:
        hf.hf_config_to_model_config(fp8)
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedModelError, match="topk_method 'group_limited_greedy'"):
        hf.hf_config_to_model_config(dict(CONFIGS["moonlight"],
                                          topk_method="group_limited_greedy"))
    m = hf.hf_config_to_model_config(CONFIGS["moonlight"])
    with pytest.raises(UnsupportedModelError, match="--mla-latent-norm-epsilon 1e-6"):
        hf.adapter_for_model(dict(m, mla_latent_norm_epsilon=None), "DeepseekV3ForCausalLM")
