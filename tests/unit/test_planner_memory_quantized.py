"""FP8 / FP4 weights, MoE expert outputs and 16-bit Adam moments in the planner's memory
(memory.quantized_weight_bytes, ActivationOptions.moe_output_kept, ModelOptions.moment_bytes)
against hand counts."""
import dataclasses

import pytest

from megalite.config import ModelConfig
from megalite.planner import kernels
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner.estimate import ModelOptions, memory_of
from megalite.planner.hardware import make_cluster
from megalite.planner.layout import Layout


def tiny_llama(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                num_query_groups=2, ffn_hidden_size=96, swiglu=True, normalization="RMSNorm",
                position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                vocab_size=1000, seq_length=32)
    base.update(kw)
    return ModelConfig(**base)


def tiny_moe(**kw):
    return tiny_llama(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, **kw)


L2 = Layout(world=2, global_batch=4, micro_batch=1, zero=1)


@pytest.mark.parametrize("recipe,per_param", [("tensorwise", 2.0), ("mxfp8", 2 + 2 / 32),
                                              ("nvfp4", 2 * (0.5 + 1 / 16))])
def test_weight_copies_are_two_operands_with_their_scales(recipe, per_param):
    """A rowwise and a columnwise copy, each as many bytes as the recipe's GEMM operand
    (NVFP4: half a byte and an E4M3 scale per 16 -- not 2 bytes as for FP8)."""
    m = tiny_llama()
    params = L2.stage_params(m, 0).total
    got = mem.quantized_weight_bytes(m, L2, 0, 2, kernels.FP8_RECIPES[recipe].operand_bytes,
                                     False)
    assert got == int(per_param * params)


def test_quantized_primary_weights_drop_the_layers_16_bit_copy():
    """--fp8-param-gather under ZeRO-1: the transformer layers' bf16 weights are gone; the
    embedding and output layer keep theirs."""
    m = tiny_llama()
    params = L2.stage_params(m, 0).total
    layers = m.num_layers * L2.kind_params(m, False).total
    got = mem.quantized_weight_bytes(m, L2, 0, 2, 1.0, True)
    assert got == 2 * params - 2 * layers
    assert params - layers == ms.embedding_params(m, 1) + L2.head_params(m)
    cl = make_cluster(2, 2, "b200")
    plain = memory_of(m, L2, 32, cl, ModelOptions(fp8="tensorwise", grad_bytes=2))
    primary = memory_of(m, L2, 32, cl, ModelOptions(fp8="tensorwise", grad_bytes=2,
                                                    quantized_weights=True))
    assert plain.memory["weights"] - primary.memory["weights"] == 2 * layers
    assert plain.memory["total"] - primary.memory["total"] == 2 * layers
    z3 = dataclasses.replace(L2, zero=3)        # ZeRO-3: shards of the copies, as before
    assert mem.quantized_weight_bytes(m, z3, 0, 2, 1.0, True) == \
        mem.quantized_weight_bytes(m, z3, 0, 2, 1.0, False)


def test_moe_expert_output_not_kept_when_probs_scale_the_activation():
    """Megatron-Core since 2659630721: the combine takes no probabilities, so the experts'
    output [T*k, h] (bf16) is not saved; the inputs are."""
    m = tiny_moe()
    T, k, h = 32, 2, 64
    kept = mem.layer_activation_bytes(m, L2, True, 32, mem.ActivationOptions())
    not_kept = mem.layer_activation_bytes(m, L2, True, 32,
                                          mem.ActivationOptions(moe_output_kept=False))
    assert kept - not_kept == 2 * T * k * h
    # dense layers and the HBM-pass time do not change
    assert mem.layer_activation_bytes(m, L2, False, 32, mem.ActivationOptions()) == \
        mem.layer_activation_bytes(m, L2, False, 32, mem.ActivationOptions(moe_output_kept=False))


def test_bf16_moments_are_four_bytes_of_adam_state():
    """--use-precision-aware-optimizer with bf16 exp_avg / exp_avg_sq: 4 (fp32 master)
    + 2 + 2 bytes a parameter, sharded, instead of 12."""
    m = tiny_llama()
    cl = make_cluster(2, 2, "b200")
    a = memory_of(m, L2, 32, cl, ModelOptions(grad_bytes=2)).memory
    b = memory_of(m, L2, 32, cl, ModelOptions(grad_bytes=2, moment_bytes=2)).memory
    assert ModelOptions(moment_bytes=2).precision.optimizer == 8
    assert b["optimizer"] * 12 == a["optimizer"] * 8
    assert (a["weights"], a["grads"]) == (b["weights"], b["grads"])
