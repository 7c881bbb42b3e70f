"""The planner on 2026 hardware (docs/planner.md, "Hardware"): the Blackwell presets'
datasheet figures, the NVL72 NVLink domain in the comm model, NVFP4 / MXFP8 GEMMs, the MoE
dispatchers (NCCL all-to-all, DeepEP, HybridEP), token dropping, and the small-width
expert GEMM efficiency."""
from megalite.planner import comm_model as cm
from megalite.planner.hardware import (DATASHEET_BF16_TFLOPS, GPU_PRESETS, datasheet_peak_flops,
                                       make_cluster)
from megalite.planner.layout import Layout


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
