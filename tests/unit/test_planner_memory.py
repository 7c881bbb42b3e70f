"""Planner memory / parameter / FLOP / communication models against hand-computed numbers."""
import dataclasses
import math

import pytest

from megalite.config import ModelConfig
from megalite.planner import comm_model as cm
from megalite.planner import kernels
from megalite.planner import flops as fl
from megalite.planner import memory as mem
from megalite.planner import model_spec as ms
from megalite.planner.estimate import ModelOptions, memory_of
from megalite.planner.hardware import make_cluster
from megalite.planner.layout import Layout


def tiny_gpt(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                vocab_size=1000, seq_length=32)
    base.update(kw)
    return ModelConfig(**base)


def tiny_llama(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                num_query_groups=2, ffn_hidden_size=96, swiglu=True, normalization="RMSNorm",
                position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                vocab_size=1000, seq_length=32)
    base.update(kw)
    return ModelConfig(**base)


# ---- parameters ---------------------------------------------------------------------

def test_gpt_layer_params_are_12h2_plus_13h():
    m = tiny_gpt()
    h = 64
    assert ms.layer_params(m, 0).total == 12 * h * h + 13 * h == 49984


def test_gpt_total_params_by_hand():
    m = tiny_gpt()
    # 2 layers + padded word embedding (1000 -> 1024) + learned positions (32) + final LN.
    assert ms.total_params(m) == 2 * 49984 + 1024 * 64 + 32 * 64 + 2 * 64 == 167680


def test_tp_split_and_replicated_parts():
    m = tiny_gpt()
    # TP2: norms (256) and row-parallel biases (2 x 64) replicated, the rest halved.
    per_layer = 256 + (3 * 64 * 64 + 192) // 2 + (64 * 64 // 2 + 64) + \
        (256 * 64 + 256) // 2 + (64 * 256 // 2 + 64)
    assert ms.layer_params(m, 0, tp=2).total == per_layer == 25184
    assert m.padded_vocab_size(2) == 1024
    assert ms.stage_params(m, 0, tp=2).total == 2 * per_layer + 1024 * 64 // 2 + 32 * 64 + 128


def test_pipeline_stages_tied_and_untied():
    m = tiny_gpt()
    s0 = ms.stage_params(m, 0, pp=2).total
    s1 = ms.stage_params(m, 1, pp=2).total
    assert s0 == 49984 + 1024 * 64 + 32 * 64                # layer + embeddings
    assert s1 == 49984 + 128 + 1024 * 64                    # layer + final LN + tied copy
    u = tiny_gpt(untie_embeddings_and_output_weights=True)
    assert ms.stage_params(u, 0, pp=1).total == ms.total_params(m) + 1024 * 64


def test_gqa_swiglu_layer_params():
    m = tiny_llama()
    h, a, g, d, f = 64, 8, 2, 8, 96
    expect = 2 * h + (a + 2 * g) * d * h + h * a * d + 2 * f * h + h * f
    assert ms.layer_params(m, 0).total == expect
    assert ms.layer_params(m, 0, tp=2).total == 2 * h + expect // 2 - h


def test_uneven_stages_and_vpp_layer_ids():
    m = tiny_gpt(num_layers=10)
    assert ms.layers_per_stage(m, 4, 2, 2) == [2, 3, 3, 2]
    assert ms.stage_layer_ids(m, 4, 1, first=2, last=2) == [2, 3, 4]
    m8 = tiny_gpt(num_layers=8)
    assert ms.stage_layer_ids(m8, 2, 0, vpp=2) == [0, 1, 4, 5]
    assert ms.stage_layer_ids(m8, 2, 1, vpp=2) == [2, 3, 6, 7]


def test_moe_params_over_ep_and_expert_tp():
    m = tiny_llama(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
    h, fe = 64, 32
    dense = ms.layer_params(tiny_llama(), 0).total - (2 * 96 * h + h * 96)
    expert = 2 * fe * h + h * fe
    p = ms.layer_params(m, 0, tp=1, etp=1, ep=2)
    assert p.dense == dense + 4 * h                       # attention, norms and the router
    assert p.expert == 2 * expert                         # 4 experts over EP2
    assert ms.layer_params(m, 0, tp=1, etp=2, ep=2).expert == expert
    assert ms.active_params(m) == ms.total_params(m) - 4 * 2 * expert


def test_llama3_8b_parameter_count():
    assert ms.total_params(ms.recipe("llama3-8b")) == 8_030_261_248


# ---- model states ---------------------------------------------------------------------

@pytest.mark.parametrize("grad,expect", [(2, 16), (4, 18)])
def test_ddp_bytes_per_param(grad, expect):
    P = ms.ParamCount(dense=1000)
    b = mem.state_bytes(P, 8, 8, 0, mem.Precision.bf16(grad))
    assert b == {"weights": 2000, "grads": grad * 1000, "optimizer": 12000}
    assert sum(b.values()) == expect * 1000


def test_distributed_optimizer_is_6_plus_12_over_d():
    P, d = ms.ParamCount(dense=8000), 8
    b = mem.state_bytes(P, d, d, 1, mem.Precision.bf16(4))
    assert sum(b.values()) == (6 + 12 / d) * 8000      # Megatron's formula (fp32 grads)
    b2 = mem.state_bytes(P, d, d, 1, mem.Precision.bf16(2))
    assert sum(b2.values()) == (2 + 2 + 12 / d) * 8000


def test_zero2_zero3_and_fp32():
    P, d = ms.ParamCount(dense=8000), 8
    assert sum(mem.state_bytes(P, d, d, 2, mem.Precision.bf16(2)).values()) == (2 + 14 / d) * 8000
    assert sum(mem.state_bytes(P, d, d, 3, mem.Precision.bf16(2)).values()) == 16 / d * 8000
    fp32 = mem.state_bytes(P, 1, 1, 0, mem.Precision.fp32())
    assert fp32 == {"weights": 32000, "grads": 32000, "optimizer": 64000}   # 4 + 4 + 8


def test_expert_states_shard_over_expert_dp():
    P = ms.ParamCount(dense=800, expert=800)
    b = mem.state_bytes(P, 8, 2, 1, mem.Precision.bf16(4))
    assert b["optimizer"] == 12 * 800 // 8 + 12 * 800 // 2


# ---- activations (Korthikanti et al. 2022) ---------------------------------------------

NOFLASH = mem.ActivationOptions(flash_attention=False)


def _gpt_layer(tp=1, sp=False, recompute="none", mb=1):
    m = tiny_gpt(ffn_hidden_size=256)
    L = Layout(world=tp, tp=tp, micro_batch=mb, global_batch=mb, sp=sp, recompute=recompute)
    return mem.layer_activation_bytes(m, L, False, 32, NOFLASH)


def test_activations_sbh_34_plus_5as_over_h():
    s, b, h, a = 32, 1, 64, 4
    assert _gpt_layer() == s * b * h * (34 + 5 * a * s / h)
    assert _gpt_layer(mb=2) == 2 * _gpt_layer()


def test_activations_tp_with_and_without_sp():
    s, b, h, a, t = 32, 1, 64, 4, 4
    assert _gpt_layer(tp=t, sp=True) == s * b * h * (34 + 5 * a * s / h) / t
    assert _gpt_layer(tp=t, sp=False) == s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("model", [tiny_gpt(hidden_dropout=0.0), tiny_llama()])
def test_local_layers_with_sp_divide_every_buffer_by_t(model):
    """megalite's SP column-parallel linears save the sequence shard (re-gathered in
    backward): with TP t + SP every local-layer buffer is / t; only the bf16 RoPE tables,
    4·T·d bytes shared by the layer, are not."""
    seq, t = 32, 4
    opts = mem.ActivationOptions(local_layers=True)
    one = mem.layer_activation_bytes(model, Layout(world=1), False, seq, opts, "none")
    sp = mem.layer_activation_bytes(model, Layout(world=t, tp=t, sp=True), False, seq, opts,
                                    "none")
    rope = 4 * seq * model.resolved_kv_channels() if model.position_embedding_type == "rope" \
        else 0
    assert sp == (one - rope) // t + rope
    # without SP the two norm outputs feeding the column-parallel linears stay replicated
    no_sp = mem.layer_activation_bytes(model, Layout(world=t, tp=t), False, seq, opts, "none")
    assert no_sp > sp


def test_activations_selective_and_full_recompute():
    s, b, h, t = 32, 1, 64, 4
    assert _gpt_layer(tp=t, sp=True, recompute="selective") == 34 * s * b * h / t
    assert _gpt_layer(tp=t, sp=True, recompute="full") == 2 * s * b * h / t


def test_mla_up_proj_recompute_frees_the_expanded_heads():
    """Megatron's selective ``mla_up_proj`` keeps MLA's latents and drops the expanded q, k
    ([heads, qk + rope]) and v ([heads, v]) until backward rebuilds them."""
    m = ms.recipe("deepseek-v3")
    L = Layout(world=2, tp=2, sp=True, recompute="selective")
    T, a = 4096, 128
    kept = mem.layer_activation_bytes(m, L, True, T, mem.ActivationOptions())
    freed = mem.layer_activation_bytes(
        m, L, True, T, mem.ActivationOptions(recompute_modules=("core_attn", "mla_up_proj")))
    assert kept - freed == 2 * T * a * (2 * 192 + 128) // 2


def test_activations_gqa_swiglu_derivation():
    m = tiny_llama()
    s, h, hq, hkv, f = 32, 64, 64, 16, 96
    L = Layout(world=1)
    flash = mem.ActivationOptions(flash_attention=True)
    # norms in/out 8sh + Q,K,V 2s(hq+2hkv) + attention out 2s*hq + SwiGLU 4sf + 2sf
    # + fp32 log-sum-exp per head and token (no dropout masks: dropout is off).
    expect = 8 * s * h + 2 * s * (hq + 2 * hkv) + 2 * s * hq + 6 * s * f + 4 * 8 * s
    assert mem.layer_activation_bytes(m, L, False, s, flash) == expect


def test_in_flight_micro_batches():
    L = Layout(world=4, pp=4, global_batch=16)
    assert [mem.in_flight(L, r) for r in range(4)] == [4, 3, 2, 1]
    assert mem.in_flight(Layout(world=4, pp=4, global_batch=2), 0) == 2     # m < p
    p, v = 4, 2
    Lv = Layout(world=4, pp=p, vpp=v, global_batch=16, schedule="interleaved")
    assert mem.in_flight(Lv, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_predict_rank_memory_exact_states():
    from megalite.cli.arguments import parse_args
    cfg = parse_args(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                      "--seq-length", "32", "--vocab-size", "1000",
                      "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--world-size", "8", "--bf16",
                      "--use-distributed-optimizer", "--micro-batch-size", "2",
                      "--global-batch-size", "16", "--dry-run", "--mock-data"])
    r = mem.predict_rank_memory(cfg, 5)               # pipeline stage 1 (ranks 4-7)
    n = ms.stage_params(cfg.model, 1, tp=2, pp=2).total
    assert r["params"] == n
    assert r["weights"] == 2 * n and r["grads"] == 4 * n
    assert r["optimizer"] == 12 * math.ceil(n / 2)    # DP = 8 / (2 x 2) = 2
    assert r["activations"] > 0
    assert r["total"] == r["weights"] + r["grads"] + r["optimizer"] + r["activations"]


# ---- FLOPs ------------------------------------------------------------------------------

def megatron_flops(m: ModelConfig, B: int, s: int) -> float:
    """Megatron-LM's num_floating_point_operations, dense path, written independently."""
    h, a, L = m.hidden_size, m.num_attention_heads, m.num_layers
    g, d = m.resolved_query_groups(), m.resolved_kv_channels()
    gate = 1.5 if m.swiglu else 1.0
    experts = m.moe_router_topk if m.num_experts else 1
    ffn = ms.moe_ffn(m) if m.num_experts else m.resolved_ffn_hidden_size()
    return 12 * B * s * L * h * h * ((1 + g / a + s / h) * (a * d / h) + ffn / h * experts * gate
                                     + m.padded_vocab_size(1) / (2 * L * h))


@pytest.mark.parametrize("model", [tiny_gpt(), tiny_llama(), ms.recipe("llama3-70b")])
def test_flops_match_megatron_formula(model):
    got = fl.iteration_flops(model, 64, 8)["model"]
    assert got == pytest.approx(megatron_flops(model, 8, 64), rel=1e-12)


def test_flops_narayanan_recompute_formula():
    m = ms.recipe("gpt-18.4b")
    B, s, L, h, V = 1024, 2048, 40, 6144, 51200
    f = fl.iteration_flops(m, s, B, "full")
    base = B * s * L * h * h
    assert f["hardware"] == pytest.approx(96 * base * (1 + s / (6 * h) + V / (16 * L * h)))
    assert f["model"] == pytest.approx(72 * base * (1 + s / (6 * h) + V / (12 * L * h)))


def test_moe_flops_count_topk_experts_and_router():
    m = tiny_llama(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)
    dense = fl.kind_forward_flops(m, False, 32)["linear"]
    moe = fl.kind_forward_flops(m, True, 32)["linear"]
    assert moe - dense == 2 * 64 * 4 + 2 * (3 * 2 * 64 * 32) - 3 * 2 * 64 * 96


# ---- communication volume (megalite.comm's convention) ----------------------------------

def _cfg(**kw):
    m = tiny_gpt(num_layers=6)
    L = Layout(**kw)
    return m, L


def test_dp_volumes_ddp_and_distributed_optimizer():
    m, L = _cfg(world=4, global_batch=8)
    n = ms.stage_params(m, 0).total
    v = cm.volume(cm.events(m, L, 32, 0))
    # + the loop's two fp64 scalars (token count, loss) over the same group
    assert v["dp-cp/all_reduce"]["elements"] == n + 2
    assert v["dp-cp/all_reduce"]["bytes"] == 4 * n + 16
    m, L = _cfg(world=4, global_batch=8, zero=1)
    v = cm.volume(cm.events(m, L, 32, 0))
    assert v["dp-cp/reduce_scatter"]["elements"] == n == v["dp-cp/all_gather"]["elements"]


def test_fsdp_moves_3x_weights_per_micro_batch():
    m, L = _cfg(world=4, global_batch=8, zero=3)          # 2 micro-batches per DP rank
    n = ms.stage_params(m, 0).total
    v = cm.volume(cm.events(m, L, 32, 0))
    # every unit gathered twice (forward, backward), the root -- the final norm and the
    # tied embedding -- once: it stays gathered for backward
    root = ms.embedding_params(m, 1) + 2 * 64
    assert cm.fsdp_root_params(m, L, 0) == root
    assert v["dp-cp/all_gather"]["elements"] == 2 * (2 * n - root)
    assert v["dp-cp/reduce_scatter"]["elements"] == 2 * n


def test_fsdp_with_pp_gathers_and_reduces_once_per_step():
    m, L = _cfg(world=8, pp=2, global_batch=16, zero=3)   # 4 micro-batches per DP rank
    for stage in (0, 1):
        n = ms.stage_params(m, stage, pp=2).total
        v = cm.volume(cm.events(m, L, 32, stage))
        assert v["dp-cp/all_gather"]["elements"] == n == v["dp-cp/reduce_scatter"]["elements"]


def test_fsdp_expert_mesh_rule_matches_the_rank_grid():
    """The planner's size rule for "experts share the dense FSDP mesh" is the rank rule
    ``fsdp2.fsdp_meshes`` applies: expert-DP has the ranks of DP x CP (instances alike)."""
    from megalite.parallel_state import RankGrid, shard_group_names

    for kw in (dict(world=8), dict(world=8, ep=2, etp=1), dict(world=8, tp=2, etp=1),
               dict(world=8, tp=2, etp=2), dict(world=8, cp=2), dict(world=16, pp=2, ep=2),
               dict(world=8, instances=2), dict(world=16, ep=2, etp=1, instances=2)):
        L = Layout(global_batch=16, zero=3, **kw)
        grid = RankGrid(L.world, tp=L.tp, pp=L.pp, cp=L.cp, ep=L.ep, etp=L.etp,
                        dp_instances=L.instances)
        same = all(grid.group_of(a, 0) == grid.group_of(b, 0)
                   for a, b in zip(shard_group_names("expert", L.instances),
                                   shard_group_names("dense", L.instances)) if a)
        assert cm.fsdp_experts_with_dense(L) == same, kw


def test_hybrid_sharding_groups_and_volumes():
    """R instances: shards over d/R neighbouring ranks, the reduced shard all-reduced over
    the R instances; the memory of one rank as with d/R-way sharding."""
    m, L = _cfg(world=8, global_batch=8, zero=3, instances=2)   # d = 8, d' = 4, 1 micro-batch
    n = ms.stage_params(m, 0).total
    v = cm.volume(cm.events(m, L, 32, 0))
    assert v["dp-cp-shard/reduce_scatter"]["elements"] == n
    assert v["dp-cp-replicate/all_reduce"]["elements"] == -(-n // 4)
    assert cm.group_geometry(L, "dp-cp-shard") == (4, 1)
    assert cm.group_geometry(L, "dp-cp-replicate") == (2, 4)
    one = mem.layout_state_bytes(ms.stage_params(m, 0), L, mem.Precision.bf16())
    assert one == mem.layout_state_bytes(ms.stage_params(m, 0), Layout(world=4, global_batch=8,
                                                                          zero=3),
                                         mem.Precision.bf16())
    # FSDP2's fp32 shards are the masters: 4 + 8 bytes per sharded element, as ZeRO's 12
    assert one["weights"] == 4 * -(-n // 4) and one["optimizer"] == 8 * -(-n // 4)
    m1, L1 = _cfg(world=8, global_batch=8, zero=1, instances=2)
    v1 = cm.volume(cm.events(m1, L1, 32, 0))
    pad = -(-n // 4) * 4
    assert v1["dp-cp-shard/reduce_scatter"]["elements"] == pad == \
        v1["dp-cp-shard/all_gather"]["elements"]
    assert v1["dp-cp-replicate/all_reduce"]["elements"] == pad // 4


def test_tp_four_all_reduces_per_layer_per_micro_batch():
    m, L = _cfg(world=6, tp=2, pp=3, global_batch=4)       # middle stage: 2 layers, 4 micro-batches
    v = cm.volume(cm.events(m, L, 32, 1))
    T, h = 32, 64
    assert v["tp/all_reduce"]["calls"] == 4 * 2 * 4
    assert v["tp/all_reduce"]["elements"] == 4 * 2 * 4 * T * h
    full = cm.volume(cm.events(m, Layout(world=6, tp=2, pp=3, global_batch=4, recompute="full"),
                               32, 1))
    # recompute repeats the forward's attention exit; the MLP exit is not needed (early stop)
    assert full["tp/all_reduce"]["calls"] == 5 * 2 * 4


def test_sp_gather_scatter_volume_equals_all_reduce():
    m = tiny_gpt(num_layers=6)
    L = Layout(world=6, tp=2, pp=3, global_batch=4, sp=True)
    v = cm.volume(cm.events(m, L, 32, 1, sp_regather=False))
    expect = 4 * 2 * 4 * 32 * 64            # = the all-reduce volume without SP
    assert v["tp/all_gather"]["elements"] == v["tp/reduce_scatter"]["elements"] == expect


def test_sp_regathers_column_parallel_inputs_in_backward():
    """Per layer and micro-batch: 2 all-gathers forward, 4 backward (2 re-gather the QKV /
    fc1 inputs' shards for the weight gradient); the output layer re-gathers too."""
    m = tiny_gpt(num_layers=6)
    L = Layout(world=6, tp=2, pp=3, global_batch=4, sp=True)
    T, mbs, layers = 32, 4, 2
    mid = cm.volume(cm.events(m, L, T, 1))
    assert mid["tp/all_gather"]["calls"] == 6 * layers * mbs
    assert mid["tp/reduce_scatter"]["calls"] == 4 * layers * mbs
    assert mid["tp/all_gather"]["elements"] == 6 * layers * mbs * T * 64
    last = cm.volume(cm.events(m, L, T, 2))
    no_regather = cm.volume(cm.events(m, L, T, 2, sp_regather=False))
    assert last["tp/all_gather"]["calls"] - no_regather["tp/all_gather"]["calls"] == \
        (2 * layers + 1) * mbs


def test_pp_p2p_messages():
    m = tiny_gpt(num_layers=6)
    L = Layout(world=3, pp=3, global_batch=4)
    first, mid = cm.volume(cm.events(m, L, 32, 0)), cm.volume(cm.events(m, L, 32, 1))
    assert first["pp/send"]["calls"] == 4 and mid["pp/send"]["calls"] == 8
    assert mid["pp/send"]["elements"] == 8 * 32 * 64


# ---- FP8 / FP4 weights, MoE expert outputs, 16-bit Adam moments ------------------------
# (memory.quantized_weight_bytes, ActivationOptions.moe_output_kept, ModelOptions.moment_bytes / master_bytes)

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
    b = memory_of(m, L2, 32, cl, ModelOptions(grad_bytes=2, moment_bytes=(2, 2))).memory
    assert ModelOptions(moment_bytes=(2, 2)).precision.optimizer == 8
    assert b["optimizer"] * 12 == a["optimizer"] * 8
    assert (a["weights"], a["grads"]) == (b["weights"], b["grads"])


def test_master_remainder_and_mixed_moments_are_summed():
    """FusedAdam's 16-bit remainder of an fp32 master (2 bytes) with an fp8 exp_avg and a
    bf16 exp_avg_sq: 2 + 1 + 2 = 5 bytes of optimizer state; fp32 training has no master."""
    m = tiny_llama()
    cl = make_cluster(2, 2, "b200")
    opts = ModelOptions(grad_bytes=2, moment_bytes=(1, 2), master_bytes=2)
    assert opts.precision.optimizer == 5
    a = memory_of(m, L2, 32, cl, ModelOptions(grad_bytes=2)).memory
    b = memory_of(m, L2, 32, cl, opts).memory
    assert b["optimizer"] * 12 == a["optimizer"] * 5
    assert ModelOptions(fp32=True, master_bytes=2).precision.master == 0
