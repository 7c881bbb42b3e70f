"""The cost model's terms one by one (docs/planner.md, "Compute" and "Communication"):
FP8 GEMM rates and casts, attention kernel rates and the causal mask, wave quantization of
small (expert) GEMMs, routing imbalance (uniform, balanced, a metrics file), the EP overlap
and its unpaired warm-up, comm-GEMM overlap, the interleaved schedule's p2p in the bubble,
all-gather CP, block recomputation, and MLA / MTP counted from the model's own shapes."""
import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from statistics import NormalDist

import pytest

from megalite.cli.validation import validate_layout
from megalite.config import ConfigError
from megalite.planner import comm_model as cm
from megalite.planner import flops as fl
from megalite.planner import kernels, model_spec as ms, moe_cost
from megalite.planner.estimate import ModelOptions, estimate
from megalite.planner.hardware import GPU_PRESETS, make_cluster
from megalite.planner.layout import Layout, layout_from_config

est_mod = importlib.import_module("megalite.planner.estimate")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA8 = ms.recipe("llama3-8b")
MIXTRAL = ms.recipe("mixtral-8x7b")


def step(m, L, seq, gpu="h100-80gb", **opts):
    return estimate(m, L, seq, make_cluster(L.world, 8, gpu), ModelOptions(**opts))


def test_measured_ceilings_and_fp8_rate():
    h100 = GPU_PRESETS["h100-80gb"]
    assert (h100.matmul_tflops, h100.fp8_matmul_tflops) == (794.5, 1402.6)
    assert GPU_PRESETS["a100-80gb"].fp8_matmul_tflops is None
    L = Layout(world=8, micro_batch=1, global_batch=64)
    bf16 = step(LLAMA8, L, 8192).times["compute"]
    fp8 = step(LLAMA8, L, 8192, fp8="tensorwise").times["compute"]
    # GEMMs go 1402.6 / 794.5 = 1.77x faster; attention and memory-bound work do not.
    assert 1.2 < bf16 / fp8 < 1402.6 / 794.5
    assert step(LLAMA8, L, 8192).times["fp8_cast"] == 0


def test_fp8_cast_traffic_counts_the_amax_pass():
    L = Layout(world=8, micro_batch=1, global_batch=64)
    cur = step(LLAMA8, L, 8192, fp8="tensorwise").times["fp8_cast"]
    delayed = step(LLAMA8, L, 8192, fp8="delayed").times["fp8_cast"]
    assert cur / delayed == pytest.approx(6 / 4)


def test_no_fp8_on_a100_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megalite.planner", "--recipe", "llama3-8b",
                          "--num-gpus", "8", "--gpu", "a100-80gb", "--global-batch-size", "64",
                          "--fp8-recipe", "tensorwise"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--fp8-recipe" in out.stderr and "FP8" in out.stderr


def test_plan_with_fp8_is_faster_than_bf16():
    def tflops(*extra):
        out = subprocess.run([sys.executable, "-m", "megalite.planner", "--recipe",
                              "llama3-8b", "--num-gpus", "8", "--global-batch-size", "64",
                              "--tp", "1", "--pp", "1", "--zero-stages", "3", "--json", "--top",
                              "1", *extra],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["candidates"][0]["tflops_per_gpu"]
    assert tflops("--fp8-recipe", "tensorwise") > 1.2 * tflops()


def test_attention_rates_interpolate_the_measured_table():
    c = make_cluster(8)
    assert kernels.attention_rate(c, "cudnn", 8192) == (529e12, 518e12)
    assert kernels.attention_rate(c, "cudnn", 1 << 20) == (539e12, 516e12)   # clamped
    f, _ = kernels.attention_rate(c, "fa2", 1448)             # ~ halfway 1024 .. 2048 (log)
    assert 260e12 < f < 298e12
    a100 = make_cluster(8, 8, "a100-80gb")
    assert kernels.attention_rate(a100, "fa3", 8192)[0] == pytest.approx(602e12 * 271.2 / 794.5)


def test_attention_rates_follow_the_head_width():
    """A 64-wide head runs at its own measured rate; between 64 and 128 log-linear, and a
    wider one (MLA's 192) at 128's: the paper's backward stops there."""
    c = make_cluster(8)
    assert kernels.attention_rate(c, "cudnn", 4096, 64) == (363e12, 417e12)
    assert kernels.attention_rate(c, "cudnn", 4096, 192) == kernels.attention_rate(
        c, "cudnn", 4096)
    f, b = kernels.attention_rate(c, "fa3", 4096, 96)
    assert 420e12 < f < 579e12 and 453e12 < b < 542e12
    gptoss = ms.recipe("gpt-oss-120b")
    L = Layout(world=8, micro_batch=1, global_batch=8)
    narrow = kernels.stage_compute(gptoss, L, 4096, 0, c, ModelOptions())["core"]
    wide = kernels.stage_compute(replace(gptoss, kv_channels=128), L, 4096, 0, c,
                                 ModelOptions())["core"]
    assert 1.15 < narrow / (wide / 2) < 1.5        # half the work, at 70-85% of the rate


def test_causal_mask_halves_flash_work_only():
    L = Layout(world=8, micro_batch=1, global_batch=8)
    cl = make_cluster(8)
    core = {(k, causal): kernels.stage_compute(LLAMA8, L, 8192, 0, cl, ModelOptions(
        attention_kernel=k, causal=causal, flash_attention=k != "unfused"))["core"]
        for k in ("cudnn", "unfused") for causal in (True, False)}
    assert core[("cudnn", False)] == pytest.approx(2 * core[("cudnn", True)])
    assert core[("unfused", False)] == pytest.approx(core[("unfused", True)])


def test_wave_quantization_of_small_gemms():
    assert kernels.gemm_efficiency(128, 128 * 132, 1, 132) == 1.0      # one full wave
    assert kernels.gemm_efficiency(128, 128 * 133, 1, 132) == pytest.approx(133 / 264)
    assert kernels.gemm_efficiency(64, 128, 1, 132) == pytest.approx(0.5 / 132)   # padded
    # four experts of 1,000 rows share their waves; one expert of 250 rows wastes more
    grouped = kernels.gemm_efficiency(1000, 3072, 4, 132)
    assert grouped > kernels.gemm_efficiency(250, 3072, 1, 132)


def test_uniform_routing_is_the_expected_maximum_of_binomial_loads():
    L = Layout(world=64, pp=4, ep=8, vpp=8, micro_batch=1, global_batch=256)
    copies = 8 * 4096 * 2                                    # EP group's token copies
    mean, sd = copies / 8, math.sqrt(copies / 8 * 7 / 8)
    blom = NormalDist().inv_cdf((8 - 0.375) / 8.25)
    assert moe_cost.uniform_imbalance(MIXTRAL, L, 4096) == pytest.approx(1 + blom * sd / mean)
    assert moe_cost.routing_imbalance("balanced", MIXTRAL, L, 4096) == 1.0
    assert moe_cost.routing_imbalance(1.25, MIXTRAL, L, 4096) == 1.25
    assert moe_cost.routing_imbalance("uniform", LLAMA8, L, 4096) == 1.0   # dense


def test_routing_from_a_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rec = {"iteration": 1, "moe_layer_0_tokens_per_expert": [4, 4, 2, 2, 1, 1, 1, 1],
           "moe_layer_1_tokens_per_expert": [2] * 8, "lm loss": 3.0}
    path.write_text(json.dumps(rec) + "\n")
    L = Layout(world=64, pp=4, ep=4, vpp=8, micro_batch=1, global_batch=256)
    # EP 4: ranks hold experts (0,1) (2,3) (4,5) (6,7): loads 8,4,2,2 -> 2.0; even -> 1.0
    assert moe_cost.routing_imbalance(str(path), MIXTRAL, L, 4096) == pytest.approx(1.5)
    slow = step(MIXTRAL, L, 4096, moe_routing=str(path))
    even = step(MIXTRAL, L, 4096, moe_routing="balanced")
    assert slow.step > even.step and slow.moe_load == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="does not exist"):
        moe_cost.routing_imbalance(str(tmp_path / "none.jsonl"), MIXTRAL, L, 4096)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"moe_layer_0_tokens_per_expert": [1, 2]}) + "\n")
    with pytest.raises(ConfigError, match="logs 2 experts"):
        moe_cost.routing_imbalance(str(bad), MIXTRAL, L, 4096)


def test_ep_overlap_only_in_the_steady_state():
    L = Layout(world=256, tp=2, pp=8, vpp=4, ep=32, sp=True, micro_batch=1,
               global_batch=2048, schedule="interleaved", account_embedding=True,
               account_loss=True)
    m = ms.recipe("qwen3-235b-a22b")
    # Megatron's interleaved warm-up on stage 0: 2(p-1) + (v-1)p chunks of m*v
    assert est_mod._unpaired_share(L, 0) == pytest.approx((14 + 24) / (128 * 4))
    hidden = step(m, L, 4096, ep_overlap=True, fp8="tensorwise")
    blocking = step(m, L, 4096, fp8="tensorwise")
    assert hidden.step < blocking.step


def test_every_middle_layer_mix_is_a_stage_of_its_own():
    """DeepSeek-V3's first 3 layers are dense: with Bridge's layout (embedding and loss
    counted, VPP 4) stage 1 holds 2 of them and stages 2-6 eight MoE layers each -- the
    step waits for those, so they are estimated, not stage 1 standing for all."""
    from megalite.planner.published import compare
    c = compare("bridge-deepseek-v3", with_search=False)
    L, m = c.as_run.layout, c.model
    assert est_mod._stages(m, L) == [(0, 1), (1, 1), (2, 5), (7, 1)]
    assert ms.stage_layer_kinds(m, L.pp, 2, L.vpp, *L.stage_split) == (0, 8)
    rows = [est_mod._stage_row(m, L, 4096, r, c.cluster, c.opts, c.as_run.moe_load)
            for r in range(L.pp)]
    worst = max(rows, key=lambda x: x["slot"])
    # (1.12x since the all-to-alls hide only behind their paired blocks: stage 1's dense
    # layers no longer hide its MoE layers' share, so the gap to stage 2 narrowed)
    assert worst["r"] == 2 and worst["slot"] > 1.1 * rows[1]["slot"]
    # a uniform model keeps three representatives
    assert est_mod._stages(LLAMA8, Layout(world=64, pp=8, global_batch=64)) == \
        [(0, 1), (1, 6), (7, 1)]


def test_output_layer_hides_no_ep_all_to_all():
    """Megatron's EP A2A overlap pairs layers; the output layer and loss run after them
    with the comm stream idle, so on an all-to-all-bound last stage a bigger output layer
    adds its whole time to the slot."""
    L = Layout(world=256, tp=2, pp=8, vpp=4, ep=32, sp=True, micro_batch=1,
               global_batch=2048, schedule="interleaved", account_embedding=True,
               account_loss=True)
    m = ms.recipe("qwen3-235b-a22b")
    cluster, opts = make_cluster(256, 8, "h100-80gb"), ModelOptions(ep_overlap=True,
                                                                      fp8="tensorwise")
    out = []
    for vocab in (151936, 2 * 151936):
        mv = replace(m, vocab_size=vocab)
        row = est_mod._stage_row(mv, L, 4096, L.pp - 1, cluster, opts)
        head = kernels.stage_compute(mv, L, 4096, L.pp - 1, cluster, opts)["head"]
        assert row["ep"] > 0                        # the all-to-all is not hidden
        out.append((row["slot"], head))
    (s1, h1), (s2, h2) = out
    assert h2 > h1 > 0 and s2 - s1 == pytest.approx(h2 - h1, rel=1e-6)


def test_p2p_shares_the_nic_with_an_all_to_all_that_keeps_it_busy():
    """Qwen3-235B on 256 H100 (EP32 over 4 nodes, EP A2A overlap): the all-to-all bounds
    the steady state; the interleaved p2p to the next stage (another node) leaves through
    the same NIC, so its bytes add to the exposed time instead of hiding behind compute."""
    L = Layout(world=256, tp=2, pp=8, vpp=4, ep=32, sp=True, micro_batch=1,
               global_batch=2048, schedule="interleaved", account_embedding=True,
               account_loss=True)
    m = ms.recipe("qwen3-235b-a22b")
    cluster = make_cluster(256, 8, "h100-80gb")
    opts = ModelOptions(ep_overlap=True, fp8="tensorwise")
    row = est_mod._stage_row(m, L, 4096, 1, cluster, opts)
    comm = cm.comm_seconds(cm.events(m, L, 4096, 1, opts.grad_bytes), L, cluster)
    c = kernels.stage_compute(m, L, 4096, 1, cluster, opts)
    mbs = L.num_micro_batches
    ep, pp = comm["ep"] / mbs, comm["pp"] / mbs
    alone, beside = est_mod._unpaired_share(L, 1), c["t_f"] + c["t_b"] - c["head"]
    assert ep > beside and pp > 0                       # all-to-all bound
    exposed, _ = est_mod.paired_ep_exposed(ep + pp, c)
    assert exposed >= ep + pp - beside
    assert row["ep"] == pytest.approx(alone * ep + (1 - alone) * exposed)
    assert row["pp"] == 0
    # without the overlap the all-to-alls block and the p2p hides behind the chunks
    blocking = est_mod._stage_row(m, L, 4096, 1, cluster, replace(opts, ep_overlap=False))
    assert blocking["ep"] == pytest.approx(ep) and blocking["pp"] == 0


def test_comm_gemm_overlap_orders():
    L = Layout(world=64, tp=8, pp=8, vpp=5, sp=True, micro_batch=1, global_batch=128)
    m = ms.recipe("llama3-70b")
    tp = {o: step(m, L, 8192, tp_comm_overlap=o).times["tp"] for o in ("none", "forward",
                                                                         "all")}
    assert tp["all"] < tp["forward"] < tp["none"]


def test_interleaving_divides_the_bubbles_compute_not_its_hops():
    L = Layout(world=16, pp=4, vpp=4, micro_batch=1, global_batch=16, schedule="interleaved")
    worst = dict(slot=1.0, t_f=0.3, t_b=0.6, rec=0.0)
    assert est_mod._bubble(L, worst, 0.9, 0.05) == pytest.approx(3 * (0.9 / 4 + 0.05))
    assert est_mod._bubble(replace(L, vpp=1, schedule="1f1b"), worst, 0.9, 0.05) == \
        pytest.approx(3 * 0.95)


def test_allgather_cp_is_gathered_and_exposed():
    m = ms.recipe("llama3-405b")
    L = Layout(world=2048, tp=8, pp=16, cp=16, sp=True, micro_batch=1, global_batch=16,
               cp_comm="allgather", vpp=8, schedule="interleaved", account_embedding=True,
               account_loss=True)
    ev = [e for e in cm.events(m, L, 131072, 1) if e.group == "cp"]
    assert {e.op for e in ev} == {"all_gather", "reduce_scatter"}
    ring = step(m, replace(L, cp_comm="p2p"), 131072)
    gathered = step(m, L, 131072)
    assert gathered.times["cp"] > 0 and ring.times["cp"] <= gathered.times["cp"]


def test_block_recompute_sits_between_none_and_full_and_round_trips():
    L = Layout(world=8, micro_batch=1, global_batch=64, zero=3)
    none = step(LLAMA8, L, 8192)
    part = step(LLAMA8, replace(L, recompute="full", recompute_layers=5), 8192)
    full = step(LLAMA8, replace(L, recompute="full"), 8192)
    assert none.step < part.step < full.step
    assert full.memory["activations"] < part.memory["activations"] < none.memory["activations"]
    B = replace(L, recompute="full", recompute_layers=5)
    flags = B.parallel_flags()
    assert flags[flags.index("--recompute-method") + 1] == "block"
    assert flags[flags.index("--recompute-num-layers") + 1] == "5"
    assert layout_from_config(B.to_config(LLAMA8, 8192)) == B


DSV3 = ms.recipe("deepseek-v3")


def test_mla_gemms_params_and_flops_read_one_table():
    """MLA's shapes live in model_spec.mla_projections: the parameters, the FLOPs and the
    GEMMs kernels.py times all follow from it (DeepSeek-V3's hand count)."""
    q = 1536 * (7168 + 128 * 192)
    kv = 512 * (7168 + 128 * 256) + 7168 * 64
    out = 128 * 128 * 7168
    assert fl.mla_projection_flops(DSV3) == 2 * (q + kv + out)
    assert fl.mla_projection_flops(DSV3, "column") == 2 * 128 * (1536 * 192 + 512 * 256)
    # TP2 + SP: the duplicated down projections run on the sequence shard, so the listed
    # attention GEMMs are the model's attention FLOPs over TP exactly
    L = Layout(world=2, tp=2, sp=True, global_batch=1)
    gs = kernels.layer_gemms(DSV3, L, True, 4096)[:5]
    assert [g.split for g in gs] == ["duplicated", "column", "duplicated", "column", "row"]
    assert sum(g.flops for g in gs) == fl.mla_projection_flops(DSV3) * 4096 / 2
    # without SP every TP rank runs the down projections on the whole sequence
    dup = kernels.layer_gemms(DSV3, replace(L, sp=False), True, 4096)[0]
    assert dup.rows == 4096 and dup.flops == 2 * 4096 * 7168 * 1536
    weights = sum(g.k * g.n for g in gs)
    assert ms.mla_attention_params(DSV3, tp=2) == weights + ms.mla_latent_norm_params(DSV3)


def test_mtp_runs_on_the_last_stage_as_one_more_layer_and_head():
    """The last stage computes the MTP depth's layer (MoE, like DeepSeek-V3's last), its
    eh_proj and the output layer once more; the other stages are untouched."""
    L = Layout(world=8, tp=1, pp=4, ep=8, etp=1, global_batch=64)
    cl = make_cluster(8, 8, "h100-80gb")
    m = replace(DSV3, num_layers=8, moe_layer_freq=[0] * 3 + [1] * 5)
    no = replace(m, mtp_num_layers=None)
    opts = ModelOptions()
    with_mtp = kernels.stage_compute(m, L, 4096, 3, cl, opts)
    without = kernels.stage_compute(no, L, 4096, 3, cl, opts)
    assert kernels.stage_compute(m, L, 4096, 1, cl, opts) == \
        kernels.stage_compute(no, L, 4096, 1, cl, opts)
    assert ms.stage_layer_kinds(m, 4, 3) == (0, 2)
    assert ms.with_mtp_layers(m, (0, 2), True) == (0, 3)
    assert with_mtp["core"] == pytest.approx(without["core"] * 3 / 2)   # one more layer
    mtp = fl.mtp_forward_flops(m, 4096)
    assert mtp["proj"] == 4 * 7168 ** 2 and mtp["logits"] == fl.logits_forward_flops(m)
    assert with_mtp["head"] / without["head"] == pytest.approx(
        1 + (mtp["logits"] + mtp["proj"]) / fl.logits_forward_flops(m))


def test_bridge_layout_counts_the_mtp_module_as_a_pipeline_layer():
    """'Et|(tt|)*30mL': 61 layers + embedding + MTP + loss = 32 x 2 slots at PP8 VPP4; the
    last chunk holds no transformer layer, the MTP module stays on the last stage."""
    text = "Et|(tt|)*30mL"
    split = ms.pipeline_split(61, 8, 4, mtp_layers=1, layout=text)
    assert split.layers(0, 0) == [0] and split.layers(7, 3) == []
    assert all(len(split.layers(r, c)) == 2 for r in range(8) for c in range(4)
               if (r, c) not in ((0, 0), (7, 3)))
    assert split.counts() == [7] + [8] * 6 + [6]
    L = Layout(world=1024, tp=2, pp=8, vpp=4, ep=64, sp=True, schedule="interleaved",
               pipeline_layout=text,
               global_batch=8192)
    assert f"layout {text}" in L.short()
    assert ms.stage_layer_kinds(DSV3, 8, 7, 4, *L.stage_split) == (0, 6)
    assert ms.stage_params(DSV3, 7, 2, 8, 4, 1, 64, *L.stage_split).total > \
        ms.stage_params(DSV3, 6, 2, 8, 4, 1, 64, *L.stage_split).total   # + MTP, embedding
    assert "--pipeline-model-parallel-layout" in L.parallel_flags()
    validate_layout(L.to_config(DSV3, 4096))          # the string is a pretrain_gpt.py flag


def test_causal_count_halves_the_mtp_layers_scores_too():
    """Megatron-Bridge's DeepSeek-V3 count (flop_utils.py): every layer's core attention
    halved, the MTP layer's included; eh_proj 4h^2 and the logits once more per token."""
    from megalite.planner.published import model_flops
    tokens = 4096.0 * 8
    lin, core = fl.layers_forward_flops(DSV3, 4096)
    mtp = fl.mtp_forward_flops(DSV3, 4096)
    want = 3 * tokens * (lin + fl.logits_forward_flops(DSV3) + mtp["linear"]) + \
        1.5 * tokens * (core + mtp["core"])
    assert model_flops(DSV3, 4096, 8, "causal") == pytest.approx(want, rel=1e-12)


def test_each_ep_all_to_all_hides_only_behind_its_partner():
    """Megatron's EP A2A overlap pairs each all-to-all with one block of the other
    micro-batch (model_chunk_schedule_plan.py): combine_bwd with the attention forward,
    dispatch fwd + bwd with the experts' backward + forward, combine_fwd with the
    attention backward.  Where the step has compute to spare but a combine outlasts its
    attention block, that excess is exposed; the flex dispatchers' SMs slow what runs
    beside them by their share (moe_dispatch_sms)."""
    c = dict(moe_f=3.0, moe_b=6.0, mlp_f=2.0, mlp_b=4.0, mlp_bd=2.0)  # attention: 1, 2
    exposed, hidden = est_mod.paired_ep_exposed(8.0, c)         # 2 s per all-to-all
    assert 8.0 < c["moe_f"] + c["moe_b"]                        # the sum would hide it all
    assert exposed == pytest.approx(1.0) and hidden == pytest.approx(7.0)
    assert est_mod.paired_ep_exposed(0.0, c) == (0.0, 0.0)
    # the expert forward waits for its tokens: a 3 s dispatch beside a 1 s expert
    # backward starts the 5 s expert forward at 3 s -- 6 s of comm beside 6 s of compute
    # in the middle block, and still 2 s exposed
    late = dict(moe_f=8.0, moe_b=8.0, mlp_f=5.0, mlp_b=1.0, mlp_bd=0.5)
    assert est_mod.paired_ep_exposed(12.0, late) == pytest.approx((2.0, 10.0))
    # without --delay-wgrad-compute the dispatch backward waits for the experts' weight
    # gradients too: 2 s of dgrad + 2 s of wgrad, then a 2 s dispatch beside a 1 s expert
    # forward -- 1 s exposed that the delayed weight gradients hide
    short = dict(moe_f=4.0, moe_b=8.0, mlp_f=1.0, mlp_b=4.0, mlp_bd=2.0)
    assert est_mod.paired_ep_exposed(8.0, short) == pytest.approx((0.0, 8.0))
    assert est_mod.paired_ep_exposed(8.0, short, delay_wgrad=False) == \
        pytest.approx((1.0, 7.0))
    from megalite.planner.published import compare
    c = compare("bridge26-dsv3-gb200", with_search=False)     # HybridEP, EP A2A overlap
    m, L, rack = c.model, c.as_run.layout, c.cluster
    opts = replace(c.opts, moe_dispatch_sms=None)
    ep = {n: est_mod._stage_row(m, L, 4096, 1, rack, replace(opts, moe_dispatch_sms=n))["ep"]
          for n in (16, 20, 32)}
    assert ep[16] < ep[20] < ep[32]
    assert est_mod._stage_row(m, L, 4096, 1, rack, opts)["ep"] == pytest.approx(ep[20])


def test_moe_dispatch_syncs_idle_the_gpu_unless_paired_or_graphed():
    """The dispatcher's device-to-host syncs leave the GPU idle once per MoE layer and
    micro-batch (kernels.MOE_SYNC_IDLE_SECONDS, NVIDIA's Nsight step-vs-union gap); the EP
    overlap's other micro-batch fills the gap in its pairs, a graphed layer has no sync,
    a dense model no dispatcher."""
    L = Layout(world=16, ep=16, micro_batch=1, global_batch=1024)
    m = ms.recipe("qwen3-235b-a22b")
    rack = make_cluster(16, 8, "h100-80gb")
    eager = estimate(m, L, 4096, rack, ModelOptions(moe_dispatcher="hybridep"))
    layers = m.num_layers                    # every Qwen3 layer is MoE
    assert eager.times["moe_sync"] == pytest.approx(
        L.num_micro_batches * layers * kernels.MOE_SYNC_IDLE_SECONDS)
    assert kernels.MOE_SYNC_IDLE_SECONDS == pytest.approx(1.893e-3 / 3.072, rel=1e-3)
    graphed = estimate(m, L, 4096, rack, ModelOptions(moe_dispatcher="hybridep",
                                                      cuda_graphs=True))
    assert graphed.times["moe_sync"] == 0.0
    paired = estimate(m, L, 4096, rack, ModelOptions(moe_dispatcher="hybridep",
                                                     ep_overlap=True))
    alone = est_mod._unpaired_share(L, 0)
    assert 0 < alone < 1
    assert paired.times["moe_sync"] == pytest.approx(alone * eager.times["moe_sync"])
    dense = step(LLAMA8, Layout(world=8, micro_batch=1, global_batch=64), 4096)
    assert dense.times["moe_sync"] == 0.0


def test_flex_dispatch_across_nodes_hides_the_measured_share_under_overlap():
    """DeepEP / HybridEP over the NICs with the EP overlap: the all-to-alls stretch by the
    measured 1.31x and at most 36.55% of them hide (estimate.FLEX_RDMA_*); inside one
    NVLink domain, and for NCCL's all-to-all, the pairing alone decides."""
    assert est_mod.FLEX_RDMA_OVERLAP_STRETCH == pytest.approx(1.3124, abs=1e-3)
    m = ms.recipe("qwen3-235b-a22b")
    L = Layout(world=16, ep=16, micro_batch=1, global_batch=1024)
    rack = make_cluster(16, 8, "h100-80gb")

    def ep_row(**kw):
        opts = ModelOptions(**kw)
        return est_mod._stage_row(m, L, 4096, 0, rack, opts)["ep"]

    off = ep_row(moe_dispatcher="hybridep")
    on = ep_row(moe_dispatcher="hybridep", ep_overlap=True)
    alone = est_mod._unpaired_share(L, 0)
    stretched = off * est_mod.FLEX_RDMA_OVERLAP_STRETCH
    assert on == pytest.approx(alone * off + (1 - alone) * stretched *
                               (1 - est_mod.FLEX_RDMA_OVERLAP_HIDDEN))
    # NCCL's all-to-all over the same NICs: the pairing alone (it hides more)
    nccl_off, nccl_on = ep_row(moe_dispatcher="alltoall"), ep_row(moe_dispatcher="alltoall",
                                                                  ep_overlap=True)
    assert nccl_on / nccl_off < on / off
    # EP inside the node: no stretch, the pairing alone
    L8 = Layout(world=8, ep=8, micro_batch=1, global_batch=512)
    node = make_cluster(8, 8, "h100-80gb")
    c = kernels.stage_compute(m, L8, 4096, 0, node, ModelOptions(moe_dispatcher="hybridep"))
    row_off = est_mod._stage_row(m, L8, 4096, 0, node, ModelOptions(moe_dispatcher="hybridep"))
    exposed, _ = est_mod.paired_ep_exposed(row_off["ep"], c)
    row_on = est_mod._stage_row(m, L8, 4096, 0, node,
                                ModelOptions(moe_dispatcher="hybridep", ep_overlap=True))
    a8 = est_mod._unpaired_share(L8, 0)
    assert row_on["ep"] >= a8 * row_off["ep"] + (1 - a8) * exposed - 1e-12
    assert row_on["ep"] < a8 * row_off["ep"] + (1 - a8) * row_off["ep"] * (
        est_mod.FLEX_RDMA_OVERLAP_STRETCH * (1 - est_mod.FLEX_RDMA_OVERLAP_HIDDEN))
