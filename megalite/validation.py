"""Checks on a ``MegaliteConfig`` that must pass before any process group is created.

Every message names the flag(s) at fault and the fix, on one line.  The planner reuses
``validate_layout`` to enumerate only legal layouts.
"""
from __future__ import annotations

import math
import os

from megalite.config import ConfigError, MegaliteConfig
from megalite.microbatches import rampup_problem

_REQUIRED_MODEL = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                   ("num_attention_heads", "--num-attention-heads"),
                   ("seq_length", "--seq-length"))


def validate_layout(cfg: MegaliteConfig) -> None:
    """Parallel sizes against the world size and the model shape (no files, no I/O).

    One check per topic, in this order (the first fault found is the one reported)."""
    for check in (check_positive_sizes, check_required_model, check_rank_grids,
                  check_virtual_stages, check_stage_split, check_attention_shape,
                  check_batch_sizes, check_sequence, check_experts):
        check(cfg)


def _positive(value, flag):
    if value is not None and value <= 0:
        raise ConfigError(f"{flag} must be a positive integer, got {value}")


def check_positive_sizes(cfg: MegaliteConfig) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.training
    for value, flag in ((p.tp, "--tensor-model-parallel-size"),
                        (p.pp, "--pipeline-model-parallel-size"),
                        (p.cp, "--context-parallel-size"),
                        (p.ep, "--expert-model-parallel-size"),
                        (p.expert_tensor_parallel_size, "--expert-tensor-parallel-size"),
                        (p.num_layers_per_virtual_pipeline_stage,
                         "--num-layers-per-virtual-pipeline-stage"),
                        (p.num_virtual_stages_per_pipeline_rank,
                         "--num-virtual-stages-per-pipeline-rank"),
                        (t.micro_batch_size, "--micro-batch-size"),
                        (t.global_batch_size, "--global-batch-size"),
                        (cfg.world_size, "world size"),
                        (m.num_layers, "--num-layers"), (m.hidden_size, "--hidden-size"),
                        (m.num_attention_heads, "--num-attention-heads"),
                        (m.num_query_groups, "--num-query-groups"),
                        (m.seq_length, "--seq-length"), (m.ffn_hidden_size, "--ffn-hidden-size"),
                        (m.kv_channels, "--kv-channels"), (m.num_experts, "--num-experts"),
                        (m.vocab_size, "--vocab-size"), (t.train_iters, "--train-iters"),
                        (m.make_vocab_size_divisible_by, "--make-vocab-size-divisible-by")):
        _positive(value, flag)


def check_required_model(cfg: MegaliteConfig) -> None:
    for attr, flag in _REQUIRED_MODEL:
        if getattr(cfg.model, attr) is None:
            raise ConfigError(f"{flag} is required")


def check_rank_grids(cfg: MegaliteConfig) -> None:
    """Both grids (dense TP x CP x DP x PP and expert ETP x EP x EDP x PP) tile the world."""
    p, world = cfg.parallel, cfg.world_size
    model_parallel = p.tp * p.pp * p.cp
    if world % model_parallel:
        raise ConfigError(
            f"world size {world} is not divisible by --tensor-model-parallel-size ({p.tp}) x "
            f"--pipeline-model-parallel-size ({p.pp}) x --context-parallel-size ({p.cp}) = "
            f"{model_parallel}; change the sizes or launch a multiple of {model_parallel} processes")
    expert_grid = p.etp * p.ep * p.pp
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
    if p.pipeline_schedule == "interleaved" and p.virtual_stages(m.num_layers) == 1:
        raise ConfigError("--pipeline-schedule interleaved needs "
                          "--num-virtual-stages-per-pipeline-rank > 1")
    if p.pipeline_schedule == "zero-bubble" and interleaved:
        raise ConfigError("--pipeline-schedule zero-bubble does not combine with virtual stages; "
                          "drop --num-virtual-stages-per-pipeline-rank")


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
    if _interleaved(p):
        raise ConfigError("--decoder-first/last-pipeline-num-layers do not combine with "
                          "virtual pipeline stages")
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
    flags, verb = " and ".join(on), ("do" if len(on) > 1 else "does")
    if _uneven(p):
        raise ConfigError(f"{flags} {verb} not combine with --decoder-first/last-pipeline-num-"
                          "layers; balance the first and last stages one way or the other")
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
    p, m = cfg.parallel, cfg.model
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size ({m.hidden_size}) is not divisible by "
                          f"--num-attention-heads ({m.num_attention_heads}); set --kv-channels or "
                          "change one of them")
    if m.num_attention_heads % p.tp:
        raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
                          f"--tensor-model-parallel-size ({p.tp})")
    if m.group_query_attention:
        if not m.num_query_groups:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        if m.num_attention_heads % m.num_query_groups:
            raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) is not divisible "
                              f"by --num-query-groups ({m.num_query_groups})")
        if m.num_query_groups % p.tp:
            raise ConfigError(f"--num-query-groups ({m.num_query_groups}) is not divisible by "
                              f"--tensor-model-parallel-size ({p.tp}); use a TP that divides it")
    if m.position_embedding_type == "rope" and m.resolved_kv_channels() % 2:
        raise ConfigError("rotary embeddings need an even head dimension (--kv-channels)")


def check_batch_sizes(cfg: MegaliteConfig) -> None:
    """The global batch splits into whole micro-batches per DP rank (and, interleaved, into
    a multiple of PP of them).  An absent --global-batch-size is filled in as micro x DP,
    Megatron's default."""
    p, t, dp = cfg.parallel, cfg.training, cfg.data_parallel_size
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size ({t.global_batch_size}) is not divisible by --micro-batch-size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}); make it a multiple of "
            f"{t.micro_batch_size * dp}")
    problem = rampup_problem(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size, dp)
    if problem:
        raise ConfigError(problem)
    sizes = [t.global_batch_size]
    if t.rampup_batch_size:      # every batch of the ramp (START, START+INCREMENT, ...)
        start, increment = int(t.rampup_batch_size[0]), int(t.rampup_batch_size[1])
        sizes = range(start, t.global_batch_size + 1, increment)
    for size in sizes:
        num_micro = size // (t.micro_batch_size * dp)
        if p.virtual_stages(cfg.model.num_layers) > 1 and num_micro % p.pp:
            raise ConfigError(
                f"the interleaved schedule needs the number of micro-batches ({num_micro} = "
                f"global batch {size} / (micro batch x DP)) to be a multiple of "
                f"--pipeline-model-parallel-size ({p.pp}); change --global-batch-size, "
                "--micro-batch-size or --rampup-batch-size")


def check_sequence(cfg: MegaliteConfig) -> None:
    """The sequence splits over CP (two chunks per rank) and, with SP, over TP.

    ``--sequence-parallel`` with TP = 1 is accepted and has no effect (Megatron's rule); the
    flag is left as given and ``ParallelConfig.sequence_parallel_active`` says so."""
    p, m = cfg.parallel, cfg.model
    if p.cp > 1 and m.seq_length % (2 * p.cp):
        raise ConfigError(f"--seq-length ({m.seq_length}) must be divisible by 2 x "
                          f"--context-parallel-size ({2 * p.cp}) for load-balanced CP")
    if p.sequence_parallel_active and (m.seq_length // p.cp) % p.tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length ({m.seq_length}) / CP to be "
                          f"divisible by --tensor-model-parallel-size ({p.tp})")
    if p.cp > 1 and p.cp_comm_type == "a2a":
        heads, groups = m.num_attention_heads, m.resolved_query_groups()
        if heads % (p.tp * p.cp) or groups % (p.tp * p.cp):
            raise ConfigError(f"--cp-comm-type a2a scatters heads over CP: --num-attention-heads "
                              f"({heads}) and query groups ({groups}) must be divisible by TP x "
                              f"CP ({p.tp * p.cp}); use --cp-comm-type p2p or another CP")
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
        if m.moe_router_topk > m.num_experts:
            raise ConfigError(f"--moe-router-topk ({m.moe_router_topk}) exceeds --num-experts")
        if p.tp > 1 and not p.sequence_parallel:
            raise ConfigError("--num-experts with --tensor-model-parallel-size > 1 needs "
                              "--sequence-parallel (each token must live on one rank for the "
                              "expert dispatch, as in Megatron)")
        groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ConfigError("group-limited routing needs both --moe-router-num-groups and "
                              "--moe-router-group-topk")
        if groups is not None and (m.num_experts % groups or not 0 < group_topk <= groups
                                   or m.moe_router_topk % group_topk):
            raise ConfigError(f"--moe-router-num-groups ({groups}) must divide --num-experts "
                              f"({m.num_experts}), and --moe-router-group-topk ({group_topk}) "
                              f"must be at most the groups and divide --moe-router-topk "
                              f"({m.moe_router_topk})")
        if m.moe_shared_expert_intermediate_size is not None and \
                m.moe_shared_expert_intermediate_size % p.tp:
            raise ConfigError("--moe-shared-expert-intermediate-size must be divisible by "
                              "--tensor-model-parallel-size")
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        if ffn is not None and ffn % p.etp:
            raise ConfigError(f"the expert hidden size ({ffn}) is not divisible by "
                              f"--expert-tensor-parallel-size ({p.etp})")
    elif p.ep > 1:
        raise ConfigError("--expert-model-parallel-size > 1 needs --num-experts")


def validate_files(cfg: MegaliteConfig) -> None:
    """Data and tokenizer files exist (skipped by the planner)."""
    d = cfg.data
    if d.tokenizer_type in ("SentencePieceTokenizer", "CharacterTokenizer", "Llama2Tokenizer",
                            "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                            "TikTokenizer", "Llama3Tokenizer"):
        if not d.tokenizer_model:
            raise ConfigError(f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model FILE")
        if not os.path.exists(d.tokenizer_model):
            raise ConfigError(f"--tokenizer-model: '{d.tokenizer_model}' does not exist")
    if d.tokenizer_type == "GPT2BPETokenizer":
        for value, flag in ((d.vocab_file, "--vocab-file"), (d.merge_file, "--merge-file")):
            if not value:
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} FILE")
            if not os.path.isfile(value):
                raise ConfigError(f"{flag}: file '{value}' does not exist")
    from megalite.data.megatron_indices import parse_split_numbers
    try:
        parse_split_numbers(d.split)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if d.tokenizer_type == "TikTokenizer" and d.tiktoken_num_special_tokens < 3:
        raise ConfigError("--tiktoken-num-special-tokens must be >= 3 (<unk> <s> </s>)")
    if d.tokenizer_type == "NullTokenizer" and cfg.model.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    if cfg.training.skip_train and not cfg.checkpoint.load:
        raise ConfigError("--skip-train evaluates a loaded checkpoint: give --load DIR")
    if d.mock_data:
        if d.sample_windows != "packed":
            raise ConfigError("--sample-windows random cuts windows from --data-path; mock data is "
                              "random already: drop --sample-windows or --mock-data")
        if cfg.model.vocab_size is None and d.tokenizer_type is None:
            raise ConfigError("--mock-data needs --vocab-size (or a --tokenizer-type)")
        return
    if not d.data_path:
        if cfg.training.dry_run:   # a layout check (recipes): given files are still checked
            return
        raise ConfigError("--data-path is required (or use --mock-data)")
    if d.tokenizer_type is None:
        raise ConfigError("--tokenizer-type is required with --data-path")
    for prefix in d.data_path:
        try:
            weight = float(prefix)
        except ValueError:
            weight = None
        if weight is not None:  # a blending weight
            if not (math.isfinite(weight) and weight >= 0):
                raise ConfigError(f"--data-path weight {prefix!r} must be a finite, "
                                  f"non-negative number")
            continue
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError(f"--data-path: '{prefix}{ext}' does not exist; run "
                                  "tools/preprocess_data.py to create it")


def validate_training(cfg: MegaliteConfig) -> None:
    o, t = cfg.optimizer, cfg.training
    if o.precision and (o.fp16 or (o.bf16 and o.precision != "bf16")):
        other = "--fp16" if o.fp16 else "--bf16"
        raise ConfigError(f"--precision {o.precision} conflicts with {other}; give only one "
                          f"(--precision {o.precision} alone, or {other} alone)")
    if o.fp16 and o.bf16:
        raise ConfigError("give only one of --fp16 and --bf16")
    check_loss_scaler(o)
    check_megatron_compat(cfg)
    if not t.skip_train and not t.dry_run:
        if t.train_iters is None and t.train_samples is None:
            raise ConfigError("give --train-iters or --train-samples")
        if t.train_iters is not None and t.train_samples is not None:
            raise ConfigError("give only one of --train-iters and --train-samples")
        if o.lr is None:
            raise ConfigError("--lr is required")
    if not t.dry_run:  # parts of the grid whose layers have not landed yet: refuse, never ignore
        m, p = cfg.model, cfg.parallel
        if p.cp > 1 and m.attention_dropout:
            raise ConfigError("--context-parallel-size > 1 has no attention dropout: set "
                              "--attention-dropout 0")
        from megalite.backends.selection import backend_refusal

        refusal = backend_refusal(cfg)   # TE missing / no CUDA / FP8 without TE (one line)
        if refusal:
            raise ConfigError(refusal)
    if t.recompute_method and t.recompute_granularity != "full":
        raise ConfigError("--recompute-method needs --recompute-granularity full")
    allowed = {"core_attn", "mlp", "layernorm"}
    bad = set(t.recompute_modules or []) - allowed
    if bad:
        raise ConfigError(f"--recompute-modules: unknown {sorted(bad)}; choose from {sorted(allowed)}")


def check_loss_scaler(o) -> None:
    """--fp16 loss-scaler flags, as Megatron-Core's grad scalers assert them."""
    if o.loss_scale is not None and not o.loss_scale > 0:
        raise ConfigError(f"--loss-scale must be positive, got {o.loss_scale}")
    if not 0 < o.min_loss_scale <= o.initial_loss_scale:
        raise ConfigError(f"--min-loss-scale ({o.min_loss_scale}) must be positive and at most "
                          f"--initial-loss-scale ({o.initial_loss_scale})")
    if o.loss_scale_window < 1 or int(o.loss_scale_window) != o.loss_scale_window:
        raise ConfigError(f"--loss-scale-window must be a whole number >= 1, got "
                          f"{o.loss_scale_window}")
    if o.hysteresis < 1:
        raise ConfigError(f"--hysteresis must be >= 1, got {o.hysteresis}")


def check_megatron_compat(cfg: MegaliteConfig) -> None:
    """Megatron flags that parse (a script runs --dry-run unchanged) but whose feature has not
    landed: refused when the run would start, one line each, never ignored."""
    m, o, t = cfg.model, cfg.optimizer, cfg.training
    if m.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent {m.rotary_percent}: only 1.0 (full rotary) is "
                          "implemented")
    if t.dry_run:
        return
    pending = [(t.step_batch_size_schedule, "--step-batch-size-schedule",
                "batch-size schedules are not implemented yet; drop the flag")]
    for given, flag, why in pending:
        if given:
            raise ConfigError(f"{flag}: {why}")


def missing_logging_packages(cfg: MegaliteConfig) -> list:
    """One line per optional package a logging flag needs that is not installed."""
    import importlib.util

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
    lg = cfg.logging
    missing = missing_logging_packages(cfg)
    if missing and not cfg.training.dry_run:
        raise ConfigError(missing[0])
    if lg.loss_plot and not lg.metrics_file:
        raise ConfigError("--loss-plot draws from the metrics file: also give --metrics-file PATH")


def check_data_parallel(cfg: MegaliteConfig) -> None:
    """Data-parallel strategy flags (docs/data_parallel.md): combinations that do not compose
    are refused, never ignored."""
    p = cfg.parallel
    if p.ddp_bucket_size is not None and p.ddp_bucket_size < 1:
        raise ConfigError(f"--ddp-bucket-size must be >= 1, got {p.ddp_bucket_size}")
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                          "--overlap-grad-reduce")
    if p.use_torch_fsdp2:
        if p.pp > 1:
            raise ConfigError("--use-torch-fsdp2 does not compose with pipeline parallelism "
                              "(PP > 1, tied embeddings across stages); use "
                              "--use-distributed-optimizer with PP")
        if p.use_distributed_optimizer:
            raise ConfigError("--use-torch-fsdp2 and --use-distributed-optimizer both shard the "
                              "optimizer; pick one")
        if p.cp > 1 or cfg.model.num_experts:
            raise ConfigError("--use-torch-fsdp2 shards over DP only: not with CP > 1 or "
                              "--num-experts")


def validate(cfg: MegaliteConfig) -> None:
    if cfg.checkpoint.load:  # first: the model the flags describe is the checkpoint's
        from megalite.checkpointing.checkpoint_args import check_model_matches_checkpoint

        check_model_matches_checkpoint(cfg)
    validate_layout(cfg)
    check_data_parallel(cfg)
    validate_files(cfg)      # --dry-run too: files, tokenizer and split need no processes
    validate_training(cfg)
    validate_logging(cfg)
