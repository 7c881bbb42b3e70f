"""Checks on a ``MegaliteConfig`` that must pass before any process group is created.

Every message names the flag(s) at fault and the fix, on one line.  Which features and values
combine is the rule engine's (``megalite/cli/features.py``), read here; what stays here are
the checks of one topic each (sizes against the world, the pipeline split, batch sizes,
files).  The planner reuses ``validate_layout`` to enumerate only legal layouts.  Validation
never changes the config it checks (``with_default_global_batch`` is applied by
``parse_args``, where the config is built).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

from megalite.cli import features
from megalite.config import ConfigError, MegaliteConfig
from megalite.config.domains import check_domains
from megalite.config.microbatches import (parse_step_schedule, rampup_problem,
                                          step_schedule_batch_problem)
from megalite.config.pipeline_schedules import resolve_schedule

_REQUIRED_MODEL = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                   ("num_attention_heads", "--num-attention-heads"),
                   ("seq_length", "--seq-length"))


def validate_layout(cfg: MegaliteConfig) -> None:
    """Parallel sizes against the world size and the model shape (no files, no I/O).

    One check per topic, in this order (the first fault found is the one reported)."""
    for check in (check_world_size, check_required_model, check_rank_grids,
                  check_layout_features, check_virtual_stages, check_stage_split,
                  check_attention_shape, check_latent_attention,
                  check_batch_sizes, check_sequence, check_experts):
        check(cfg)


def check_layout_features(cfg: MegaliteConfig) -> None:
    """The feature table's rules between layout features (how the model is cut: TP, SP,
    pipeline schedules and splits, CP, EP, MoE, recompute) -- what the planner may emit."""
    problem = features.refusal(cfg, dry_run=True, layout_only=True)
    if problem:
        raise ConfigError(problem)


def check_features(cfg: MegaliteConfig) -> None:
    """Every rule of the feature table (``megalite/cli/features.py``); a --dry-run describes a
    layout, so rules about hardware and kernels (TE, FP8, CP's missing dropout) wait for
    the run.  A run's ``--transformer-impl auto`` is resolved first: TE's rules hold for it."""
    dry, environment = cfg.training.dry_run, features.flags_environment
    if not dry:
        # start-up time: backend selection imports torch; the planner reads validation
        from megalite.backends.selection import fp8_environment, resolve_backend_config

        cfg, environment = resolve_backend_config(cfg), fp8_environment
    problem = features.refusal(cfg, dry_run=dry, environment=environment)
    if problem:
        raise ConfigError(problem)


def check_world_size(cfg: MegaliteConfig) -> None:
    """The world size is not a flag (torchrun/SLURM or --world-size), so no field domain."""
    if cfg.world_size <= 0:
        raise ConfigError(f"world size must be a positive integer, got {cfg.world_size}")


def check_required_model(cfg: MegaliteConfig) -> None:
    for attr, flag in _REQUIRED_MODEL:
        if getattr(cfg.model, attr) is None:
            raise ConfigError(f"{flag} is required")


def check_rank_grids(cfg: MegaliteConfig) -> None:
    """Both grids (dense TP x CP x DP x PP and expert ETP x EP x EDP x PP) tile the world."""
    p, world, dims = cfg.parallel, cfg.world_size, cfg.parallel_dims
    model_parallel = dims.dense_model_ranks      # the sizes' products live in ParallelDims
    if world % model_parallel:
        raise ConfigError(
            f"world size {world} is not divisible by --tensor-model-parallel-size ({p.tp}) x "
            f"--pipeline-model-parallel-size ({p.pp}) x --context-parallel-size ({p.cp}) = "
            f"{model_parallel}; change the sizes or launch a multiple of {model_parallel} processes")
    expert_grid = dims.expert_model_ranks
    if world % expert_grid:
        raise ConfigError(
            f"world size {world} is not divisible by --expert-tensor-parallel-size ({p.etp}) x "
            f"--expert-model-parallel-size ({p.ep}) x --pipeline-model-parallel-size ({p.pp}) = "
            f"{expert_grid}; pick expert sizes whose product with PP divides the world")


def _interleaved(p) -> bool:
    return bool(p.num_layers_per_virtual_pipeline_stage or p.num_virtual_stages_per_pipeline_rank)


def _accounts(p) -> bool:
    return p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split


def _uneven(p) -> bool:
    return p.decoder_first_pipeline_num_layers is not None or \
        p.decoder_last_pipeline_num_layers is not None


def check_virtual_stages(cfg: MegaliteConfig) -> None:
    """The VPP flags, and the schedule they allow."""
    p, m = cfg.parallel, cfg.model
    if p.num_layers_per_virtual_pipeline_stage and p.num_virtual_stages_per_pipeline_rank:
        raise ConfigError("give only one of --num-layers-per-virtual-pipeline-stage and "
                          "--num-virtual-stages-per-pipeline-rank")
    interleaved = _interleaved(p)
    if interleaved and p.pp == 1:
        raise ConfigError("virtual pipeline stages need --pipeline-model-parallel-size > 1; "
                          "drop the virtual-stage flag or raise PP")
    per_virtual = p.num_layers_per_virtual_pipeline_stage
    if per_virtual and not _accounts(p) and m.num_layers % (p.pp * per_virtual):
        raise ConfigError(
            f"--num-layers ({m.num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({p.pp}) x --num-layers-per-virtual-pipeline-stage ({per_virtual})")


def check_stage_split(cfg: MegaliteConfig) -> None:
    """The layers split over PP x VPP: evenly, unevenly (first/last) or counting the
    embedding / loss as layers."""
    p, num_layers = cfg.parallel, cfg.model.num_layers
    vpp = p.virtual_stages(num_layers)
    if _accounts(p):
        _check_account_split(p, num_layers, vpp)
    elif _uneven(p):
        _check_uneven_split(p, num_layers)
    elif num_layers % (p.pp * vpp):
        raise ConfigError(
            f"--num-layers ({num_layers}) is not divisible by --pipeline-model-parallel-size "
            f"({p.pp}) x virtual stages ({vpp}); change the layer count or give an uneven split "
            "with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")


def _check_uneven_split(p, num_layers: int) -> None:
    """--decoder-first/last-pipeline-num-layers: the rest splits evenly over the middle."""
    if p.pp == 1:
        raise ConfigError("--decoder-first/last-pipeline-num-layers need "
                          "--pipeline-model-parallel-size > 1")
    first = p.decoder_first_pipeline_num_layers or 0
    last = p.decoder_last_pipeline_num_layers or 0
    middle_stages = p.pp - (p.decoder_first_pipeline_num_layers is not None) - \
        (p.decoder_last_pipeline_num_layers is not None)
    rest = num_layers - first - last
    if rest < 0 or (middle_stages == 0 and rest) or (middle_stages and rest % middle_stages):
        raise ConfigError(
            f"--num-layers ({num_layers}) minus --decoder-first/last-pipeline-num-layers "
            f"({first}+{last}) must split evenly over the other {middle_stages} stages")


def _check_account_split(p, num_layers: int, vpp: int) -> None:
    """Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding and/or the
    loss count as pipeline layers, so L' = layers (+1) (+1) splits evenly over PP x VPP and
    the first / last virtual stage holds one transformer layer fewer -- none at one layer
    per virtual stage (Llama 3's embedding-only first and loss-only last chunk)."""
    on = [f for f, v in (("--account-for-embedding-in-pipeline-split",
                          p.account_for_embedding_in_pipeline_split),
                         ("--account-for-loss-in-pipeline-split",
                          p.account_for_loss_in_pipeline_split)) if v]
    flags = " and ".join(on)
    if p.pp == 1:
        raise ConfigError(f"{flags} need{'' if len(on) > 1 else 's'} "
                          "--pipeline-model-parallel-size > 1")
    slots = p.pipeline_slots(num_layers)
    per_virtual = p.num_layers_per_virtual_pipeline_stage
    if slots % (p.pp * vpp) or (per_virtual and slots % (p.pp * per_virtual)):
        by = f"--num-layers-per-virtual-pipeline-stage ({per_virtual})" if per_virtual else \
            f"virtual stages ({vpp})"
        raise ConfigError(
            f"with {flags}, --num-layers ({num_layers}) + {slots - num_layers} = {slots} "
            f"pipeline layers are not divisible by --pipeline-model-parallel-size ({p.pp}) x "
            f"{by}; change the layer count, PP or VPP")


def check_attention_shape(cfg: MegaliteConfig) -> None:
    """Heads and query groups split over TP; the head dimension suits the position encoding."""
    m = cfg.model
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size ({m.hidden_size}) is not divisible by "
                          f"--num-attention-heads ({m.num_attention_heads}); set --kv-channels or "
                          "change one of them")
    if m.group_query_attention:
        if not m.num_query_groups:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        if m.num_attention_heads % m.num_query_groups:
            raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) is not divisible "
                              f"by --num-query-groups ({m.num_query_groups})")
    if m.uses_rotary() and m.resolved_kv_channels() % 2:
        raise ConfigError("rotary embeddings need an even head dimension (--kv-channels)")


def check_latent_attention(cfg: MegaliteConfig) -> None:
    """Multi-Latent Attention: the position encoding and head layout it implies (the ranges
    of its flags are their domains)."""
    m = cfg.model
    if not m.multi_latent_attention:
        return
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim ({m.qk_pos_emb_head_dim}) must be even "
                          "(RoPE rotates pairs)")


def default_global_batch(cfg: MegaliteConfig) -> int:
    """--global-batch-size; when absent, the step schedule's last batch, else micro x DP
    (Megatron's default)."""
    t = cfg.training
    if t.global_batch_size:
        return t.global_batch_size
    if t.step_batch_size_schedule:      # a step schedule ends at its last batch
        return parse_step_schedule(t.step_batch_size_schedule, None)[-1][1]
    return t.micro_batch_size * cfg.data_parallel_size


def with_default_global_batch(cfg: MegaliteConfig) -> MegaliteConfig:
    """``cfg`` with an absent --global-batch-size filled in at its world size (a copy;
    validation itself never changes the config it checks)."""
    if cfg.training.global_batch_size is not None:
        return cfg
    return dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, global_batch_size=default_global_batch(cfg)))


def check_batch_sizes(cfg: MegaliteConfig) -> None:
    """The global batch splits into whole micro-batches per DP rank (and, interleaved, into
    a multiple of PP of them).  An absent --global-batch-size means micro x DP, Megatron's
    default (``with_default_global_batch`` fills it in where the config is built)."""
    p, t, dp = cfg.parallel, cfg.training, cfg.data_parallel_size
    steps = step_schedule_batch_problem(t.step_batch_size_schedule, cfg.model.seq_length,
                                        t.global_batch_size, t.micro_batch_size, dp)
    if steps:
        raise ConfigError(steps)
    gbs = default_global_batch(cfg)
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size ({gbs}) is not divisible by --micro-batch-size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}); make it a multiple of "
            f"{t.micro_batch_size * dp}")
    problem = rampup_problem(t.rampup_batch_size, gbs, t.micro_batch_size, dp)
    if problem:
        raise ConfigError(problem)
    sizes = [gbs]
    if t.rampup_batch_size:      # every batch of the ramp (START, START+INCREMENT, ...)
        start, increment = int(t.rampup_batch_size[0]), int(t.rampup_batch_size[1])
        sizes = range(start, gbs + 1, increment)
    if t.step_batch_size_schedule:   # every batch of the schedule
        sizes = [b for _, b in parse_step_schedule(t.step_batch_size_schedule,
                                                   cfg.model.seq_length)]
    schedule = resolve_schedule(p.pipeline_schedule, p.virtual_stages(cfg.model.num_layers))
    for size in sizes:
        num_micro = size // (t.micro_batch_size * dp)
        fewest = schedule.min_micro_batches(p.pp)
        if p.pp > 1 and num_micro < fewest:
            raise ConfigError(
                f"--pipeline-schedule {schedule.name} needs at least {fewest} micro-batches "
                f"per step ({num_micro} = global batch {size} / (micro batch x DP)); raise "
                "--global-batch-size or lower --micro-batch-size")
        if p.virtual_stages(cfg.model.num_layers) > 1 and not p.pipeline_vshape and \
                num_micro % p.pp:
            raise ConfigError(
                f"the interleaved schedule needs the number of micro-batches ({num_micro} = "
                f"global batch {size} / (micro batch x DP)) to be a multiple of "
                f"--pipeline-model-parallel-size ({p.pp}); change --global-batch-size, "
                "--micro-batch-size or --rampup-batch-size / --step-batch-size-schedule")


def check_sequence(cfg: MegaliteConfig) -> None:
    """The sequence splits over CP (two chunks per rank) and, with SP, over TP.

    ``--sequence-parallel`` with TP = 1 is accepted and has no effect (Megatron's rule); the
    flag is left as given and ``ParallelConfig.sequence_parallel_active`` says so."""
    m = cfg.model
    if m.max_position_embeddings is not None and m.position_embedding_type == "learned_absolute" \
            and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"--max-position-embeddings ({m.max_position_embeddings}) is smaller "
                          f"than --seq-length ({m.seq_length})")


def check_experts(cfg: MegaliteConfig) -> None:
    p, m = cfg.parallel, cfg.model
    if m.num_experts:
        if m.num_experts % p.ep:
            raise ConfigError(f"--num-experts ({m.num_experts}) is not divisible by "
                              f"--expert-model-parallel-size ({p.ep})")
        groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
        if groups is not None and (m.num_experts % groups or m.moe_router_topk % group_topk):
            raise ConfigError(f"--moe-router-num-groups ({groups}) must divide --num-experts "
                              f"({m.num_experts}), and --moe-router-group-topk ({group_topk}) "
                              f"must divide --moe-router-topk ({m.moe_router_topk})")
        if m.moe_shared_expert_intermediate_size is not None and \
                m.moe_shared_expert_intermediate_size % p.tp:
            raise ConfigError("--moe-shared-expert-intermediate-size must be divisible by "
                              "--tensor-model-parallel-size")
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        if ffn is not None and ffn % p.etp:
            raise ConfigError(f"the expert hidden size ({ffn}) is not divisible by "
                              f"--expert-tensor-parallel-size ({p.etp})")


def validate_files(cfg: MegaliteConfig) -> None:
    """Data and tokenizer files exist (skipped by the planner)."""
    d = cfg.data
    if d.tokenizer_type in ("SentencePieceTokenizer", "CharacterTokenizer", "Llama2Tokenizer",
                            "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                            "TikTokenizer", "Llama3Tokenizer"):
        if not d.tokenizer_model:
            raise ConfigError(f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model FILE")
    if d.tokenizer_type == "GPT2BPETokenizer":
        for value, flag in ((d.vocab_file, "--vocab-file"), (d.merge_file, "--merge-file")):
            if not value:
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} FILE")
    if d.tokenizer_type == "NullTokenizer" and cfg.model.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    per_split = d.per_split_data_path()
    if d.mock_data:
        if cfg.model.vocab_size is None and d.tokenizer_type is None:
            raise ConfigError("--mock-data needs --vocab-size (or a --tokenizer-type)")
        return
    if not d.data_path and not per_split:
        if cfg.training.dry_run:   # a layout check (recipes): given files are still checked
            return
        raise ConfigError("--data-path is required (or use --mock-data)")
    if d.tokenizer_type is None:
        given = "--data-path" if d.data_path else "--train/valid/test-data-path"
        raise ConfigError(f"--tokenizer-type is required with {given}")
    t = cfg.training
    if per_split and not d.train_data_path and not (t.skip_train or t.dry_run):
        raise ConfigError("training with per-split data needs --train-data-path (or "
                          "--skip-train to only evaluate)")


def validate_training(cfg: MegaliteConfig) -> None:
    o, t = cfg.optimizer, cfg.training
    check_megatron_compat(cfg)
    if not t.skip_train and not t.dry_run:
        if t.train_iters is None and t.train_samples is None:
            raise ConfigError("give --train-iters or --train-samples")
        if t.train_iters is not None and t.train_samples is not None:
            raise ConfigError("give only one of --train-iters and --train-samples")
        if o.lr is None:
            raise ConfigError("--lr is required")
    if not t.dry_run:  # what this machine cannot run: refuse, never ignore
        # start-up time: backend selection imports torch; the planner reads validation
        from megalite.backends.selection import backend_refusal

        refusal = backend_refusal(cfg)   # TE missing / no CUDA / no FP8 on this GPU
        if refusal:
            raise ConfigError(refusal)


def check_megatron_compat(cfg: MegaliteConfig) -> None:
    """Megatron flags that parse (a script runs --dry-run unchanged) but whose feature has not
    landed: refused when the run would start, one line each, never ignored."""
    m = cfg.model
    if m.rotary_percent != 1.0 and m.multi_latent_attention:
        raise ConfigError(f"--rotary-percent {m.rotary_percent} with --multi-latent-attention: "
                          "MLA rotates its whole --qk-pos-emb-head-dim part; drop "
                          "--rotary-percent")


def missing_logging_packages(cfg: MegaliteConfig) -> list:
    """One line per optional package a logging flag needs that is not installed."""

    lg, out = cfg.logging, []
    if lg.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        out.append("--tensorboard-dir needs the tensorboard package: "
                   "pip install 'megalite[tensorboard]'")
    if lg.wandb_project and importlib.util.find_spec("wandb") is None:
        out.append("--wandb-project needs the wandb package: pip install 'megalite[wandb]'")
    if lg.loss_plot and importlib.util.find_spec("matplotlib") is None:
        out.append("--loss-plot needs matplotlib: pip install 'megalite[plot]'")
    return out


def validate_logging(cfg: MegaliteConfig) -> None:
    """Optional packages asked for by a flag must be installed (checked without importing);
    ``--dry-run`` (often on a login node) prints them as notes instead."""
    missing = missing_logging_packages(cfg)
    if missing and not cfg.training.dry_run:
        raise ConfigError(missing[0])


def check_resume_schedule(cfg: MegaliteConfig) -> None:
    """Resuming with other schedule flags than the checkpoint's is refused unless the user
    says which schedule wins (checkpointing/resume_schedule.py)."""
    c = cfg.checkpoint
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        raise ConfigError("give only one of --override-opt_param-scheduler and "
                          "--use-checkpoint-opt_param-scheduler")
    if not c.load:
        return
    # start-up time: the checkpoint readers import torch; only a run with --load needs them
    from megalite.checkpointing.checkpoint_args import read_checkpoint_meta
    # start-up time: as above
    from megalite.checkpointing.resume_schedule import check_schedule_matches_checkpoint

    found = read_checkpoint_meta(c.load)
    if found is not None:
        # the schedule this run will follow: an absent --global-batch-size filled in
        check_schedule_matches_checkpoint(with_default_global_batch(cfg), found[1],
                                          os.path.dirname(os.path.dirname(found[0])))


def check_flags(cfg: MegaliteConfig) -> None:
    """Every field against the domain declared beside it, then every flag declared to need
    another (the feature table's ``REQUIREMENTS``): what one flag says, before the checks
    that read several."""
    check_domains(cfg)
    problem = features.requirement_refusal(cfg)
    if problem:
        raise ConfigError(problem)


def validate(cfg: MegaliteConfig) -> None:
    check_flags(cfg)
    if cfg.checkpoint.load:  # first: the model the flags describe is the checkpoint's
        # start-up time: the checkpoint readers import torch; only a run with --load needs them
        from megalite.checkpointing.checkpoint_args import check_model_matches_checkpoint

        check_model_matches_checkpoint(cfg)
    validate_layout(cfg)
    check_features(cfg)      # the feature table: what combines (megalite/cli/features.py)
    check_resume_schedule(cfg)
    validate_files(cfg)      # --dry-run too: files, tokenizer and split need no processes
    validate_training(cfg)
    validate_logging(cfg)

