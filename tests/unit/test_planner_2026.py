"""The planner on 2026 hardware (docs/planner.md, "Hardware"): the Blackwell presets'
datasheet figures, the NVL72 NVLink domain in the comm model, NVFP4 / MXFP8 GEMMs, the MoE
dispatchers (NCCL all-to-all, DeepEP, HybridEP), token dropping, and the small-width
expert GEMM efficiency."""
from dataclasses import replace

import pytest

from megalite.config import ConfigError
from megalite.planner import comm_model as cm
from megalite.planner import calibration, kernels, moe_cost
from megalite.planner import model_spec as ms
from megalite.planner.estimate import ModelOptions, estimate
from megalite.planner.hardware import (DATASHEET_BF16_TFLOPS, GPU_PRESETS, datasheet_peak_flops,
                                       make_cluster)
from megalite.planner.layout import Layout

MIXTRAL = ms.recipe("mixtral-8x7b")


def test_blackwell_presets_and_device_names():
    gb300, b200 = GPU_PRESETS["gb300-nvl72"], GPU_PRESETS["b200"]
    assert (gb300.peak_tflops, gb300.fp8_peak_tflops, gb300.fp4_peak_tflops) == \
        (2500.0, 5000.0, 15000.0)
    assert gb300.inter_node_gbps == 2 * b200.inter_node_gbps      # ConnectX-8 vs -7
    # B200's measured MAMF fraction carries to its siblings; FP4 uses the FP8 fraction
    assert abs(gb300.matmul_tflops / 2500 - b200.matmul_tflops / 2250) < 1e-9
    assert abs(gb300.fp4_matmul_tflops / 15000 - b200.fp8_matmul_tflops / 4500) < 1e-9
    assert GPU_PRESETS["h200-141gb"].fp4_peak_tflops is None
    # "GB200" must not read as "B200" in a device name (MFU's peak)
    assert datasheet_peak_flops("NVIDIA GB200")[1] == "GB200"
    assert datasheet_peak_flops("NVIDIA B200")[1] == "B200"
    assert DATASHEET_BF16_TFLOPS["B300"] == 2250.0


def test_nvl72_domain_keeps_groups_on_nvlink_across_trays():
    """EP 32 over trays of 4 GPUs: NVLink inside an NVL72 rack, the NIC on HGX B200."""
    L = Layout(world=64, ep=32, micro_batch=1, global_batch=64)
    nvl = make_cluster(64, None, "gb200-nvl72")
    hgx = make_cluster(64, None, "b200")
    assert (nvl.gpus_per_node, nvl.nvlink_domain, hgx.nvlink_domain) == (4, 64, 8)
    assert not cm.leaves_node(L, nvl, "ep") and cm.leaves_node(L, hgx, "ep")
    nvl_bw, _ = cm.link_of(nvl, 32, 1)
    hgx_bw, _ = cm.link_of(hgx, 32, 1)
    assert nvl_bw == nvl.link(1)[0] and hgx_bw < nvl_bw / 2
    # past the rack (144 GPUs = 2 racks), a DP group leaves the domain
    big = make_cluster(144, None, "gb200-nvl72")
    assert cm.leaves_node(Layout(world=144, micro_batch=1, global_batch=144), big, "dp")


def test_deepep_sends_once_per_node_and_moves_only_the_ep_term():
    """DeepSeek-V3 at EP 64 over 8 nodes, top-4 of 8 node groups: NCCL's all-to-all sends 7
    of 8 copies over the NIC, DeepEP at most 4 x 7/8 node copies."""
    m = ms.recipe("deepseek-v3")
    L = Layout(world=64, ep=64, micro_batch=1, global_batch=64, pp=1)
    nccl = moe_cost.dispatch_fanout(m, L, "alltoall", 8)
    deepep = moe_cost.dispatch_fanout(m, L, "deepep", 8)
    assert nccl[0] == pytest.approx(8 * 56 / 64)
    assert deepep[0] == pytest.approx(4 * 7 / 8) and deepep[0] <= nccl[0] / 2
    cl = make_cluster(64, 8, "h100-80gb")
    small = replace(m, num_layers=4, moe_layer_freq=1, mtp_num_layers=None)
    a = estimate(small, L, 4096, cl, ModelOptions())
    d = estimate(small, L, 4096, cl, ModelOptions(moe_dispatcher="deepep"))
    assert d.times["ep"] < 0.6 * a.times["ep"]            # half the NIC bytes
    assert d.times["compute"] == pytest.approx(a.times["compute"])
    # HybridEP spans the NVL72 domain; DeepEP stops at the tray (4 GPUs)
    rack = make_cluster(64, None, "gb200-nvl72")
    h = estimate(small, L, 4096, rack, ModelOptions(moe_dispatcher="hybridep"))
    e = estimate(small, L, 4096, rack, ModelOptions(moe_dispatcher="deepep"))
    assert h.times["ep"] < e.times["ep"]
    with pytest.raises(ConfigError, match="dispatcher"):
        moe_cost.dispatch_fanout(m, L, "nvshmem", 8)


def test_capacity_factor_caps_or_pads_the_expert_load():
    m = replace(MIXTRAL, moe_expert_capacity_factor=1.1)
    assert moe_cost.capacity_load(m, 1.3, pad=False) == pytest.approx(1.1)
    assert moe_cost.capacity_load(m, 1.05, pad=False) == pytest.approx(1.05)
    assert moe_cost.capacity_load(m, 1.05, pad=True) == pytest.approx(1.1)
    assert moe_cost.capacity_load(MIXTRAL, 1.3, pad=False) == 1.3       # dropless
    L = Layout(world=8, ep=8, micro_batch=1, global_batch=64)
    drop = estimate(m, L, 4096, make_cluster(8), ModelOptions(moe_routing=1.5))
    assert drop.moe_load == pytest.approx(1.1)


def test_small_inner_dimension_slows_fine_grained_experts():
    """The DeepGEMM-fitted curve: K = 512 keeps ~44% of the FP8 rate, 7168 ~95%."""
    assert kernels.inner_efficiency(512, 1.0) == pytest.approx(0.437, abs=0.005)
    assert kernels.inner_efficiency(7168, 1.0) == pytest.approx(0.949, abs=0.005)
    assert kernels.inner_efficiency(768, 2.0) > kernels.inner_efficiency(768, 1.0)
    assert kernels.inner_efficiency(16384, 1.0) == 1.0
    # an expert of width 768 (Qwen3-30B-A3B) loses more than Mixtral's 14336
    fine = replace(MIXTRAL, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768)
    L = Layout(world=8, ep=8, micro_batch=1, global_batch=64)
    cl = make_cluster(8)
    gs = [g for g in kernels.layer_gemms(fine, L, True, 4096) if g.expert]
    assert min(g.k for g in gs) == 768
    assert kernels.inner_efficiency(768, 2.0) < kernels.inner_efficiency(14336, 2.0)
    assert estimate(fine, L, 4096, cl, ModelOptions()).step > 0


def _plan(*args):
    import os
    import shutil
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    exe = shutil.which("megalite", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "megalite.cli"]
    return subprocess.run(cmd + ["plan"] + list(args), capture_output=True, text=True,
                          cwd=root, timeout=120)


def test_plan_on_an_nvl72_rack_with_nvfp4_hybridep_and_etp():
    """The flags docs/planner.md shows, as a user runs them: one launch checks the preset's
    trays of 4, NVFP4, the flex dispatcher, --etp and --recompute-modules together."""
    import json
    out = _plan("--recipe", "mixtral-8x7b", "--num-gpus", "64", "--gpu", "gb300-nvl72",
                "--global-batch-size", "256", "--fp4-recipe", "nvfp4",
                "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
                "hybridep", "--tp", "2", "--etp", "1", "--ep", "8", "--pp", "1",
                "--recompute-modules", "core_attn", "mlp", "--ep-overlap", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["cluster"]["gpus_per_node"] == 4
    best = got["candidates"][0]["layout"]
    assert (best["tp"], best["etp"], best["ep"]) == (2, 1, 8)
    bad = _plan("--recipe", "mixtral-8x7b", "--num-gpus", "8", "--gpu", "h100-80gb",
                "--global-batch-size", "64", "--fp4-recipe", "nvfp4")
    assert bad.returncode == 2 and bad.stdout == ""
    line, = bad.stderr.strip().splitlines()
    assert "--fp4-recipe" in line and "FP4 tensor cores" in line


def test_cpu_offloading_frees_memory_and_costs_only_what_the_host_link_cannot_hide():
    m = ms.recipe("llama3-70b")
    L = Layout(world=64, zero=3, micro_batch=2, global_batch=256)
    # the recipe's 20 layers hide over NVLink-C2C (and PCIe); all 80 over PCIe do not
    for gpu, layers, hidden in (("gb300-nvl72", 20, True), ("h100-80gb", 80, False),
                                ("h100-80gb", 20, True)):
        cl = make_cluster(64, None, gpu)
        base = estimate(m, L, 8192, cl, ModelOptions())
        off = estimate(m, L, 8192, cl, ModelOptions(cpu_offload_layers=layers))
        share = layers / 80
        assert off.memory["activations"] == pytest.approx(
            (1 - share) * base.memory["activations"], rel=1e-6)
        assert (off.times["offload"] == 0.0) is hidden, (gpu, layers)
        assert off.step == pytest.approx(base.step + off.times["offload"], rel=1e-6)
    bad = _plan("--recipe", "llama3-8b", "--num-gpus", "8", "--global-batch-size", "64",
                "--cpu-offloading")
    assert bad.returncode == 2 and "--cpu-offloading-num-layers" in bad.stderr


def test_cuda_graphs_hide_only_the_launch_time_a_layer_does_not_cover():
    """--cuda-graph-impl: a layer pass becomes one graph launch.  Llama-3-8B at TP8 on 1024
    tokens gives each GPU less work per layer than the host takes to launch its kernels, so
    graphs shorten the step; at 8192 tokens per micro-batch the GPU is the longer one and
    nothing moves (the published rows: benchmarks/planner_vs_published.py is unchanged)."""
    import json

    def compute(seq, impl):
        out = _plan("--recipe", "llama3-8b", "--num-gpus", "8", "--global-batch-size", "8",
                    "--seq-length", str(seq), "--tp", "8", "--pp", "1",
                    "--micro-batch-sizes", "1", "--cuda-graph-impl", impl, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["candidates"][0]["times_s"]["compute"]
    eager, graphs = compute(1024, "none"), compute(1024, "transformer_engine")
    assert graphs < 0.95 * eager
    assert compute(8192, "local") == compute(8192, "none")
    assert kernels.exposed_launch_seconds(1.0, True, True, False) == 0.0
    assert kernels.exposed_launch_seconds(0.0, False, False, False) == \
        kernels.KERNELS_PER_LAYER[False] * kernels.HOST_SECONDS_PER_KERNEL


def test_nvfp4_gemms_run_at_a_multiple_of_the_fp8_ceiling_on_every_blackwell():
    """NVFP4's rate is NVFP4_GEMM x the FP8 ceiling: GB300's 1.5x FP4 datasheet peak over
    GB200 does not reach the GEMMs (equal FP8 peaks give equal NVFP4 rates)."""
    nv = kernels.FP8_RECIPES["nvfp4"]
    gb300, gb200 = GPU_PRESETS["gb300-nvl72"], GPU_PRESETS["gb200-nvl72"]
    assert gb300.fp4_peak_tflops == 1.5 * gb200.fp4_peak_tflops
    for gpu in (gb300, gb200, GPU_PRESETS["b200"]):
        assert kernels.low_precision_rate(gpu, nv) == pytest.approx(
            gpu.fp8_matmul_tflops * calibration.NVFP4_GEMM)
        assert kernels.low_precision_rate(gpu, nv, 2.0) == pytest.approx(
            2 * gpu.fp8_matmul_tflops)
    assert kernels.low_precision_rate(gb300, nv) == pytest.approx(
        kernels.low_precision_rate(gb200, nv) * gb300.fp8_matmul_tflops /
        gb200.fp8_matmul_tflops)
    mx = kernels.FP8_RECIPES["mxfp8"]
    assert kernels.low_precision_rate(gb200, mx) == pytest.approx(gb200.fp8_matmul_tflops)
    # the step follows: NVFP4 beats MXFP8 by the same factor on both racks
    m = replace(ms.recipe("llama3-8b"), num_layers=4)
    L = Layout(world=8, micro_batch=1, global_batch=8)
    gains = []
    for gpu in ("gb300-nvl72", "gb200-nvl72"):
        cl = make_cluster(8, None, gpu)
        fp4 = estimate(m, L, 4096, cl, ModelOptions(fp8="nvfp4"))
        fp8 = estimate(m, L, 4096, cl, ModelOptions(fp8="mxfp8"))
        gains.append(fp8.times["compute"] / fp4.times["compute"])
    assert gains[0] > 1.0 and gains[1] == pytest.approx(gains[0], rel=0.05)


def test_ep_overlap_needs_virtual_stages_under_pipeline_parallelism():
    """Megatron refuses EP A2A overlap at PP > 1 without VPP: there the all-to-alls stay
    on the critical path (estimate.ep_overlap_applies); PP 1 and interleaved PP hide them."""
    from megalite.planner.estimate import ep_overlap_applies
    on = ModelOptions(ep_overlap=True, moe_routing="balanced")
    assert ep_overlap_applies(Layout(world=8, ep=8, micro_batch=1, global_batch=64), on)
    assert ep_overlap_applies(Layout(world=16, ep=8, pp=2, vpp=2, micro_batch=1,
                                     global_batch=64), on)
    plain = Layout(world=16, ep=8, pp=2, micro_batch=1, global_batch=64)
    assert not ep_overlap_applies(plain, on)
    assert not ep_overlap_applies(Layout(world=8, ep=8, micro_batch=1, global_batch=64),
                                  ModelOptions())
    m = replace(MIXTRAL, num_layers=4)
    cl = make_cluster(16, 8, "h100-80gb")
    off = estimate(m, plain, 4096, cl, ModelOptions(moe_routing="balanced"))
    asked = estimate(m, plain, 4096, cl, on)
    assert asked.times["ep"] == pytest.approx(off.times["ep"]) and off.times["ep"] > 0
    inter = replace(plain, vpp=2, schedule="interleaved")
    assert estimate(m, inter, 4096, cl, on).times["ep"] < estimate(
        m, inter, 4096, cl, ModelOptions(moe_routing="balanced")).times["ep"]


def test_plan_with_quantized_weights_and_the_precision_aware_optimizer():
    """Megatron's --fp8-param-gather and --use-precision-aware-optimizer with 16- and 8-bit
    moments, as a user runs `megalite plan`: at one layout the weights lose their bf16 copy
    and the optimizer state shrinks from 12 bytes a parameter to 4 (fp32 master) + 2 + 1;
    without the FP8 master, FusedAdam's remainder makes it 2 + 4 + 4.  Each misuse is one
    line and exit status 2."""
    import json
    from megalite.planner.optimizer_precision import adam_state_bytes
    base = ("--recipe", "llama3-8b", "--num-gpus", "8", "--gpu", "h100-80gb",
            "--global-batch-size", "64", "--tp", "1", "--pp", "2", "--vpp", "1",
            "--micro-batch-sizes", "1", "--zero-stages", "1", "--json")

    def memory(*extra):
        out = _plan(*base, *extra)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["candidates"][0]["memory_bytes"]
    fp8 = memory("--fp8-recipe", "tensorwise")
    low = memory("--fp8-recipe", "tensorwise", "--fp8-param-gather",
                 "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                 "--exp-avg-sq-dtype", "fp8")
    assert low["weights"] < fp8["weights"] and low["grads"] == fp8["grads"]
    assert low["optimizer"] * 12 == pytest.approx(fp8["optimizer"] * 7, rel=1e-6)
    assert low["total"] < fp8["total"]
    plain, remainder = memory(), memory("--use-precision-aware-optimizer")
    assert remainder["optimizer"] * 12 == pytest.approx(plain["optimizer"] * 10, rel=1e-6)
    assert adam_state_bytes(True, "bf16", "bf16", "fp32", "mxfp8", True) == ((2, 2), 4)
    assert adam_state_bytes(True, main_params="fp16") == ((4, 4), 2)
    assert adam_state_bytes(True, fp32_training=True) == ((4, 4), 4)
    for extra, flag in ((("--exp-avg-dtype", "bf16"), "--exp-avg-dtype"),
                        (("--fp8-param-gather",), "--fp8-param-gather"),
                        (("--fp4-recipe", "nvfp4", "--fp4-param-gather", "--zero-stages", "0"),
                         "--zero-stages")):
        bad = _plan(*base[:-3], *extra)
        assert bad.returncode == 2 and bad.stdout == "", (extra, bad.stderr)
        line, = bad.stderr.strip().splitlines()
        assert flag in line, line
