"""Llama 3.x RoPE scaling and YaRN: megalite's tables equal transformers' rotary functions
bit for bit (the rule an imported checkpoint depends on), and Megatron-Core's formulas."""
import dataclasses
import math

import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError, ModelConfig
from megalite.transformer import rotary
from megalite.config import MegaliteConfig
from megalite.cli.validation import check_flags

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=64,
            vocab_size=32, position_embedding_type="rope", rotary_base=500000)

LLAMA3 = [  # (megalite fields, HF rope_parameters)
    (dict(use_rope_scaling=True, rope_scaling_factor=8.0),
     dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=8192)),
    (dict(use_rope_scaling=True, rope_scaling_factor=32.0, rope_scaling_low_freq_factor=2.0,
          rope_scaling_high_freq_factor=8.0, rope_scaling_original_max_position_embeddings=64),
     dict(rope_type="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
          original_max_position_embeddings=64)),
]
YARN = [
    (dict(rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16),
     dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    # gpt-oss: no rounding of the correction range
    (dict(rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096,
          yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_correction_range_round_to_int=False),
     dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
          beta_fast=32.0, beta_slow=1.0, truncate=False)),
    # DeepSeek-V3: mscale = mscale_all_dim (cos/sin unscaled)
    (dict(rotary_scaling_factor=40.0, yarn_original_max_position_embeddings=4096,
          mscale=1.0, mscale_all_dim=1.0),
     dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
          mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
    (dict(rotary_scaling_factor=8.0, yarn_original_max_position_embeddings=32, mscale=0.8,
          mscale_all_dim=0.5, yarn_beta_fast=16.0, yarn_beta_slow=2.0),
     dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=0.8,
          mscale_all_dim=0.5, beta_fast=16.0, beta_slow=2.0)),
]


def hf_tables(params: dict, head_dim: int, seq: int, theta=500000.0):
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=seq,
                                   rope_parameters=dict(params, rope_theta=theta))
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, seq, head_dim)
    cos, sin = emb(x, torch.arange(seq)[None])
    return emb.inv_freq, emb.attention_scaling, cos, sin


@pytest.mark.parametrize("ours,theirs", LLAMA3 + [(dict(o, position_embedding_type="yarn"), t)
                                                  for o, t in YARN])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_tables_equal_transformers_bit_for_bit(ours, theirs, head_dim):
    m = ModelConfig(**dict(BASE, kv_channels=head_dim, **ours))
    inv_freq, scaling, cos, sin = hf_tables(theirs, head_dim, 64)
    emb = rotary.RotaryEmbedding.from_config(m)
    assert emb.attention_scaling == scaling
    torch.testing.assert_close(emb.inv_freq, inv_freq, rtol=0, atol=0)
    c, s = emb(64)
    torch.testing.assert_close(c[0, 0], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(s[0, 0], sin[0], rtol=0, atol=0)
    assert ROPE_INIT_FUNCTIONS[theirs["rope_type"]]    # the functions compared above


def test_llama3_and_yarn_match_megatron_core():
    mcore = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    inv = rotary.default_inv_freq(128, 500000)
    ours = rotary.llama3_inv_freq(inv, 8.0, 1.0, 4.0, 8192)
    theirs = RotaryEmbedding._apply_scaling(None, inv.clone(), factor=8.0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for round_to_int in (True, False):
        assert rotary.yarn_correction_range(32, 1, 64, 10000, 4096, round_to_int) == \
            mcore._yarn_find_correction_range(32, 1, 64, 10000, 4096, round_to_int)
    for mscale, mscale_all_dim in ((1.0, 0.0), (0.707, 0.0), (1.0, 1.0), (0.8, 0.5)):
        assert rotary.yarn_concentration_factor(40.0, mscale, mscale_all_dim) == \
            mcore._yarn_get_concentration_factor(40.0, mscale, mscale_all_dim)
    assert rotary.yarn_get_mscale(40.0, 1.0) == 0.1 * math.log(40.0) + 1.0


def test_flags_parse_with_megatron_names_and_are_checked():
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--seq-length", "8", "--position-embedding-type", "yarn",
                      "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings",
                      "16", "--yarn-beta-fast", "8", "--yarn-beta-slow", "2", "--mscale", "0.9",
                      "--mscale-all-dim", "0.5", "--no-yarn-correction-range-round-to-int",
                      "--qk-layernorm", "--add-qkv-bias", "--kv-channels", "16",
                      "--mock-data", "--vocab-size", "32", "--dry-run"])
    m = cfg.model
    assert (m.rotary_scaling_factor, m.yarn_original_max_position_embeddings, m.yarn_beta_fast,
            m.yarn_beta_slow, m.mscale, m.mscale_all_dim) == (4.0, 16, 8.0, 2.0, 0.9, 0.5)
    assert not m.yarn_correction_range_round_to_int and m.qk_layernorm and m.add_qkv_bias
    llama3 = ModelConfig(**dict(BASE, use_rope_scaling=True))
    check_flags(MegaliteConfig(model=llama3))
    bad = [(dict(position_embedding_type="yarn"),
            "--use-rope-scaling needs --position-embedding-type rope"),
           (dict(rope_scaling_high_freq_factor=1.0), "--rope-scaling-high-freq-factor must be "
            "> --rope-scaling-low-freq-factor"),
           (dict(rope_scaling_factor=0.0), "--rope-scaling-factor must be a positive number"),
           (dict(position_embedding_type="yarn", use_rope_scaling=False,
                 rotary_scaling_factor=-1.0), "--rotary-scaling-factor must be a positive")]
    for change, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            check_flags(MegaliteConfig(model=dataclasses.replace(llama3, **change)))
