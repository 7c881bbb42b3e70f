"""One candidate layout: its ``ParallelDims`` and every other knob the search turns, and
its two faces -- a ``MegaliteConfig`` (so ``validate_layout`` judges legality) and
pretrain_gpt.py flags.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, fields, replace
from typing import List, Optional

from megalite.config import MegaliteConfig, ModelConfig, ParallelDims
from megalite.planner import model_spec as ms
from megalite.config.pipeline_schedules import (AUTO, SCHEDULE_NAMES, get_schedule,
                                                resolve_schedule)

ZERO_NAMES = {0: "DDP", 1: "ZeRO-1 (distributed optimizer)", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}


# The planner's name for ``ParallelDims.dp_instances`` (its JSON output and callers keep it).
DIM_ALIASES = {"instances": "dp_instances"}


@dataclass(frozen=True, init=False)
class Layout:
    """A ``ParallelDims`` (every dimension size; read as ``layout.tp``, ``layout.dp``, ...)
    plus the knobs that are not dimensions: batch, recompute, ZeRO stage, schedule, split.
    ``Layout(world=8, tp=2, micro_batch=2)`` or ``Layout(dims=..., micro_batch=2)``."""
    dims: ParallelDims
    micro_batch: int = 1
    global_batch: int = 1            # samples
    recompute: str = "none"          # none | selective | full
    zero: int = 0                    # 0 DDP, 1 distributed optimizer, 2 +grads, 3 +weights
    sp: bool = False
    schedule: str = SCHEDULE_NAMES[0]    # a name of config.pipeline_schedules.SCHEDULES
    first_layers: Optional[int] = None
    last_layers: Optional[int] = None
    # Megatron's --account-for-embedding/loss-in-pipeline-split: the embedding / the loss
    # count as a pipeline layer, so the first / last (virtual) stage holds a layer fewer.
    account_embedding: bool = False
    account_loss: bool = False
    cp_comm: str = "p2p"             # --cp-comm-type: p2p (ring) | a2a (Ulysses)
    # Full recomputation of only this many layers per model chunk (Megatron's
    # --recompute-method block --recompute-num-layers N); None: every layer (uniform).
    recompute_layers: Optional[int] = None
    # Megatron's --pipeline-model-parallel-layout string (config/pipeline_layout.py): every
    # stage's layer count outright, instead of the first/last/accounts rules above.
    pipeline_layout: Optional[str] = None

    def __init__(self, dims: Optional[ParallelDims] = None, **knobs):
        sizes = {DIM_ALIASES.get(k, k): knobs.pop(k) for k in list(knobs)
                 if DIM_ALIASES.get(k, k) in ParallelDims.names()}
        if dims is None:
            # a candidate names its expert-TP (the search tries 1 and TP); unnamed, it is 1
            dims = ParallelDims(**{"etp": 1, **sizes})
        elif sizes:
            dims = replace(dims, **sizes)
        object.__setattr__(self, "dims", dims)
        for f in fields(self)[1:]:
            object.__setattr__(self, f.name, knobs.pop(f.name, f.default))
        if knobs:
            raise TypeError(f"Layout has no field {sorted(knobs)}")
        # read in the planner's inner loops: worked out once (not fields: no eq / repr)
        vshape = dims.pp > 1 and get_schedule(self.schedule).vshape
        object.__setattr__(self, "_placement", (vshape, ms.output_rank(dims.pp, dims.vpp,
                                                                       vshape)))

    def __getattr__(self, name: str):
        """The dimension sizes and derived sizes are the ``ParallelDims``' (one place)."""
        dims = self.__dict__.get("dims")
        if dims is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(dims, DIM_ALIASES.get(name, name))

    @property
    def schedule_flag(self) -> str:
        """``--pipeline-schedule``: ``auto`` when that is what auto picks (no flag needed)."""
        return AUTO if resolve_schedule(AUTO, self.vpp).name == self.schedule else \
            self.schedule

    @property
    def accounts(self) -> tuple:
        """(embedding, loss) counted as pipeline layers."""
        return self.account_embedding, self.account_loss

    @property
    def stage_split(self) -> tuple:
        """``model_spec``'s (first, last, accounts, layout, vshape) arguments: how layers
        map to stages (accounts: embedding, loss; layout: the layout string; vshape: the V
        placement)."""
        return (self.first_layers, self.last_layers, self.accounts, self.pipeline_layout,
                self.vshape)

    @property
    def vshape(self) -> bool:
        """DualPipeV's V placement: chunk 1 runs back up the ranks, the output on rank 0."""
        return self._placement[0]

    @property
    def output_rank(self) -> int:
        """The pipeline rank with the final norm, output layer, loss and MTP modules."""
        return self._placement[1]

    def stage_params(self, m: ModelConfig, pp_rank: int, tp: Optional[int] = None):
        """``model_spec.stage_params`` on a rank of pipeline stage ``pp_rank`` at this
        layout (``tp``: count at another TP, e.g. the all-gathered SP view)."""
        return ms.stage_params(m, pp_rank, self.tp if tp is None else tp, self.pp, self.vpp,
                               self.etp, self.ep, *self.stage_split)

    def head_params(self, m: ModelConfig) -> int:
        """``model_spec.head_params`` of the output rank: no tied copy where the output sits
        beside the embedding (PP = 1, or rank 0 of the V)."""
        return ms.head_params(m, self.tp, self.pp if self.output_rank else 1)

    def kind_params(self, m: ModelConfig, moe: bool):
        """``model_spec.kind_params`` of one dense (or MoE) layer at this layout."""
        return ms.kind_params(m, moe, self.tp, self.etp, self.ep)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def short(self) -> str:
        parts = [f"TP{self.tp}" + ("+SP" if self.sp else ""), f"CP{self.cp}" + ("/a2a" if self.cp > 1 and self.cp_comm == "a2a" else ""),
                 f"PP{self.pp}",
                 f"DP{self.dp}"]
        if self.vpp > 1:
            parts.insert(3, f"VPP{self.vpp}")
        if self.ep > 1 or self.etp != self.tp:
            parts.append(f"EP{self.ep}/ETP{self.etp}")
        if self.instances > 1:
            parts.append(f"HSDP{self.instances}x{self.dense_shards}")
        if self.first_layers is not None or self.last_layers is not None:
            parts.append(f"split{self.first_layers}/../{self.last_layers}")
        if self.pipeline_layout:
            parts.append(f"layout {self.pipeline_layout}")
        if any(self.accounts):
            parts.append("split+" + "+".join(n for n, on in zip(("emb", "loss"), self.accounts)
                                             if on))
        return " ".join(parts)

    def to_dict(self) -> dict:
        planner_name = {v: k for k, v in DIM_ALIASES.items()}
        d = {planner_name.get(k, k): v for k, v in asdict(self.dims).items()}
        d.update({f.name: getattr(self, f.name) for f in fields(self)[1:]})
        d.update(dp=self.dp, num_micro_batches=self.num_micro_batches)
        return d

    # ---- the two faces --------------------------------------------------------------
    def to_config(self, model: ModelConfig, seq_length: int) -> MegaliteConfig:
        cfg = MegaliteConfig(world_size=self.world)
        cfg.model = copy.copy(model)
        cfg.model.seq_length = seq_length
        p, t = cfg.parallel, cfg.training
        p.apply_dims(self.dims)
        p.cp_comm_type = self.cp_comm
        p.decoder_first_pipeline_num_layers = self.first_layers
        p.decoder_last_pipeline_num_layers = self.last_layers
        p.account_for_embedding_in_pipeline_split = self.account_embedding
        p.account_for_loss_in_pipeline_split = self.account_loss
        p.pipeline_model_parallel_layout = self.pipeline_layout
        if self.pipeline_layout:             # the string sets VPP itself
            p.num_virtual_stages_per_pipeline_rank = None
        p.pipeline_schedule = self.schedule_flag
        p.sequence_parallel = self.sp
        p.use_distributed_optimizer = self.zero in (1, 2)
        p.overlap_grad_reduce = self.zero == 2       # ZeRO-2: bucketed, shard-only grads
        p.use_torch_fsdp2 = self.zero == 3
        t.micro_batch_size, t.global_batch_size = self.micro_batch, self.global_batch
        t.recompute_granularity = None if self.recompute == "none" else self.recompute
        if self.recompute == "full":
            t.recompute_method = "block" if self.recompute_layers else "uniform"
            t.recompute_num_layers = self.recompute_layers or 1
        cfg.optimizer.bf16 = True
        return cfg

    def parallel_flags(self) -> List[str]:
        f = ["--tensor-model-parallel-size", str(self.tp),
             "--pipeline-model-parallel-size", str(self.pp)]
        if self.pipeline_layout:
            f += ["--pipeline-model-parallel-layout", self.pipeline_layout]
        elif self.vpp > 1:
            f += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)]
        if self.first_layers is not None:
            f += ["--decoder-first-pipeline-num-layers", str(self.first_layers)]
        if self.last_layers is not None:
            f += ["--decoder-last-pipeline-num-layers", str(self.last_layers)]
        if self.account_embedding:
            f.append("--account-for-embedding-in-pipeline-split")
        if self.account_loss:
            f.append("--account-for-loss-in-pipeline-split")
        if self.schedule_flag != AUTO:
            f += ["--pipeline-schedule", self.schedule]
        if self.cp > 1:
            f += ["--context-parallel-size", str(self.cp)]
            if self.cp_comm != "p2p":
                f += ["--cp-comm-type", self.cp_comm]
        if self.ep > 1:
            f += ["--expert-model-parallel-size", str(self.ep)]
        if self.etp != self.tp:
            f += ["--expert-tensor-parallel-size", str(self.etp)]
        if self.sp:
            f.append("--sequence-parallel")
        if self.zero in (1, 2):
            f.append("--use-distributed-optimizer")
        if self.zero == 2:
            f.append("--overlap-grad-reduce")
        if self.zero == 3:
            f.append("--use-torch-fsdp2")
        if self.instances > 1:
            f += ["--num-distributed-optimizer-instances", str(self.instances)]
        f += ["--micro-batch-size", str(self.micro_batch),
              "--global-batch-size", str(self.global_batch)]
        if self.recompute == "full":
            f += ["--recompute-granularity", "full", "--recompute-method",
                  "block" if self.recompute_layers else "uniform",
                  "--recompute-num-layers", str(self.recompute_layers or 1)]
        elif self.recompute == "selective":
            f += ["--recompute-granularity", "selective"]
        return f + ["--bf16"]


def zero_stage(p) -> int:
    """The ZeRO stage a run's flags give: 3 with --use-torch-fsdp2, 2 with the distributed
    optimizer and --overlap-grad-reduce (only its shard of the gradient is kept), 1 with the
    distributed optimizer alone, else 0."""
    if p.use_torch_fsdp2:
        return 3
    if p.use_distributed_optimizer:
        return 2 if p.overlap_grad_reduce else 1
    return 0


def layout_from_config(cfg: MegaliteConfig, zero: Optional[int] = None) -> Layout:
    """The layout a (validated) run config describes."""
    p, t, dims = cfg.parallel, cfg.training, cfg.parallel_dims
    sched = resolve_schedule(p.pipeline_schedule, dims.vpp).name
    return Layout(dims=dims, micro_batch=t.micro_batch_size,
                  global_batch=t.global_batch_size or t.micro_batch_size * dims.dp,
                  recompute=t.recompute_granularity or "none",
                  zero=zero_stage(p) if zero is None else zero,
                  sp=p.sequence_parallel_active, schedule=sched,
                  first_layers=p.decoder_first_pipeline_num_layers,
                  last_layers=p.decoder_last_pipeline_num_layers,
                  account_embedding=p.account_for_embedding_in_pipeline_split,
                  account_loss=p.account_for_loss_in_pipeline_split,
                  pipeline_layout=p.pipeline_model_parallel_layout,
                  cp_comm=p.cp_comm_type,
                  recompute_layers=t.recompute_num_layers if t.recompute_granularity == "full"
                  and t.recompute_method == "block" else None)
