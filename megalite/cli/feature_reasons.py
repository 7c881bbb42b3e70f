"""The reasons the rule engine (``megalite/cli/features.py``) gives, and the config readers
they share with it: each refusal's text says which flag to change and how, quoting the run's
values where the reason is a function of the config.

The feature-name lists that rules name by property (``SPLIT_BACKWARD``, ``VSHAPE``) are
derived from the schedule registry here, so a reason and the rule that gives it read the
same list.  Importing this module does not import torch.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from megalite.cli import compat_flags
from megalite.cli.rule_kinds import schedule_fits
from megalite.config.pipeline_schedules import AUTO, SCHEDULES


def vpp(cfg) -> int:
    return cfg.parallel.virtual_stages(cfg.model.num_layers)


def moe(cfg) -> bool:
    return bool(cfg.model.num_experts)


# ---- the feature-name lists ------------------------------------------------------------------
# A rule names features by property where one exists: a name list such as ``SPLIT_BACKWARD``
# is "any of" these features, so a new schedule with ``split_backward=True`` inherits every
# rule of zero bubble without an edit to the rules.
SPLIT_BACKWARD = tuple(f"pp-{n}" for n, s in SCHEDULES.items() if s.split_backward)
MOE_FEATURES = ("moe", "ep", "expert-tp", "moe-alltoall", "moe-allgather")


def hsdp_group_sizes(cfg) -> List[Tuple[int, str]]:
    """The data-parallel groups that R distributed-optimizer instances split."""
    p = cfg.parallel
    sizes = [(cfg.data_parallel_size * p.cp, "data-parallel x context-parallel size")]
    if moe(cfg):
        sizes.append((cfg.world_size // (p.etp * p.ep * p.pp),
                      "expert data-parallel size (world / (expert-TP x EP x PP))"))
    return sizes


# ---- the reasons -----------------------------------------------------------------------------
def flags_environment(cfg) -> str:
    """The machine as the flags describe it (readers without a machine: the planner, docs)."""
    return f"device={cfg.training.device}, --transformer-impl {cfg.model.transformer_impl}"


def fp8_without_te(cfg, environment: str) -> str:
    return (f"--fp8-format {cfg.model.fp8_format}: FP8 training needs Transformer Engine on a "
            f"CUDA GPU with FP8 support; this run has {environment}. Drop the --fp8-* flags")


def unwired_fp8(cfg) -> List[str]:
    return [f for f, _, _ in getattr(cfg, "accepted_flags", ()) if f in compat_flags.FP8_UNWIRED]


CP_DROPOUT = ("--context-parallel-size > 1 has no attention dropout (ring and all-to-all "
              "attention draw none): set --attention-dropout 0")
SPLIT_FLAGS = " / ".join(f"--pipeline-schedule {n[3:]}" for n in SPLIT_BACKWARD)


def split_moe_recompute_reason(cfg) -> str:
    """Names the schedule the run asked for (each split-backward schedule refuses it)."""
    return (f"--pipeline-schedule {cfg.parallel.pipeline_schedule} with a recomputed MoE "
            "layer (--recompute-granularity full, or selective with --recompute-modules mlp): "
            "under the B/W split its recomputation saves other tensors than its forward "
            "(torch.utils.checkpoint refuses); use 1f1b, or recompute core_attn only")


TE_SPLIT_BACKWARD = (f"{SPLIT_FLAGS} splits each linear's backward into B and W passes, which "
                     "TE's fused linears do not; use 1f1b / interleaved or --transformer-impl "
                     "local")


def recomputes_moe_layers(cfg) -> bool:
    t = cfg.training
    return moe(cfg) and (t.recompute_granularity == "full" or (
        t.recompute_granularity == "selective" and "mlp" in (t.recompute_modules or ())))


MOE_COMPILE = ("--compile with --num-experts: the MoE layers' routing gives every step other "
               "token counts (data-dependent shapes, host-side all-to-all splits), and a "
               "compiled MoE run did not finish two tiny steps in 150 s on CPU; drop --compile")
CP_A2A_COMPILE = ("--compile with --cp-comm-type a2a: a compiled all-to-all (Ulysses) "
                  "attention run did not finish two tiny steps in 150 s on CPU; use "
                  "--cp-comm-type p2p or drop --compile")
VSHAPE = tuple(f"pp-{n}" for n, s in SCHEDULES.items() if s.vshape)
VSHAPE_FLAGS = " / ".join(f"--pipeline-schedule {n[3:]}" for n in VSHAPE)
VSHAPE_MTP = (f"{VSHAPE_FLAGS} with --mtp-num-layers: the V puts the output layer and the "
              "MTP heads on pipeline rank 0's second chunk, whose embedding copy is not "
              "wired; drop --mtp-num-layers or use another schedule")
VSHAPE_UNEVEN = (f"{VSHAPE_FLAGS} splits the layers into 2 x PP equal chunks: drop "
                 "--decoder-first/last-pipeline-num-layers, balance rank 0 with "
                 "--account-for-embedding/loss-in-pipeline-split")
FP8_RECOMPUTE = ("--fp8-format with --recompute-granularity: a recomputed forward would run "
                 "outside the FP8 autocast; drop one of them")


def heads_reason(cfg) -> str:
    m, tp = cfg.model, cfg.parallel.tp
    if m.num_attention_heads % tp:
        return (f"--num-attention-heads ({m.num_attention_heads}) is not divisible by "
                f"--tensor-model-parallel-size ({tp})")
    return (f"--num-query-groups ({m.num_query_groups}) is not divisible by "
            f"--tensor-model-parallel-size ({tp}); use a TP that divides it")


def a2a_reason(cfg) -> str:
    p, m = cfg.parallel, cfg.model
    return (f"--cp-comm-type a2a scatters heads over CP: --num-attention-heads "
            f"({m.num_attention_heads}) and query groups ({m.resolved_query_groups()}) must be "
            f"divisible by TP x CP ({p.tp * p.cp}); use --cp-comm-type p2p or another CP")


def schedule_reason(cfg) -> str:
    flag = cfg.parallel.pipeline_schedule
    fixed = SCHEDULES[flag].chunks_per_rank
    if cfg.parallel.pp == 1 and (fixed or SCHEDULES[flag].virtual_stages):
        return (f"--pipeline-schedule {flag} runs model chunks on several pipeline ranks: it "
                "needs --pipeline-model-parallel-size > 1 (or drop it at PP 1)")
    if fixed:
        return (f"--pipeline-schedule {flag} runs exactly {fixed} model chunks per rank; drop "
                f"--num-virtual-stages-per-pipeline-rank (or give {fixed})")
    if SCHEDULES[flag].virtual_stages:
        return (f"--pipeline-schedule {flag} needs --num-virtual-stages-per-pipeline-rank > 1 "
                "(or --num-layers-per-virtual-pipeline-stage)")
    return (f"--pipeline-schedule {flag} does not combine with virtual stages; drop "
            "--num-virtual-stages-per-pipeline-rank (or pick "
            f"{' / '.join(n for n, x in SCHEDULES.items() if x.virtual_stages)})")


def schedule_misfit(cfg) -> bool:
    flag = cfg.parallel.pipeline_schedule
    return flag != AUTO and not schedule_fits(SCHEDULES[flag], vpp(cfg))


def hsdp_reason(cfg) -> str:
    r = cfg.parallel.num_distributed_optimizer_instances
    size, what = next((s, w) for s, w in hsdp_group_sizes(cfg) if s % r)
    return f"--num-distributed-optimizer-instances ({r}) must divide the {what} ({size})"


def mla_extra(cfg) -> Optional[str]:
    m = cfg.model
    return next((flag for given, flag in ((m.group_query_attention, "--group-query-attention"),
                                           (m.add_qkv_bias, "--add-qkv-bias"),
                                           (m.use_rope_scaling, "--use-rope-scaling"))
                 if given), None) if m.multi_latent_attention else None


def mla_position_reason(cfg) -> str:
    hint = " (YaRN: --rope-type yarn with the --rotary-scaling-factor/--yarn-* flags)" \
        if cfg.model.position_embedding_type == "yarn" else ""
    return ("--multi-latent-attention carries positions in its decoupled RoPE part: use "
            f"--position-embedding-type rope{hint}")


def precision_conflict(cfg) -> Optional[str]:
    o = cfg.optimizer
    if o.precision and (o.fp16 or (o.bf16 and o.precision != "bf16")):
        return "--fp16" if o.fp16 else "--bf16"
    return None


def precision_reason(cfg) -> str:
    o, other = cfg.optimizer, precision_conflict(cfg)
    return (f"--precision {o.precision} conflicts with {other}; give only one "
            f"(--precision {o.precision} alone, or {other} alone)")

