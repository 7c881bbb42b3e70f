"""``megalite plan``: size a model on a cluster and print the best layouts and their flags.

Bad input is a one-line error and exit status 2 (megalite.cli.boundary.run_cli).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import List, Optional

from megalite.cli.arguments import OneLineErrorParser, add_field_argument, parse_args
from megalite.cli.boundary import run_cli
from megalite.config import RECOMPUTE_MODULES, ConfigError, MegaliteConfig, find_field
from megalite.config.domains import requirement_problem
from megalite.planner import model_spec as ms
from megalite.planner import host_offload
from megalite.planner import report
from megalite.planner.estimate import PLANNER_ONLY_RECOMPUTE, ModelOptions
from megalite.planner.hardware import GPU_PRESETS, GiB, make_cluster
from megalite.config.pipeline_layout import parse_layout
from megalite.config.pipeline_schedules import SCHEDULE_NAMES
from megalite.planner.kernels import (ATTENTION_KERNELS, FP4_RECIPES, FP8_ONLY_RECIPES,
                                      fp8_unavailable)
from megalite.planner.moe_cost import DISPATCHERS
from megalite.planner.optimizer_precision import MASTER_DTYPES, STATE_DTYPES, adam_state_bytes
from megalite.planner.search import (MOE_SEARCHED_SCHEDULES, RECOMPUTE_ORDER, SEARCHED_SCHEDULES,
                                     SearchSpace, search)
from megalite.planner.goodput import main as goodput
from megalite.planner.plot import plot_plan


def _ints(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'")


def _instances(text: str) -> list:
    """Comma-separated positive integers or the word ``node``."""
    out = []
    for x in (x for x in text.split(",") if x):
        if x == "node" or (x.isdigit() and int(x) > 0):
            out.append(x if x == "node" else int(x))
        else:
            raise argparse.ArgumentTypeError(f"expected positive integers or 'node', got '{x}'")
    return out


def _words(choices):
    def parse(text: str) -> List[str]:
        vals = [x for x in text.split(",") if x]
        bad = [v for v in vals if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return vals
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="megalite plan", allow_abbrev=False, help_hint="megalite plan --help",
        description="Pick TP/PP/VPP/DP/CP/EP, micro-batch, recomputation and sharding "
        "for a model on a cluster. Model: --recipe, --hf-config, or pretrain_gpt.py "
        "model flags (--num-layers ... --vocab-size ...).")
    g = p.add_argument_group("model")
    g.add_argument("--recipe", help=f"built-in model: {', '.join(ms.RECIPES)}; or a launch "
                   "recipe file (launch/recipes/*.yaml): its model and sequence length")
    g.add_argument("--hf-config", metavar="PATH", help="Hugging Face config.json (or its folder)")
    g.add_argument("--list-recipes", action="store_true", help="list built-in models and exit")
    c = p.add_argument_group("cluster")
    c.add_argument("--num-gpus", type=int, help="total GPUs (required)")
    c.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default 8; 4 for the NVL72 presets' trays)")
    c.add_argument("--gpu", default=None, help=f"preset: {', '.join(GPU_PRESETS)} "
                   "(default h100-80gb unless all four figures below are given)")
    c.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU")
    c.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU")
    c.add_argument("--intra-node-bandwidth-gbps", type=float, help="GB/s one way per GPU (NVLink)")
    c.add_argument("--inter-node-bandwidth-gbps", type=float, help="GB/s one way per GPU (network)")
    c.add_argument("--compute-efficiency", type=float,
                   help="sustained fraction of the GPU's measured kernel ceilings (default: "
                   "the calibrated one for its generation, docs/planner.md)")
    b = p.add_argument_group("batch")
    b.add_argument("--seq-length", type=int, help="default: the recipe's")
    b.add_argument("--global-batch-size", type=int, help="samples per step")
    b.add_argument("--global-batch-tokens", type=int, help="tokens per step (/ seq length)")
    s = p.add_argument_group("search space (comma lists pin a dimension)")
    for name in ("tp", "pp", "cp", "ep", "etp", "vpp"):
        s.add_argument(f"--{name}", type=_ints, metavar="N[,N]",
                       help="expert-TP (--expert-tensor-parallel-size): default 1 or TP"
                       if name == "etp" else None)
    s.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                   help="only this pipeline split, as pretrain_gpt.py takes it (e.g. "
                   "'Et|(tt|)*30mL'): PP is a divisor of its stage count, VPP the quotient")
    s.add_argument("--micro-batch-sizes", type=_ints, metavar="N[,N]")
    s.add_argument("--recompute", type=_words(RECOMPUTE_ORDER), default=None,
                   help=f"levels to try (default {','.join(RECOMPUTE_ORDER)})")
    s.add_argument("--zero-stages", type=_ints, default=[0, 1], metavar="S[,S]",
                   help="0 DDP, 1 --use-distributed-optimizer, 2 with --overlap-grad-reduce, "
                   "3 --use-torch-fsdp2 (with PP, CP, EP and TP alike; default 0,1)")
    s.add_argument("--num-distributed-optimizer-instances", dest="instances",
                   type=_instances, default=[1], metavar="R[,R]",
                   help="hybrid sharding for stages >= 1: R instances (HSDP for FSDP2); "
                   "'node' = as many as keep each instance inside a node (default 1)")
    s.add_argument("--schedules", type=_words(SCHEDULE_NAMES), default=None,
                   help=f"pipeline schedules to try (default {','.join(SEARCHED_SCHEDULES)}, "
                   f"and {','.join(MOE_SEARCHED_SCHEDULES)} for MoE models)")
    s.add_argument("--cp-min-seq-length", type=int, default=16384,
                   help="consider CP only from this sequence length (default 16384)")
    s.add_argument("--max-micro-batch-size", type=int, default=8)
    o = p.add_argument_group("cost-model assumptions")
    o.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="main-gradient dtype (Megatron keeps fp32)")
    o.add_argument("--fp32", action="store_true", help="fp32 training instead of bf16")
    o.add_argument("--no-flash-attention", action="store_true",
                   help="attention stores the s x s scores (Korthikanti's 5as/h term)")
    o.add_argument("--headroom", type=float, default=0.90, help="usable memory fraction")
    o.add_argument("--local-layers", action="store_true",
                   help="model megalite's local (pure PyTorch) layers instead of Transformer "
                   "Engine's fused kernels (RoPE, attention-output and SwiGLU copies; "
                   "docs/planner.md, \"Local layers\")")
    o.add_argument("--dp-exposed-fraction", type=float,
                   help="force this fraction of DP communication to be exposed")
    o.add_argument("--tp-overlap", type=float, default=0.0,
                   help="fraction of TP communication hidden behind GEMMs")
    o.add_argument("--fp8-recipe", choices=list(FP8_ONLY_RECIPES),
                   help="FP8 GEMMs with this recipe (megalite's --fp8-format runs 'delayed'; "
                   "Transformer Engine's current scaling is 'tensorwise'; Blackwell's "
                   "MXFP8 'mxfp8')")
    o.add_argument("--cuda-graph-impl", choices=["none", "local", "transformer_engine",
                                                  "full_iteration"], default="none",
                   help="Megatron's CUDA graphs: each layer pass is one graph launch, so the "
                   "host's per-kernel launch time stops showing where a layer's GPU work is "
                   "shorter than it (small micro-batches, fine-grained experts)")
    o.add_argument("--fp4-recipe", choices=list(FP4_RECIPES),
                   help="FP4 GEMMs (Megatron's --fp4-format e2m1 --fp4-recipe nvfp4; "
                   "Blackwell presets)")
    o.add_argument("--fp8-param-gather", action="store_true",
                   help="the weights are FP8 only (Megatron's flag, with --fp8-recipe and the "
                   "distributed optimizer or FSDP): no 16-bit copy of the layers' weights")
    o.add_argument("--fp4-param-gather", action="store_true",
                   help="the weights are NVFP4 only (Megatron's flag, with --fp4-recipe)")
    o.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Transformer Engine's FusedAdam holds the optimizer state (Megatron's "
                   "flag): the dtypes below, and an fp32 master of a bf16 weight as its low "
                   "16 bits")
    o.add_argument("--exp-avg-dtype", choices=list(STATE_DTYPES), default="fp32",
                   help="Adam's first moment (with --use-precision-aware-optimizer)")
    o.add_argument("--exp-avg-sq-dtype", choices=list(STATE_DTYPES), default="fp32",
                   help="Adam's second moment (with --use-precision-aware-optimizer)")
    o.add_argument("--main-params-dtype", choices=list(MASTER_DTYPES), default="fp32",
                   help="the master weights (with --use-precision-aware-optimizer)")
    o.add_argument("--recompute-modules", nargs="+", metavar="MODULE",
                   choices=list(RECOMPUTE_MODULES) + list(PLANNER_ONLY_RECOMPUTE),
                   default=["core_attn"],
                   help="what selective recomputation repeats (training's "
                   "--recompute-modules; planner-only: " + ", ".join(PLANNER_ONLY_RECOMPUTE)
                   + ")")
    o.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "flex"],
                   default="alltoall", help="EP dispatch: NCCL all-to-all, or Megatron's "
                   "flex dispatcher with --moe-flex-dispatcher-backend")
    o.add_argument("--moe-flex-dispatcher-backend", choices=list(DISPATCHERS[1:]),
                   default="deepep", help="flex backend: deepep (once per node, NVLink "
                   "inside a host) or hybridep (also across an NVL72 rack)")
    o.add_argument("--cpu-offloading", action="store_true",
                   help="offload activations to host memory (Megatron's flag; with "
                   "--cpu-offloading-num-layers; PP 1, no recomputation)")
    o.add_argument("--cpu-offloading-num-layers", type=int, default=0, metavar="N",
                   help="layers per model chunk whose activations go to the host (N > 0 "
                   "turns --cpu-offloading on, as in Megatron)")
    o.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="Megatron's hybrid optimizer: a share of each rank's Adam state on "
                   "the host, Adam run there (with --use-precision-aware-optimizer and the "
                   "distributed optimizer)")
    o.add_argument("--optimizer-offload-fraction", type=float, default=None, metavar="F",
                   help="share of the optimizer state offloaded, in [0, 1] (default 1.0)")
    o.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="the offloaded share's transfers beside the CPU's Adam")
    o.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with --moe-expert-capacity-factor: every expert runs its capacity")
    o.add_argument("--attention-kernel", choices=list(ATTENTION_KERNELS), default="cudnn",
                   help="core-attention kernel whose measured rate the model uses "
                   "(cudnn = Transformer Engine's fused attention)")
    o.add_argument("--tp-comm-overlap", choices=["none", "all", "forward"], default="none",
                   help="TP collectives pipelined with their GEMMs: all (TE userbuffers), "
                   "forward (PyTorch async TP)")
    # training's own flags (pretrain_gpt.py's definition); --ep-overlap: the planner's old name
    add_field_argument(o, find_field("parallel.overlap_moe_expert_parallel_comm")[1],
                       aliases=("--ep-overlap",))
    add_field_argument(o, find_field("parallel.delay_wgrad_compute")[1])
    o.add_argument("--moe-routing", default="uniform", metavar="uniform|balanced|FILE|X",
                   help="routing imbalance of the MoE layers: uniform routing (default), "
                   "balanced, a run's --metrics-file, or a max/mean factor")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10)
    out.add_argument("--json", action="store_true")
    out.add_argument("--explain", action="store_true")
    out.add_argument("--plot", metavar="PNG", help="compute-vs-communication and memory picture")
    k = p.add_argument_group("check the best layout's collectives before launch")
    k.add_argument("--check-collectives", action="store_true",
                   help="trace one iteration of every rank of the best layout (class "
                   "representatives past 64 ranks) and check that every group issues the same "
                   "collectives (pretrain_gpt.py --dry-run --check-collectives)")
    v = p.add_argument_group("check the model against a real run (pretrain_gpt.py flags)")
    v.add_argument("--validate-run", action="store_true", help="run one iteration of the given "
                   "layout on --nproc CPU gloo processes; compare predicted and measured bytes")
    v.add_argument("--nproc", type=int, default=1, help="processes for --validate-run")
    return p


def resolve_model(args, extra: List[str]):
    chosen = [x for x in (args.recipe, args.hf_config, extra or None) if x]
    if len(chosen) != 1:
        raise ConfigError("give exactly one model: --recipe NAME, --hf-config PATH, or "
                          "pretrain_gpt.py model flags (--num-layers ...)")
    if args.recipe and args.recipe.endswith((".yaml", ".yml")):
        m = parse_args(["--config", args.recipe, "--dry-run"], validate_config=False).model
    elif args.recipe:
        m = ms.recipe(args.recipe)
    elif args.hf_config:
        m = ms.from_hf_config(args.hf_config)
    else:
        m = ms.from_flags(extra)
        for flag, v in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads)):
            if not v:
                raise ConfigError(f"{flag} is required with model flags")
    if not m.vocab_size:
        raise ConfigError("the model needs a vocabulary size: add --vocab-size")
    return m


def plan(argv: Optional[List[str]] = None, out=None) -> int:
    out = sys.stdout if out is None else out     # looked up now: a caller may have replaced it
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--validate-run" in argv:
        # start-up time: only --validate-run trains; a plan never imports torch
        from megalite.commands.validate_run import main as validate_run

        return validate_run(argv, out)
    if "--goodput" in argv:
        return goodput(argv, out)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.list_recipes:
        for name in ms.RECIPES:
            print(f"{name:<14} {ms.describe(ms.recipe(name))}", file=out)
        return 0
    m = resolve_model(args, extra)
    seq = args.seq_length or m.seq_length
    if not seq or seq <= 0:
        raise ConfigError("give --seq-length")
    m = dataclasses.replace(m, seq_length=seq)
    if args.num_gpus is None:
        raise ConfigError("--num-gpus is required")
    explicit = all(v is not None for v in (args.gpu_memory_gb, args.peak_tflops,
                                           args.intra_node_bandwidth_gbps,
                                           args.inter_node_bandwidth_gbps))
    cluster = make_cluster(args.num_gpus, args.gpus_per_node,
                           args.gpu or (None if explicit else "h100-80gb"),
                           memory_gb=args.gpu_memory_gb, peak_tflops=args.peak_tflops,
                           intra_gbps=args.intra_node_bandwidth_gbps,
                           inter_gbps=args.inter_node_bandwidth_gbps,
                           compute_efficiency=args.compute_efficiency)
    gbs = global_batch(args, seq)
    bad = [z for z in args.zero_stages if z not in (0, 1, 2, 3)]
    if bad:
        raise ConfigError(f"--zero-stages: unknown stage(s) {bad}; use 0-3")
    quantized = quantized_weights(args)
    zero_stages = [z for z in args.zero_stages if z or not quantized]
    offload_fraction, zero_stages = host_offload.check_optimizer_offload(
        args.optimizer_cpu_offload, args.optimizer_offload_fraction,
        args.overlap_cpu_optimizer_d2h_h2d, args.use_precision_aware_optimizer,
        args.fp8_param_gather, args.fp8_recipe, zero_stages,
        (("--exp-avg-dtype", args.exp_avg_dtype), ("--exp-avg-sq-dtype", args.exp_avg_sq_dtype),
         ("--main-params-dtype", args.main_params_dtype)))
    offload_layers = host_offload.activation_offload_layers(args.cpu_offloading,
                                                            args.cpu_offloading_num_layers)
    pp, recompute = host_offload.activation_offload_space(
        offload_layers, m.num_layers, args.pp or [], args.recompute or RECOMPUTE_ORDER,
        args.recompute is not None, args.cuda_graph_impl)
    if not 0 < args.headroom <= 1:
        raise ConfigError("--headroom must be in (0, 1]")
    overlap_flags_problem(args)
    if args.pipeline_model_parallel_layout:          # its letters and counts, before the search
        parse_layout(args.pipeline_model_parallel_layout, 1, m.num_layers, m.mtp_num_layers or 0)
    space = SearchSpace(tp=args.tp, pp=pp or None, cp=args.cp, ep=args.ep, etp=args.etp,
                        vpp=args.vpp,
                        micro_batch=args.micro_batch_sizes, recompute=tuple(recompute),
                        zero=tuple(zero_stages), schedules=tuple(args.schedules or SEARCHED_SCHEDULES),
                        moe_schedules=() if args.schedules else MOE_SEARCHED_SCHEDULES,
                        cp_min_seq=args.cp_min_seq_length,
                        max_micro_batch=args.max_micro_batch_size,
                        instances=tuple(args.instances),
                        pipeline_layout=args.pipeline_model_parallel_layout)
    opts = ModelOptions(grad_bytes=4 if args.grad_dtype == "fp32" else 2, fp32=args.fp32,
                        flash_attention=not args.no_flash_attention, headroom=args.headroom,
                        dp_exposed=args.dp_exposed_fraction, tp_overlap=args.tp_overlap,
                        local_layers=args.local_layers, fp8=args.fp8_recipe,
                        attention_kernel=args.attention_kernel,
                        tp_comm_overlap=args.tp_comm_overlap,
                        ep_overlap=args.overlap_moe_expert_parallel_comm,
                        ep_overlap_rule="megalite",        # it predicts a megalite run
                        ep_delay_wgrad=args.delay_wgrad_compute,
                        moe_routing=moe_routing(args.moe_routing),
                        recompute_modules=tuple(args.recompute_modules),
                        moe_dispatcher=args.moe_flex_dispatcher_backend
                        if args.moe_token_dispatcher_type == "flex" else "alltoall",
                        moe_pad_to_capacity=args.moe_pad_expert_input_to_capacity,
                        cpu_offload_layers=offload_layers,
                        optimizer_offload=offload_fraction,
                        optimizer_offload_overlap=args.overlap_cpu_optimizer_d2h_h2d,
                        cuda_graphs=args.cuda_graph_impl != "none",
                        quantized_weights=quantized, fp8_param_gather=args.fp8_param_gather)
    if args.fp4_recipe:
        if args.fp8_recipe:
            raise ConfigError("--fp4-recipe and --fp8-recipe: pick one low precision")
        opts = dataclasses.replace(opts, fp8=args.fp4_recipe)
    moments, master = adam_state_bytes(args.use_precision_aware_optimizer, args.exp_avg_dtype,
                                       args.exp_avg_sq_dtype, args.main_params_dtype,
                                       opts.fp8, quantized, args.fp32,
                                       cpu_offload=args.optimizer_cpu_offload)
    opts = dataclasses.replace(opts, moment_bytes=moments, master_bytes=master)
    warn = fp8_unavailable(cluster, opts)
    if warn:
        flag = "--fp4-recipe" if args.fp4_recipe else "--fp8-recipe"
        raise ConfigError(f"{flag}: {warn}; drop the flag or pick a GPU that has them")
    res = search(m, seq, gbs, cluster, space, opts)
    if args.json:
        print(report.to_json(res, m, seq, gbs, cluster, args.top, args.fp32, opts), file=out)
    else:
        print(report.header(m, seq, gbs, cluster, res), file=out)
        if not res.ranked:
            raise ConfigError(report.no_fit(res))
        print(report.table(res, cluster, args.top), file=out)
        if not args.local_layers:
            print("activations modelled for Transformer Engine's fused kernels (the GPU target); "
                  "megalite's local layers, what runs today, keep more: add --local-layers",
                  file=out)
        best = res.ranked[0]
        if best.memory.get("host"):
            print(f"host memory the best layout offloads: {best.memory['host'] / GiB:.1f} GiB "
                  f"per GPU ({cluster.gpus_per_node * best.memory['host'] / GiB:.0f} GiB a "
                  f"node of {cluster.gpus_per_node})", file=out)
        print("\nbest layout as pretrain_gpt.py flags:", file=out)
        print(shlex.join(report.winner_flags(best, m, seq, args.fp32, opts)), file=out)
        if args.check_collectives:
            check_best_layout(best, m, seq, args, out, opts)
        if args.explain:
            print("\n" + report.explain(res, cluster, min(args.top, 5)), file=out)
    if args.plot:
        plot_plan(args.plot, res, m, seq, gbs, cluster, space, opts)
        if not args.json:
            print(f"\nwrote {args.plot}", file=out)
    return 0


def overlap_flags_problem(args) -> None:
    """The overlap flags' own rules as training declares them (``requires=`` beside the
    field: --delay-wgrad-compute needs --overlap-moe-expert-parallel-comm); the rules that
    need a layout (training's pairs) are the search's, per candidate."""
    cfg = MegaliteConfig()
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
        setattr(cfg.parallel, name, getattr(args, name))
    problem = requirement_problem(cfg, "parallel", find_field("parallel.delay_wgrad_compute")[1])
    if problem:
        raise ConfigError(problem)


def quantized_weights(args) -> bool:
    """Megatron's --fp8-param-gather / --fp4-param-gather: the flag's low precision must run
    (megatron/training/arguments.py), and the weights live sharded in the distributed
    optimizer or FSDP, so ZeRO stage 0 leaves the search."""
    for flag, recipe, need in (("--fp8-param-gather", args.fp8_recipe, "--fp8-recipe"),
                               ("--fp4-param-gather", args.fp4_recipe, "--fp4-recipe")):
        if getattr(args, flag[2:].replace("-", "_")) and not recipe:
            raise ConfigError(f"{flag} needs {need} (the weights are quantized only when the "
                              f"GEMMs are); add it")
    quantized = args.fp8_param_gather or args.fp4_param_gather
    if quantized and not any(args.zero_stages):
        raise ConfigError("--fp8-param-gather / --fp4-param-gather need the distributed "
                          "optimizer or FSDP: give --zero-stages 1, 2 or 3")
    return quantized


def moe_routing(text: str):
    """--moe-routing: a keyword, a number (the factor) or a metrics file (read at estimate)."""
    if text in ("uniform", "balanced"):
        return text
    try:
        return float(text)
    except ValueError:
        return text


def check_best_layout(best, m, seq: int, args, out, opts: ModelOptions) -> None:
    """``--check-collectives``: the best layout's flags through pretrain_gpt.py's parser,
    then the same check as its ``--dry-run --check-collectives``."""
    if best is None:
        raise ConfigError("--check-collectives: no layout megalite can run was found")
    # start-up time: a plan never imports torch; only --check-collectives traces the training step
    from megalite.training.dry_run import print_collective_check

    flags = report.winner_flags(best, m, seq, args.fp32, opts)
    cfg = parse_args([*flags, "--world-size", str(args.num_gpus), "--mock-data",
                      "--train-iters", "1", "--dry-run", "--check-collectives"])
    print("", file=out)
    out.flush()
    print_collective_check(cfg)


def global_batch(args, seq: int) -> int:
    if args.global_batch_size and args.global_batch_tokens:
        raise ConfigError("give only one of --global-batch-size and --global-batch-tokens")
    if args.global_batch_tokens:
        if args.global_batch_tokens % seq:
            raise ConfigError(f"--global-batch-tokens ({args.global_batch_tokens}) is not a "
                              f"multiple of --seq-length ({seq})")
        return args.global_batch_tokens // seq
    if not args.global_batch_size:
        raise ConfigError("give --global-batch-size (samples) or --global-batch-tokens")
    if args.global_batch_size <= 0:
        raise ConfigError("--global-batch-size must be positive")
    return args.global_batch_size


def main(argv: Optional[List[str]] = None) -> int:
    return run_cli(plan, argv)
