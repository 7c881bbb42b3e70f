"""Which equivalence test runs which combination of features (``megalite/cli/features.py``
names the features; ``tests/unit/test_feature_table.py`` checks every name here exists).

Kept apart from the rules so the rule table stays one readable page.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

# ---- which equivalence test runs which combination ----------------------------------------------
# "file::function[case]" (case: its name in that file's cases): the features that run
# together there, each checked against the
# single-process run (or, for TE/FP8 on CPU, against the local layers through tests/te_fake).
# A covered pair is any two features of one entry.
_PE = "tests/distributed/test_pipeline_equivalence.py::test_pipeline_matches_single_process"
_CP = "tests/distributed/test_context_parallel_dist.py::test_training_loop_matches_single_process"
_MOE = "tests/distributed/test_moe_dist.py::test_moe_matches_one_process"
_DP2 = "tests/distributed/test_dp_overlap_fsdp2_dist.py::test_overlap_zero2_fsdp2_world2"
_DP4 = "tests/distributed/test_dp_overlap_fsdp2_dist.py::test_overlap_zero2_fsdp2_world4"
_FC = "tests/distributed/test_fsdp2_compose_dist.py::test_fsdp2_composes"
PAIRS_TEST = "tests/distributed/test_feature_pairs_dist.py::test_combination_matches_single_process"
_DV = "tests/distributed/test_dualpipe_dist.py::test_dualpipev_matches_single_process"
COVERAGE: Dict[str, Sequence[str]] = {
    f"{_PE}[tp2-pp2-sp-full-uniform1]": ("tp", "sp", "pp-1f1b", "recompute-full"),
    f"{_PE}[tp2-pp2-sp-selective-attn]": ("tp", "sp", "pp-1f1b", "recompute-selective"),
    f"{_PE}[tp2-pp2-vpp2-sp-m4]": ("tp", "sp", "pp-interleaved"),
    f"{_PE}[account-loss-tp2-pp2-vpp2-sp-full-llama]":
        ("tp", "sp", "pp-interleaved", "pp-account", "recompute-full"),
    f"{_PE}[vpp2-pp2-selective-mlp]": ("pp-interleaved", "recompute-selective"),
    f"{_PE}[tp2-pp2-zb-sp-full-uniform1-llama]": ("tp", "sp", "pp-zero-bubble",
                                                  "recompute-full"),
    f"{_PE}[account-both-zb-pp4-empty-ends]": ("pp-zero-bubble", "pp-account"),
    f"{_PE}[pp2-uneven-1+3]": ("pp-1f1b", "pp-uneven"),
    f"{_PE}[pp2-selective-all]": ("pp-1f1b", "recompute-selective"),
    f"{_CP}[cp2-tp2-sp-p2p-core-attn-recompute]": ("cp-p2p", "tp", "sp",
                                                    "recompute-selective"),
    f"{_CP}[cp2-dp2-a2a-full-recompute]": ("cp-a2a", "recompute-full"),
    f"{_CP}[cp2-tp2-sp-a2a]": ("cp-a2a", "tp", "sp"),
    f"{_CP}[cp2-pp2-1f1b-p2p]": ("cp-p2p", "pp-1f1b"),
    f"{_CP}[cp2-pp2-interleaved-a2a]": ("cp-a2a", "pp-interleaved"),
    f"{_CP}[cp2-pp2-zero-bubble-p2p]": ("cp-p2p", "pp-zero-bubble"),
    f"{_CP}[cp2-dp2-p2p-distopt]": ("cp-p2p", "distopt"),
    f"{_MOE}[ep2-tp2-sp-etp1]": ("moe", "ep", "tp", "sp", "moe-alltoall"),
    f"{_MOE}[ep2-etp2]": ("moe", "ep", "expert-tp", "moe-alltoall"),
    f"{_MOE}[ep2-pp2]": ("moe", "ep", "pp-1f1b", "moe-alltoall"),
    f"{_MOE}[ep2-pp2-zero-bubble]": ("moe", "ep", "pp-zero-bubble", "moe-alltoall"),
    f"{_MOE}[ep2-dp-distopt]": ("moe", "ep", "distopt", "moe-alltoall"),
    f"{_MOE}[ep2-pp2-full-recompute]": ("moe", "ep", "pp-1f1b", "recompute-full",
                                        "moe-alltoall"),
    f"{_MOE}[ep4-recompute-mlp]": ("moe", "ep", "recompute-selective", "moe-alltoall"),
    f"{_MOE}[ep2-etp2-allgather]": ("moe", "ep", "expert-tp", "moe-allgather"),
    f"{_DP2}[do_ov_pg]": ("distopt", "overlap-grad-reduce", "overlap-param-gather"),
    f"{_DP4}[fsdp2_tp2]": ("fsdp2", "tp", "sp"),
    f"{_FC}[fsdp2_pp2_1f1b]": ("fsdp2", "pp-1f1b"),
    f"{_FC}[fsdp2_pp2_interleaved]": ("fsdp2", "pp-interleaved"),
    f"{_FC}[fsdp2_pp2_zero_bubble]": ("fsdp2", "pp-zero-bubble"),
    f"{_FC}[fsdp2_cp2]": ("fsdp2", "cp-p2p"),
    f"{_FC}[fsdp2_ep2]": ("fsdp2", "moe", "ep", "moe-alltoall"),
    f"{_FC}[hsdp_2x2]": ("fsdp2", "hsdp"),
    f"{_FC}[distopt_2x2]": ("distopt", "overlap-grad-reduce", "hsdp"),
    f"{_FC}[fsdp2_tp2_pp2]": ("fsdp2", "tp", "sp", "pp-1f1b"),
    f"{_DP4}[do_ov_tp2_pp2]": ("distopt", "overlap-grad-reduce", "tp", "pp-1f1b"),
    "tests/distributed/test_fused_cross_entropy_dist.py"
    "::test_fused_tp_matches_unfused_single_process": ("fused-loss", "tp", "sp"),
    "tests/distributed/test_te_backend_dist.py"
    "::test_te_spec_at_tp2_matches_single_process_local": ("te", "tp", "sp"),
    "tests/gpu/test_te_gpu.py::test_te_matches_local_training_tp2": ("te", "tp", "sp"),
    "tests/gpu/test_te_gpu.py::test_context_parallel_through_te[p2p]": ("te", "cp-p2p"),
    "tests/gpu/test_te_gpu.py::test_context_parallel_through_te[a2a]": ("te", "cp-a2a"),
    "tests/distributed/test_distributed_optimizer_dist.py::test_distributed_optimizer_world4"
    "[tp2_dp2_sp]": ("distopt", "tp", "sp"),
    "tests/distributed/test_distributed_optimizer_dist.py::test_distributed_optimizer_world4"
    "[pp2_dp2_gpt2]": ("distopt", "pp-1f1b"),
    f"{PAIRS_TEST}[moe-te-fp8-tp2-cp2-ep2-distopt-fused]":
        ("tp", "sp", "cp-p2p", "moe", "ep", "expert-tp", "moe-alltoall", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "te", "fp8", "fused-loss"),
    f"{PAIRS_TEST}[moe-te-cp2-a2a-pp2-account-etp2-allgather-distopt-selective-fused]":
        ("pp-1f1b", "pp-account", "cp-a2a", "moe", "expert-tp", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "te", "recompute-selective",
         "fused-loss"),
    f"{PAIRS_TEST}[moe-cp2-a2a-zb-uneven-ep2-distopt-attn-fused]":
        ("pp-zero-bubble", "pp-uneven", "cp-a2a", "moe", "ep", "moe-alltoall", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "recompute-selective", "fused-loss"),
    f"{PAIRS_TEST}[moe-te-fp8-tp2-pp2-uneven-etp2-allgather-distopt]":
        ("tp", "sp", "pp-1f1b", "pp-uneven", "moe", "expert-tp", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "te", "fp8"),
    f"{PAIRS_TEST}[moe-cp2-vpp2-etp2-allgather-distopt-full-fused]":
        ("pp-interleaved", "cp-p2p", "moe", "expert-tp", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather", "recompute-full", "fused-loss"),
    f"{PAIRS_TEST}[moe-cp2-zb-account-etp2-ddp-overlap-attn-fused]":
        ("pp-zero-bubble", "pp-account", "cp-p2p", "moe", "expert-tp", "moe-alltoall",
         "overlap-grad-reduce", "recompute-selective", "fused-loss"),
    f"{PAIRS_TEST}[moe-te-cp2-a2a-vpp2-ep2-ddp-overlap-full]":
        ("pp-interleaved", "cp-a2a", "moe", "ep", "moe-alltoall", "overlap-grad-reduce", "te",
         "recompute-full"),
    f"{PAIRS_TEST}[moe-zb-account-ep2-allgather-distopt]":
        ("pp-zero-bubble", "pp-account", "moe", "ep", "moe-allgather", "distopt",
         "overlap-grad-reduce", "overlap-param-gather"),
    f"{PAIRS_TEST}[moe-cp2-pp2-uneven-selective-fused]":
        ("pp-1f1b", "pp-uneven", "cp-p2p", "moe", "moe-alltoall", "recompute-selective",
         "fused-loss"),
    f"{PAIRS_TEST}[fsdp2-tp2-overlap-full-fused]":
        ("tp", "sp", "overlap-grad-reduce", "fsdp2", "recompute-full", "fused-loss"),
    f"{PAIRS_TEST}[moe-fsdp2-cp2-a2a-pp2-uneven-etp2-allgather]":
        ("pp-1f1b", "pp-uneven", "cp-a2a", "moe", "expert-tp", "moe-allgather", "fsdp2"),
    f"{PAIRS_TEST}[moe-fsdp2-hsdp-zb-account-attn]":
        ("pp-zero-bubble", "pp-account", "moe", "moe-alltoall", "fsdp2", "hsdp",
         "recompute-selective"),
    f"{PAIRS_TEST}[hsdp-te-fp8-tp2-distopt-fused]":
        ("tp", "sp", "distopt", "overlap-grad-reduce", "overlap-param-gather", "hsdp", "te",
         "fp8", "fused-loss"),
    f"{PAIRS_TEST}[moe-hsdp-cp2-a2a-ep2-allgather-distopt-full]":
        ("cp-a2a", "moe", "ep", "moe-allgather", "distopt", "overlap-grad-reduce",
         "overlap-param-gather", "hsdp", "recompute-full"),
    f"{PAIRS_TEST}[moe-hsdp-cp2-etp2-distopt]":
        ("cp-p2p", "moe", "expert-tp", "moe-alltoall", "distopt", "overlap-grad-reduce",
         "overlap-param-gather", "hsdp"),
    f"{PAIRS_TEST}[hsdp-fsdp2-vpp2]":
        ("pp-interleaved", "fsdp2", "hsdp"),
    f"{PAIRS_TEST}[hsdp-pp2-uneven-distopt-full]":
        ("pp-1f1b", "pp-uneven", "distopt", "overlap-grad-reduce", "overlap-param-gather",
         "hsdp", "recompute-full"),
    f"{PAIRS_TEST}[te-fp8-tp2-pp2-account-distopt-fused-compile]":
        ("tp", "sp", "pp-1f1b", "pp-account", "distopt", "overlap-grad-reduce",
         "overlap-param-gather", "te", "fp8", "compile", "fused-loss"),
    f"{PAIRS_TEST}[fsdp2-hsdp-overlap-selective-fused-compile]":
        ("overlap-grad-reduce", "fsdp2", "hsdp", "recompute-selective", "compile", "fused-loss"),
    f"{PAIRS_TEST}[cp2-zb-uneven-full-compile]":
        ("pp-zero-bubble", "pp-uneven", "cp-p2p", "recompute-full", "compile"),
    f"{PAIRS_TEST}[te-fp8-cp2-a2a-pp2-fused]":
        ("pp-1f1b", "cp-a2a", "te", "fp8", "fused-loss"),
    f"{PAIRS_TEST}[te-fp8-vpp2-compile]": ("pp-interleaved", "te", "fp8", "compile"),
    # DualPipeV with every feature the table lets it combine with
    f"{_DV}[pp4-full-distopt]": ("pp-dualpipev", "recompute-full", "distopt",
                                 "overlap-grad-reduce", "overlap-param-gather"),
    f"{_DV}[tp2-pp2-account-fused-selective]": ("pp-dualpipev", "tp", "sp", "pp-account",
                                                "fused-loss", "recompute-selective"),
    f"{_DV}[moe-ep2-pp2-ddp-overlap-attn]": ("pp-dualpipev", "moe", "ep", "moe-alltoall",
                                             "overlap-grad-reduce", "recompute-selective"),
    f"{_DV}[moe-cp2-a2a-pp2-etp2-allgather-fsdp2]": ("pp-dualpipev", "moe", "cp-a2a",
                                                     "expert-tp", "moe-allgather", "fsdp2"),
    f"{_DV}[fsdp2-hsdp-pp2-full-compile-tied]": ("pp-dualpipev", "fsdp2", "hsdp",
                                                 "recompute-full", "compile"),
    f"{_DV}[cp2-pp2-full-tied]": ("pp-dualpipev", "cp-p2p", "recompute-full"),
}
# ZB-V runs DualPipeV's configurations with the schedule swapped (the same V placement and
# B / W split; tests/distributed/test_zbv_dist.py derives its cases the same way)
_ZBV = "tests/distributed/test_zbv_dist.py::test_zbv_matches_single_process"
COVERAGE.update({_ZBV + test_id[len(_DV):]: tuple("pp-zbv" if f == "pp-dualpipev" else f
                                                   for f in names)
                 for test_id, names in list(COVERAGE.items()) if test_id.startswith(_DV + "[")})


def covering_tests(a: str, b: str) -> List[str]:
    """The equivalence tests that run features ``a`` and ``b`` together."""
    return [t for t, feats in COVERAGE.items() if a in feats and b in feats]
