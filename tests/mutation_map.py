"""Which tests target each module, for mutation sampling (tools/mutation_sample.py,
docs/testing.md "Mutation sampling").

A mutant of a module is run against that module's targeted tests only: the few test files
(or node ids) a developer runs after editing it, cheap enough that a sample of 30 mutants
over the modules a change touched runs in minutes on 2 cores.  A module with no entry is
reported as unmapped, not sampled: add its line when you change it.  Entries are paths
relative to the repository root; a file that does not exist (yet) is left out of the
command, so the same map measures an older tree too.

``SAMPLE``: the modules of the mutation sample of docs/testing.md (snapshot choice,
re-layout, hang diagnosis, feature rules, HF adapters, FSDP2 x PP, MoE expert bias, MTP,
the derived micro-batch count).
"""

_ELASTIC = ("tests/unit/test_elastic.py", "tests/unit/test_elastic_oracles.py")
_HANGS = ("tests/unit/test_flight_recorder.py", "tests/unit/test_hang_rankings.py",
          "tests/unit/test_hang_attribution.py")
_HF = ("tests/unit/test_hf_families.py", "tests/unit/test_hf_export_families.py",
       "tests/unit/test_hf_adapters.py")
_MOE = ("tests/unit/test_moe.py", "tests/unit/test_moe_oracles.py")

MAP = {
    "megalite/elastic/snapshot_restore.py": _ELASTIC,
    "megalite/elastic/resume.py": _ELASTIC,
    "megalite/elastic/relayout.py": _ELASTIC,
    "megalite/cli/elastic_fit.py": _ELASTIC + ("tests/unit/test_derived_config.py",),
    "megalite/diagnostics/hang_diagnosis.py": _HANGS,
    "megalite/diagnostics/hang_folder.py": _HANGS,
    "megalite/cli/features.py": ("tests/unit/test_feature_table.py",
                                 "tests/unit/test_structure_oracles.py"),
    "megalite/checkpointing/hf_adapters/llama.py": _HF + (
        "tests/unit/test_fp16_rampup_layernorm1p.py",),     # --apply-layernorm-1p export
    "megalite/checkpointing/hf_adapters/qwen3.py": _HF,
    "megalite/checkpointing/hf_adapters/qwen2.py": _HF,
    "megalite/checkpointing/hf_adapters/qwen_moe.py": _HF,
    "megalite/checkpointing/hf_adapters/mixtral.py": _HF + ("tests/unit/test_mixtral_hf.py",),
    "megalite/checkpointing/hf_adapters/deepseek_v3.py": (
        "tests/unit/test_mla_mtp.py", "tests/unit/test_hf_export_families.py",
        "tests/unit/test_deepseek_v3_configs.py"),
    "megalite/checkpointing/hf_adapters/phi3.py": _HF,
    "megalite/checkpointing/hf_adapters/smollm3.py": _HF,
    "megalite/checkpointing/hf_adapters/olmo2.py": _HF,
    "megalite/transformer/projection_norm.py": (
        "tests/unit/test_hf_families.py", "tests/distributed/test_hf_families_dist.py"),
    "megalite/checkpointing/hf_files.py": (
        "tests/e2e/test_user_paths_e2e.py::test_exported_folder_alone_tokenizes_loads_and_generates",),
    "megalite/pipeline_parallel/fsdp_sync.py": ("tests/distributed/test_fsdp_sync_dist.py",),
    "megalite/moe/router.py": _MOE + ("tests/unit/test_moe_variants.py",),
    "megalite/moe/moe_layer.py": _MOE,
    "megalite/moe/metrics.py": _MOE,
    "megalite/transformer/mtp.py": ("tests/unit/test_mla_mtp.py",),
    "megalite/config/__init__.py": ("tests/unit/test_derived_config.py",
                                    "tests/unit/test_elastic.py"),
    "megalite/config/microbatches.py": ("tests/unit/test_derived_config.py",
                                        "tests/unit/test_fp16_rampup_layernorm1p.py",
                                        "tests/unit/test_step_batch_schedule.py"),
    "megalite/training/dry_run.py": ("tests/unit/test_derived_config.py",),
    # the structure issue's new homes: the loss policy, the layout, the rule engine's reader,
    # the activation registry
    "megalite/transformer/loss_reduction.py": ("tests/unit/test_loss_reduction.py",
                                               "tests/unit/test_structure_oracles.py",
                                               "tests/distributed/test_loss_reduction_dist.py"),
    "megalite/config/parallel_dims.py": ("tests/unit/test_parallel_state.py",
                                         "tests/unit/test_derived_config.py",
                                         "tests/unit/test_structure_oracles.py"),
    "megalite/cli/validation.py": ("tests/unit/test_validation.py",
                                   "tests/unit/test_feature_table.py",
                                   "tests/unit/test_structure_oracles.py"),
    "megalite/config/activations.py": ("tests/unit/test_activations.py",
                                            "tests/unit/test_arguments.py",
                                            "tests/unit/test_structure_oracles.py",
                                            "tests/unit/test_pipeline_activation_memory.py"),
    # Gemma 2/3
    "megalite/checkpointing/hf_adapters/gemma.py": _HF + ("tests/unit/test_models_page.py",),
}

# The sample's modules, and in each the functions holding the logic it measures (None:
# the whole module); mutants elsewhere (a log line's sleep, a message) are not drawn.
SAMPLE = {
    "megalite/elastic/snapshot_restore.py": ("choose", "transfer_plan", "intersect"),
    "megalite/elastic/resume.py": ("resume_source", "_newest_disk_iteration"),
    "megalite/cli/elastic_fit.py": ("fit_world", "describe", "fits"),
    "megalite/diagnostics/hang_diagnosis.py": ("causes", "last_completed",
                                               "last_seen", "_stuck_lines", "mismatches",
                                               "deviations", "_left_before_killed"),
    "megalite/diagnostics/hang_folder.py": ("load_dumps", "load_fatal", "parse"),
    "megalite/cli/features.py": None,
    "megalite/checkpointing/hf_adapters/qwen3.py": None,
    "megalite/checkpointing/hf_adapters/llama.py": ("from_hf", "to_hf"),
    "megalite/pipeline_parallel/fsdp_sync.py": None,
    "megalite/moe/moe_layer.py": ("update_expert_bias",),
    "megalite/transformer/mtp.py": ("forward", "roll_left"),
    "megalite/config/__init__.py": ("num_micro_batches", "data_parallel_size"),
}
