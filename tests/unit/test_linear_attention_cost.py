"""The planner's Gated DeltaNet costs (planner/linear_attention_cost.py): the activation
bytes of a DeltaNet mixer against what megalite's chunked delta rule really saves for
backward (``measure_saved``), and a hybrid run's predicted step peak against the tensor
meter's measured peak, as the dense layers are checked (test_attention_kernels.py)."""

import pytest
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.planner import linear_attention_cost as lac
from megalite.planner import memory as mem
from megalite.planner.layout import Layout
from megalite.transformer.activation_memory import measure_saved
from cpu_trainer import metered_step_peak  # noqa: E402  (tests/ is on sys.path)

GDN = dict(experimental_attention_variant="gated_delta_net", linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [64, 128])
def test_mixer_bytes_are_what_the_chunked_rule_saves(dtype, seq):
    """Within 3% (the counted buffers are the rule's; a few small views differ with the
    layout); the six [C, C] matrices per chunk dominate, and they grow with the chunks."""
    m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=seq,
                    vocab_size=100, normalization="RMSNorm", swiglu=True,
                    add_bias_linear=False, hidden_dropout=0, attention_dropout=0,
                    ffn_hidden_size=128, **GDN)
    model = build_model(MegaliteConfig(model=m), single_rank_state()).to(dtype)
    x = torch.randn(seq, 2, 64, dtype=dtype, requires_grad=True)
    mixer = model.decoder.layers["0"].self_attention
    saved, _ = measure_saved(lambda h: mixer(h, None, None), x, ignore=list(model.parameters()))
    e = 4 if dtype == torch.float32 else 2
    want = lac.gated_delta_net_mixer_bytes(m, seq, 2, 1, False, e)
    assert 0.97 <= sum(saved.values()) / want <= 1.03
    # the whole layer through memory.py's call site: the mixer swapped in for attention
    opts = mem.ActivationOptions(True, (), e // 2, True)
    L = Layout(world=1, micro_batch=2, global_batch=2)
    layer, _ = measure_saved(lambda h: model.decoder.layers["0"](h, None), x,
                             ignore=list(model.parameters()))
    predicted = mem.layer_activation_bytes(m, L, False, seq, opts, "none", linear=True)
    assert 0.97 <= sum(layer.values()) / predicted <= 1.03


def test_recurrent_state_is_heads_dk_dv_and_the_conv_tail():
    from megalite.transformer.gated_delta_net import CHUNK_SIZE

    assert lac.CHUNK == CHUNK_SIZE          # the planner imports no torch: its own copy
    m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, **GDN)
    assert lac.recurrent_state_bytes(m, 2) == 4 * 2 * (4 * 16 * 8 + 3 * (2 * 2 * 16 + 4 * 8))
    assert lac.recurrent_state_bytes(m, 2, tp=2) == lac.recurrent_state_bytes(m, 2) // 2


@pytest.mark.parametrize("recompute", [[], ["--recompute-granularity", "full",
                                             "--recompute-method", "uniform"]])
def test_hybrid_step_peak_matches_the_tensor_meter(tmp_path, recompute):
    """One DeltaNet layer and one attention layer at sequence 128: the DeltaNet mixer is
    most of the activations (counting it as attention predicts 35% less: measured /
    predicted 1.5), so a wrong count misses the 10% band.  With full recomputation the
    peak is the re-made DeltaNet layer's (memory.recompute_working_bytes)."""
    measured, want = metered_step_peak(
        ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "128", "--vocab-size", "64",
         "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
         "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
         "--linear-key-head-dim", "16", "--linear-value-head-dim", "8",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--position-embedding-type", "rope", "--mock-data", "--lr", "1e-3",
         "--train-iters", "2", "--eval-iters", "0", "--global-batch-size", "2",
         "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--no-progress-bar", *recompute], tmp_path / "m.jsonl")
    print(f"predicted peak {want['total'] / 2**20:.2f} MiB, measured peak "
          f"{measured / 2**20:.2f} MiB (tensor meter): ratio {measured / want['total']:.3f}")
    assert 0.9 <= measured / want["total"] <= 1.1, (measured, want)
