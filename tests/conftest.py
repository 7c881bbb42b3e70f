"""Shared fixtures: ``dist`` runs a function on N gloo processes (reused across tests)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


_POOLS = []            # the session's PoolManager, once a test asked for it
_LAST_DIST_TEST = []   # the node id of the last collected test that uses ``dist``


@pytest.fixture(scope="session")
def dist():
    from megalite.testing import PoolManager

    manager = PoolManager()
    _POOLS.append(manager)
    yield manager
    manager.close()


def pytest_runtest_teardown(item, nextitem):
    """Close the gloo pools after the last test that uses them: idle workers keep their
    gloo threads polling (about a fifth of a core for a 4-rank pool), which the e2e and
    unit tests after them would pay for.  A later test asking again gets fresh pools."""
    if _POOLS and _LAST_DIST_TEST and item.nodeid == _LAST_DIST_TEST[0]:
        _POOLS[0].close()


# The long tier: runs that repeat at another scale what a faster test of the default run
# proves (the SLURM cluster scenarios, model families, recipe twins, the full reshard
# matrix; docs/testing.md names each one's counterpart), kept out of `bash launch/test.sh`
# so that CI stays under its 25 minutes.
# `MEGALITE_LONG_TESTS=1 bash launch/test.sh` runs everything (about 25 more minutes on 2
# idle cores).  Entries are node-id prefixes: a file, or one test (with or without its
# parameters).
_FAMILY = ("tests/e2e/test_hf_families_e2e.py::"
           "test_converted_family_gives_transformers_loss_at_tp1_tp2_ep2_and_exports_back")
_PAIRS = "tests/distributed/test_feature_pairs_dist.py::test_combination_matches_single_process"
LONG_TESTS = (
    "tests/e2e/test_slurm_citizen_e2e.py",      # exit status, ports, requeue, CPUs, logs, link
    "tests/e2e/test_slurm_elastic_e2e.py",      # lost nodes, spares, a node rejoining
    "tests/e2e/test_slurm_first_node_e2e.py",   # the first node lost, with the etcd rendezvous
    # sbatch on two nodes and its restart (the default run keeps megalite.elastic.launch's
    # restart and exit status, test_elastic_launch_e2e.py)
    "tests/e2e/test_slurm_e2e.py",
    "tests/e2e/test_faults_e2e.py::test_torchrun_restart_recovers_a_killed_rank",
    "tests/e2e/test_faults_e2e.py::test_hung_peer_is_an_error_naming_group_op_peer[tp]",
    # the run-time half of the skip hook (the default run keeps the SIGSTOP diagnosis and
    # the pre-launch mismatch of tests/unit/test_collective_check.py)
    "tests/e2e/test_hangs_e2e.py::test_a_skipped_pipeline_send_is_named_before_launch",
    # the rest of the hook's matrix (the default run keeps three representative cases)
    "tests/e2e/test_hang_matrix_e2e.py::test_more_layouts_name_the_cause",
    "tests/e2e/test_elastic_launch_e2e.py::test_misfit_world_trains_on_the_largest_fitting_part",
    # the etcd rendezvous with training and a snapshot resume (the default run keeps the
    # member loss and the restart through the others with a two-process worker)
    "tests/e2e/test_etcd_rendezvous_e2e.py::test_first_etcd_member_and_a_worker_die_training",
    # families: the default run keeps Llama and Mixtral through test_user_paths_e2e.py,
    # end to end; every family's import is checked in-process by
    # tests/unit/test_hf_families.py, its export by tests/unit/test_hf_export_families.py
    _FAMILY,
    # recipe twins (docs/launching.md runs run_local.sh with a twin)
    "tests/e2e/test_recipes_e2e.py::test_qwen3_moe_twin_with_run_local_matches_one_process",
    "tests/e2e/test_recipes_e2e.py::test_gpt3_twin_with_run_local_matches_one_process",
    "tests/e2e/test_recipes_e2e.py::test_deepseek_v3_twin_trains_with_its_extra_losses_logged",
    # DeepSeek-V3 through convert.py (tests/unit/test_mla_mtp.py keeps its import,
    # tests/unit/test_hf_export_families.py its export, tests/distributed/test_mla_mtp_dist.py
    # its MLA/MTP layouts)
    "tests/e2e/test_deepseek_v3_hf_e2e.py",
    # a sliding-window Qwen2 through convert.py (tests/unit/test_sliding_window.py keeps its
    # import and export against transformers, tests/distributed/test_document_mask_dist.py
    # the windows under CP)
    "tests/e2e/test_sliding_window_e2e.py",
    # pretrain_moe.py at EP2 (the default run keeps test_user_paths_e2e.py's EP2 Mixtral)
    "tests/e2e/test_pretrain_moe_e2e.py",
    # README rows also run by the docs commands and the distributed equivalence tests
    "tests/e2e/test_feature_rows_e2e.py::test_torchrun_layout_gives_single_process_losses"
    "[pp2_interleaved_recompute]",
    "tests/e2e/test_feature_rows_e2e.py::test_torchrun_layout_gives_single_process_losses"
    "[cp2_ring]",
    # the full reshard matrix (the default run keeps the layout-change resumes of
    # test_pretrain_e2e.py, test_checkpoint_args_e2e.py and test_sharded_state_dist.py)
    "tests/distributed/test_checkpoint_reshard_dist.py::test_reshard_matrix_continues_with_opt",
    # DualPipeV at PP 4 x EP 2 on 8 ranks (the default run keeps PP 4 and EP 2 on 4 ranks,
    # tests/distributed/test_dualpipe_dist.py::test_dualpipev_matches_single_process)
    "tests/distributed/test_dualpipe_dist.py::test_dualpipev_pp4_moe_ep2_on_8_ranks",
    # --compile pairs: the default run keeps two compile launches
    f"{_PAIRS}[cp2-zb-uneven-full-compile]",
    f"{_PAIRS}[fsdp2-hsdp-overlap-selective-fused-compile]",
    # Gemma 3's recipe twin (the default run keeps Gemma's pieces at TP2, CP2, PP2 x VPP2 and
    # FSDP2 in tests/distributed/test_hf_families_dist.py)
    "tests/e2e/test_recipes_e2e.py::test_gemma3_twin_with_run_local_matches_one_process",
    # gpt-oss's recipe twin (the default run keeps its layer at TP2+SP, CP2, EP2, PP2 in
    # tests/distributed/test_attention_sinks_dist.py and its dry run in test_recipes.py)
    "tests/e2e/test_recipes_e2e.py::test_gpt_oss_twin_with_run_local_matches_one_process",
    # Qwen3-Next's recipe twin on 4 processes (the default run keeps its convert.py +
    # pretrain_gpt.py path, tests/e2e/test_qwen3_next_e2e.py, and its PP2/EP2 losses,
    # tests/distributed/test_hf_families_dist.py)
    "tests/e2e/test_qwen3_next_e2e.py::test_qwen3_next_twin_with_run_local_matches_one_process",
    # Llama 4 and GLM-4.5 twins (the default run dry-runs them, tests/unit/test_recipes.py, and
    # holds their features to one process and to transformers in the distributed tests)
    "tests/e2e/test_recipes_e2e.py::test_llama4_and_glm45_twins_train_side_by_side",
    # gpt-oss's layer trained at TP2+SP, CP2 ring, CP2 a2a x TP2, EP2, PP2 (the default run
    # keeps the converted gpt-oss at TP2+SP, PP2 and EP2 against transformers,
    # tests/distributed/test_hf_families_dist.py, and the sinks' ring / all-to-all kernels
    # against the unfused one in tests/unit/test_attention_sinks.py, and the learned sinks
    # with the other attention variants at CP2 ring, CP2 a2a x TP2+SP and PP2 x VPP2 in
    # tests/distributed/test_document_mask_dist.py)
    "tests/distributed/test_attention_sinks_dist.py",
    # Gated DeltaNet at CP4, CP4 with documents, CP2 x TP2+SP, CP2 x PP2, PP2 x VPP2 (the
    # default run keeps the converted Qwen3-Next at CP2, TP2, PP2, EP2 against transformers in
    # tests/distributed/test_hf_families_dist.py, and the packed batch in
    # tests/unit/test_gated_delta_net.py)
    "tests/distributed/test_gated_delta_net_cp_dist.py",
    # (its planner CP-bytes check: the default run holds the planner's CP bytes at CP2 in
    # tests/distributed/test_hf_families_dist.py's Qwen3-Next test)
    # two more cases of the hook's matrix (the default run keeps the distributed optimizer's
    # all-gather at TP2 x DP2, the case that was misattributed, and the FSDP2 refusal)
    "tests/e2e/test_hang_matrix_e2e.py::test_the_cause_is_named_at_run_time_and_before_launch"
    "[loss-all-reduce-dp4]",
    "tests/e2e/test_hang_matrix_e2e.py::test_the_cause_is_named_at_run_time_and_before_launch"
    "[ep-all-to-all]",
    # fp16 + ramp-up + (1 + w) norms through pretrain_gpt.py (the default run keeps them in
    # tests/distributed/test_fp16_rampup_dist.py and tests/megatron_parity)
    "tests/e2e/test_megatron_flags_e2e.py::test_fp16_ramp_layernorm1p_log_metrics_and_resume",
    # the gpt-oss example's CPU twin (the default run keeps the example's dry run, in-process
    # and as a subprocess; the other examples' twins train)
    "tests/megatron_parity/test_megatron_scripts.py::test_cpu_twin_trains_a_few_iterations"
    "[gptoss_20b]",
    # the overlapped F&B (--overlap-moe-expert-parallel-comm) at PP 4 x EP 2 on 8 ranks (the
    # default run keeps MoE at EP 2 x PP 2 and dense PP 4 on 4 ranks,
    # tests/distributed/test_dualpipe_dist.py::test_overlapped_f_and_b_matches_single_process)
    "tests/distributed/test_dualpipe_dist.py::test_overlapped_f_and_b_pp4_moe_ep2_on_8_ranks",
    # Llama 3 8B FP8's twin (the default run keeps its FSDP twin, llama3_8b_fsdp_fp8, the
    # same script with one more flag, and its dry run)
    "tests/megatron_parity/test_megatron_scripts.py::test_cpu_twin_trains_a_few_iterations"
    "[llama3_8b_fp8]",
    # FSDP2 x TP2 x PP2 on 8 ranks (the default run keeps FSDP2 with each of them:
    # test_fsdp2_composes[pipeline] and [cp_ep], the feature pairs fsdp2-tp2-overlap-full-fused,
    # moe-fsdp2-cp2-a2a-pp2-uneven-etp2-allgather, hsdp-fsdp2-vpp2)
    "tests/distributed/test_fsdp2_compose_dist.py::test_fsdp2_composes[tp_pp]",
    # ZB-V with FSDP2 + HSDP + --compile (the default run keeps ZB-V's other five
    # configurations, FSDP2 among them, and DualPipeV's same case on the same V,
    # tests/distributed/test_dualpipe_dist.py::...[fsdp2-hsdp-pp2-full-compile-tied])
    "tests/distributed/test_zbv_dist.py::test_zbv_matches_single_process"
    "[fsdp2-hsdp-pp2-full-compile-tied]",
)


def pytest_collection_modifyitems(items):
    """Skip the long tier unless asked for (LONG_TESTS); note the last test using ``dist``."""
    users = [i.nodeid for i in items if "dist" in getattr(i, "fixturenames", ())]
    _LAST_DIST_TEST[:] = users[-1:]
    if os.environ.get("MEGALITE_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long tier: MEGALITE_LONG_TESTS=1 runs it (tests/conftest.py)")
    for item in items:
        if item.nodeid.startswith(LONG_TESTS):
            item.add_marker(skip)
