"""The planner's parameter counts equal megalite's GPTModel, rank by rank (meta device).

Skipped until megalite.models exists; then it guards the planner against model drift.
"""
import itertools

import pytest

from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.parallelize import spec_choices
from megalite.parallel_state import ParallelState, RankGrid
from megalite.planner import model_spec as ms

gpt = pytest.importorskip("megalite.models.gpt")


def model_cfg(arch):
    d = dict(num_layers=6, hidden_size=64, num_attention_heads=8, seq_length=16,
             vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0)
    if arch == "llama":
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 ffn_hidden_size=96, add_bias_linear=False, group_query_attention=True,
                 num_query_groups=4, untie_embeddings_and_output_weights=True)
    elif arch == "gpt-untied":
        d.update(untie_embeddings_and_output_weights=True)
    elif arch == "gqa-swiglu-bias":
        d.update(group_query_attention=True, num_query_groups=2, swiglu=True, kv_channels=16)
    elif arch == "qwen":       # q/k norms (replicated over TP), qkv bias, head dim 16 != h/a
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 ffn_hidden_size=96, add_bias_linear=False, add_qkv_bias=True,
                 qk_layernorm=True, kv_channels=16, group_query_attention=True,
                 num_query_groups=4)
    elif arch == "qk-layernorm-ln":  # LayerNorm q/k norms: weight and bias each
        d.update(qk_layernorm=True)
    elif arch in ("mla-mtp-tied", "deepseek"):      # MLA latents + norms, MTP on the last stage
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False, multi_latent_attention=True, q_lora_rank=24,
                 kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                 qk_layernorm=True, mtp_num_layers=2)
        if arch == "deepseek":
            d.update(q_lora_rank=None, untie_embeddings_and_output_weights=True, num_experts=4,
                     moe_ffn_hidden_size=16, moe_layer_freq=[0] + [1] * 5,
                     moe_shared_expert_intermediate_size=32, mtp_num_layers=1)
    elif arch == "qwen3-next":   # Gated DeltaNet 2:1 with gated attention, gated shared expert
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False, qk_layernorm=True, kv_channels=16,
                 group_query_attention=True, num_query_groups=2, attention_output_gate=True,
                 experimental_attention_variant="gated_delta_net", linear_attention_freq=3,
                 linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
                 linear_value_head_dim=4, num_experts=4, moe_ffn_hidden_size=16,
                 moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
                 untie_embeddings_and_output_weights=True)
    return ModelConfig(**d)


def real_count(m, tp, pp, pp_rank, vpp=1, first=None, last=None):
    world = tp * pp
    cfg = MegaliteConfig(model=m, world_size=world, parallel=ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    state = ParallelState.build(RankGrid(world, tp=tp, pp=pp), pp_rank * tp, create_groups=False)
    ids = ms.stage_layer_ids(m, pp, pp_rank, vpp, first, last)
    per_chunk = len(ids) // vpp
    total = 0
    for c in range(vpp):                      # one GPTModel per virtual chunk
        layers = ids[c * per_chunk:(c + 1) * per_chunk]
        model = gpt.GPTModel(cfg, state, pre_process=pp_rank == 0 and c == 0,
                             post_process=pp_rank == pp - 1 and c == vpp - 1,
                             layer_numbers=layers, device="meta",
                             spec=spec_choices(cfg, state))
        total += sum(p.numel() for p in model.parameters())
    return total


@pytest.mark.parametrize("arch,tp,pp", list(itertools.product(
    ["llama", "gpt", "gpt-untied", "gqa-swiglu-bias", "qwen", "qk-layernorm-ln", "mla-mtp-tied",
     "deepseek", "qwen3-next"], [1, 2],
    [1, 2, 3])))
def test_stage_params_equal_model(arch, tp, pp):
    m = model_cfg(arch)
    for r in range(pp):     # expert-TP defaults to TP
        assert ms.stage_params(m, r, tp=tp, pp=pp, etp=tp).total == real_count(m, tp, pp, r)


def test_interleaved_and_uneven_stages_equal_model():
    m = model_cfg("llama")
    for r in range(3):
        assert ms.stage_params(m, r, tp=2, pp=3, first=1, last=1).total == \
            real_count(m, 2, 3, r, first=1, last=1)
    for r in range(3):
        assert ms.stage_params(m, r, tp=1, pp=3, vpp=2).total == real_count(m, 1, 3, r, vpp=2)


@pytest.mark.parametrize("pp,vpp,accounts", [(2, 2, (True, True)), (2, 4, (True, True)),
                                             (4, 1, (True, True)), (7, 1, (False, True)),
                                             (1, 1, (False, False))])
def test_account_for_split_stages_equal_model(pp, vpp, accounts):
    """--account-for-embedding/loss-in-pipeline-split: the planner's layers and parameters per
    rank are what build_model_chunks builds (6 layers; 1 slot per chunk at PP2 x VPP4)."""
    from megalite.pipeline_parallel.stages import layers_of_stage

    m = model_cfg("llama")
    cfg = MegaliteConfig(model=m, world_size=2 * pp, parallel=ParallelConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=pp,
        num_virtual_stages_per_pipeline_rank=vpp if vpp > 1 else None,
        account_for_embedding_in_pipeline_split=accounts[0],
        account_for_loss_in_pipeline_split=accounts[1]))
    state0 = ParallelState.build(RankGrid(2 * pp, tp=2, pp=pp), 0, create_groups=False)
    for r in range(pp):
        chunks = [layers_of_stage(cfg, r, c) for c in range(vpp)]
        assert ms.stage_layer_ids(m, pp, r, vpp, accounts=accounts) == sum(chunks, [])
        total = 0
        for c, layers in enumerate(chunks):
            model = gpt.GPTModel(cfg, state0, pre_process=r == 0 and c == 0,
                                 post_process=r == pp - 1 and c == vpp - 1,
                                 layer_numbers=layers, device="meta",
                                 spec=spec_choices(cfg, state0))
            total += sum(p.numel() for p in model.parameters())
        assert ms.stage_params(m, r, tp=2, pp=pp, vpp=vpp, accounts=accounts).total == total


MOE_VARIANTS = {   # Qwen2-MoE's gated shared expert and dense layers; DeepSeek-V3's first dense
    "qwen2-moe": dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=32,
                      moe_shared_expert_gate=True, moe_layer_freq=[1, 0, 1, 1, 0, 1]),
    "deepseek-v3": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=32,
                        moe_layer_freq=[0] + [1] * 5),
}


@pytest.mark.parametrize("variant,tp,ep,etp", [(v, *lay) for v in MOE_VARIANTS
                                               for lay in [(1, 1, 1), (2, 2, 1), (2, 2, 2)]])
def test_moe_stage_params_equal_model(variant, tp, ep, etp):
    """Routed experts over EP x expert-TP, the shared expert (and its gate) over TP, dense
    layers between MoE layers: the planner's per-rank count is what the model holds."""
    import dataclasses

    m = dataclasses.replace(model_cfg("llama"), num_experts=4, moe_ffn_hidden_size=48,
                            moe_router_topk=2, **MOE_VARIANTS[variant])
    cfg = MegaliteConfig(model=m, world_size=2 * tp * ep * etp, parallel=ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=2,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1))
    state = ParallelState.build(RankGrid.from_config(cfg), 0, create_groups=False)
    for r in range(2):
        layers = ms.stage_layer_ids(m, 2, r)
        model = gpt.GPTModel(cfg, state, pre_process=r == 0, post_process=r == 1,
                             layer_numbers=layers, device="meta",
                             spec=spec_choices(cfg, state))
        real = sum(p.numel() for p in model.parameters())
        assert ms.stage_params(m, r, tp=tp, pp=2, etp=etp, ep=ep).total == real


@pytest.mark.parametrize("arch,flags", [
    ("llama", dict(account_for_embedding_in_pipeline_split=True,
                   account_for_loss_in_pipeline_split=True)),
    ("gpt", dict(pipeline_model_parallel_layout="Ettt|t|t|tL")),        # tied: no copy
    ("qwen", dict(account_for_loss_in_pipeline_split=True,
                  account_for_embedding_in_pipeline_split=True))])
def test_dualpipev_v_placement_stages_equal_model(arch, flags):
    """DualPipeV's V: rank 0 holds the first and the last block (the embedding, the output
    layer and the loss; DualPipeV refuses MTP), so the planner's per-rank layers and parameters
    follow the runtime's placement (build_model_chunks), not the last rank's."""
    from megalite.models.stages import build_model_chunks
    from megalite.pipeline_parallel.stages import layers_of_stage
    from megalite.planner.layout import Layout

    m, pp = model_cfg(arch), 2
    cfg = MegaliteConfig(model=m, world_size=pp, parallel=ParallelConfig(
        pipeline_model_parallel_size=pp, pipeline_schedule="dualpipev", **flags))
    L = Layout(world=pp, pp=pp, vpp=2, schedule="dualpipev", global_batch=4,
               account_embedding=bool(flags.get("account_for_embedding_in_pipeline_split")),
               account_loss=bool(flags.get("account_for_loss_in_pipeline_split")),
               pipeline_layout=flags.get("pipeline_model_parallel_layout"))
    assert L.output_rank == 0 and L.vshape
    for r in range(pp):
        state = ParallelState.build(RankGrid.from_config(cfg), r, create_groups=False)
        chunks = build_model_chunks(cfg, state)
        assert ms.stage_layer_ids(m, pp, r, 2, *L.stage_split) == \
            layers_of_stage(cfg, r, 0) + layers_of_stage(cfg, r, 1)
        real = sum(p.numel() for c in chunks for p in c.parameters())
        assert L.stage_params(m, r).total == real, (r, L.stage_params(m, r).total, real)
