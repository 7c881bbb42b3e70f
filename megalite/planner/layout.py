"""One candidate layout: every knob the search turns, and its two faces -- a
``MegaliteConfig`` (so ``validate_layout`` judges legality) and pretrain_gpt.py flags.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import List, Optional

from megalite.config import MegaliteConfig, ModelConfig
from megalite.pipeline_parallel.simulator import AUTO, SCHEDULE_NAMES, resolve_schedule

ZERO_NAMES = {0: "DDP", 1: "ZeRO-1 (distributed optimizer)", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    global_batch: int = 1            # samples
    recompute: str = "none"          # none | selective | full
    zero: int = 0                    # 0 DDP, 1 distributed optimizer, 2 +grads, 3 +weights
    sp: bool = False
    schedule: str = SCHEDULE_NAMES[0]    # a name of pipeline_parallel.simulator.SCHEDULES
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
    # --num-distributed-optimizer-instances (ZeRO >= 1): shards inside R instances of
    # neighbouring ranks, replicated across them (HSDP for FSDP2)
    instances: int = 1
    # The MTP modules counted as pipeline layers too (model_spec.pipeline_split): Megatron's
    # --pipeline-model-parallel-layout with 'm' (Bridge's DeepSeek-V3 'Et|(tt|)*30mL').
    # megalite has no flag for it: its flags and config leave it out (advice only).
    account_mtp: bool = False

    @property
    def schedule_flag(self) -> str:
        """``--pipeline-schedule``: ``auto`` when that is what auto picks (no flag needed)."""
        return AUTO if resolve_schedule(AUTO, self.vpp).name == self.schedule else \
            self.schedule

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size (world / (expert-TP x EP x PP))."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def dense_shards(self) -> int:
        """Ranks one dense parameter is sharded over with ZeRO >= 1: DP x CP, or an
        instance of it (``instances``)."""
        return self.dp * self.cp // self.instances

    @property
    def expert_shards(self) -> int:
        return self.edp // self.instances

    @property
    def accounts(self) -> tuple:
        """(embedding, loss) counted as pipeline layers."""
        return self.account_embedding, self.account_loss

    @property
    def stage_split(self) -> tuple:
        """``model_spec``'s (first, last, accounts) arguments: how layers map to stages
        (accounts: embedding, loss, MTP)."""
        return self.first_layers, self.last_layers, self.accounts + (self.account_mtp,)

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
        if any(self.stage_split[2]):
            parts.append("split+" + "+".join(n for n, on in zip(("emb", "loss", "mtp"),
                                                                 self.stage_split[2]) if on))
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(dp=self.dp, num_micro_batches=self.num_micro_batches)
        return d

    # ---- the two faces --------------------------------------------------------------
    def to_config(self, model: ModelConfig, seq_length: int) -> MegaliteConfig:
        cfg = MegaliteConfig(world_size=self.world)
        cfg.model = copy.copy(model)
        cfg.model.seq_length = seq_length
        p, t = cfg.parallel, cfg.training
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = self.tp, self.pp
        p.context_parallel_size, p.expert_model_parallel_size = self.cp, self.ep
        p.cp_comm_type = self.cp_comm
        p.expert_tensor_parallel_size = self.etp if self.etp != self.tp else None
        p.num_virtual_stages_per_pipeline_rank = self.vpp if self.vpp > 1 else None
        p.decoder_first_pipeline_num_layers = self.first_layers
        p.decoder_last_pipeline_num_layers = self.last_layers
        p.account_for_embedding_in_pipeline_split = self.account_embedding
        p.account_for_loss_in_pipeline_split = self.account_loss
        p.pipeline_schedule = self.schedule_flag
        p.sequence_parallel = self.sp
        p.use_distributed_optimizer = self.zero in (1, 2)
        p.overlap_grad_reduce = self.zero == 2       # ZeRO-2: bucketed, shard-only grads
        p.use_torch_fsdp2 = self.zero == 3
        p.num_distributed_optimizer_instances = self.instances
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
        if self.vpp > 1:
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
    p, t, m = cfg.parallel, cfg.training, cfg.model
    vpp = p.virtual_stages(m.num_layers)
    sched = resolve_schedule(p.pipeline_schedule, vpp).name
    dp = cfg.world_size // (p.tp * p.cp * p.pp)
    return Layout(world=cfg.world_size, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp, vpp=vpp,
                  micro_batch=t.micro_batch_size,
                  global_batch=t.global_batch_size or t.micro_batch_size * dp,
                  recompute=t.recompute_granularity or "none",
                  zero=zero_stage(p) if zero is None else zero,
                  sp=p.sequence_parallel_active, schedule=sched,
                  first_layers=p.decoder_first_pipeline_num_layers,
                  last_layers=p.decoder_last_pipeline_num_layers,
                  account_embedding=p.account_for_embedding_in_pipeline_split,
                  account_loss=p.account_for_loss_in_pipeline_split,
                  cp_comm=p.cp_comm_type,
                  recompute_layers=t.recompute_num_layers if t.recompute_granularity == "full"
                  and t.recompute_method == "block" else None,
                  instances=p.num_distributed_optimizer_instances)
