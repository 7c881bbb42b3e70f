"""ParallelConfig: the size of every parallel dimension and the data-parallel strategy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.fields import opt
from megalite.config.megatron_fsdp import SHARDING_STRATEGIES
from megalite.config.parallel_dims import ParallelDims
from megalite.config.domain_checks import pipeline_layout_problem
from megalite.config.pipeline_layout import virtual_stages_of
from megalite.config.pipeline_schedules import AUTO, SCHEDULE_NAMES, SCHEDULES


@dataclass
class ParallelConfig:
    """Sizes of every parallel dimension; DP is derived from the world size."""
    tensor_model_parallel_size: int = opt(1, "Tensor-parallel size (TP).", aliases=("--tp",), gt=0)
    pipeline_model_parallel_size: int = opt(1, "Pipeline-parallel size (PP).", aliases=("--pp",),
        gt=0)
    num_layers_per_virtual_pipeline_stage: Optional[int] = opt(
        None, "Layers per virtual pipeline stage (interleaved 1F1B).", gt=0)
    num_virtual_stages_per_pipeline_rank: Optional[int] = opt(
        None, "Virtual pipeline stages per rank (VPP); alternative to the flag above.", gt=0)
    decoder_first_pipeline_num_layers: Optional[int] = opt(
        None, "Layers on the first pipeline stage (uneven split).", ge=0)
    decoder_last_pipeline_num_layers: Optional[int] = opt(
        None, "Layers on the last pipeline stage (uneven split).", ge=0)
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "Count the input embedding as one pipeline layer: the first virtual stage of "
        "the first pipeline rank holds one transformer layer fewer.", action="store_true")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "Count the output layer and loss as one pipeline layer: the last virtual stage "
        "of the last pipeline rank holds one transformer layer fewer.", action="store_true")
    pipeline_model_parallel_layout: Optional[str] = opt(
        None, "Layers of every pipeline stage in visiting order, as Megatron-LM writes it: "
        "E embedding, t transformer layer, m MTP depth, L loss, '|' between stages, (...)*N "
        "repeats; e.g. 'Et|(tt|)*3,tL'. PP x VPP stages (it sets VPP).",
        check=pipeline_layout_problem)
    pipeline_schedule: str = opt(
        AUTO, "Pipeline schedule: auto picks 1F1B, or interleaved with virtual stages.",
        choices=[AUTO, *SCHEDULE_NAMES])
    overlap_moe_expert_parallel_comm: bool = opt(
        False, "Overlapped F&B: in each paired pipeline step the MoE dispatch/combine "
        "all-to-alls and the p2p of one micro-batch run while the other computes (1F1B "
        "becomes combined 1F1B; DualPipeV overlaps its pairs).", action="store_true")
    delay_wgrad_compute: bool = opt(
        False, "With --overlap-moe-expert-parallel-comm: split each paired backward into B "
        "and W and run W after B in the pair (weight-gradient GEMMs hide the forward "
        "half's last all-to-all).", action="store_true",
        requires="overlap_moe_expert_parallel_comm")
    context_parallel_size: int = opt(1, "Context-parallel size (CP).", aliases=("--cp",), gt=0)
    cp_comm_type: str = opt("p2p", "Context-parallel communication: ring (p2p) or all-to-all.",
                            choices=["p2p", "a2a"])
    expert_model_parallel_size: int = opt(1, "Expert-parallel size (EP).", aliases=("--ep",), gt=0)
    expert_tensor_parallel_size: Optional[int] = opt(
        None, "Tensor-parallel size inside experts; default = --tensor-model-parallel-size.", gt=0)
    sequence_parallel: bool = opt(False, "Shard norms/dropout along the sequence over TP ranks.",
                                  action="store_true")
    use_distributed_optimizer: bool = opt(
        False, "Shard optimizer states (and gradients) over data-parallel ranks (ZeRO-1/2).",
        action="store_true")
    # -- data-parallel communication (issue 12; docs/data_parallel.md) --
    overlap_grad_reduce: bool = opt(
        False, "Reduce gradients in buckets, each launched asynchronously as soon as its last "
        "gradient of the step is accumulated (overlaps backward).", action="store_true")
    ddp_bucket_size: Optional[int] = opt(
        None, "Elements per gradient bucket with --overlap-grad-reduce "
        "(default: max(40M, 1M x DP), as Megatron-Core).", gt=0)
    overlap_param_gather: bool = opt(
        False, "Distributed optimizer: wait for a bucket's parameter all-gather just before "
        "its first forward use in the next iteration (needs --overlap-grad-reduce).",
        action="store_true")     # needs: the feature table (megalite/cli/features.py)
    use_torch_fsdp2: bool = opt(
        False, "ZeRO-3 through torch FSDP2 (fully_shard) over DP: one unit per transformer "
        "layer, the embedding and the output layer.", action="store_true")
    num_distributed_optimizer_instances: int = opt(
        1, "Hybrid sharding (HSDP): split each data-parallel group into this many instances of "
        "neighbouring ranks; the distributed optimizer / FSDP2 shard inside an instance and "
        "all-reduce the reduced shards across instances (Megatron-Core's and Megatron-FSDP's "
        "flag).", gt=0)
    # -- Megatron-FSDP's flags, mapped onto the strategies above (config/megatron_fsdp.py) --
    use_megatron_fsdp: bool = opt(
        False, "Megatron-FSDP: run --data-parallel-sharding-strategy with megalite's "
        "strategies (optim_grads_params: torch FSDP2).", action="store_true")
    data_parallel_sharding_strategy: str = opt(
        "optim_grads_params", "With --use-megatron-fsdp, the ZeRO stage: no_shard (DDP), optim "
        "(distributed optimizer), optim_grads (also shards gradients), optim_grads_params "
        "(FSDP2).", choices=list(SHARDING_STRATEGIES), requires="use_megatron_fsdp")
    distributed_backend: str = opt("auto", "Collective backend; auto = nccl on CUDA, gloo on CPU.",
                                   choices=["auto", "nccl", "gloo"])
    distributed_timeout_minutes: float = opt(
        10, "Timeout of collectives: a hung peer becomes an error after this long.", gt=0)
    # -- hangs explained (issue 28; docs/troubleshooting.md, "Reading a hang diagnosis") --
    flight_recorder_size: int = opt(
        10000, "Collectives and p2p ops each rank keeps in its flight recorder, written out "
        "on a hang; 0 switches it off.", ge=0)
    hang_watchdog_seconds: Optional[float] = opt(
        None, "Write every rank's flight recorder when no collective has completed for this "
        "many seconds while one waits (training goes on; see 'megalite hangs').", gt=0)
    hang_dump_dir: Optional[str] = opt(
        None, "Folder of the per-rank flight-recorder dumps and the hang diagnosis; default "
        "<--save>/hang_dumps, else hang_dumps beside --metrics-file, else a folder in /tmp.",
        path="out-dir")
    elastic: bool = opt(
        False, "The world may change between (re)starts (torchrun --nnodes MIN:MAX; "
        "launch/slurm/pretrain.sbatch sets it): DP follows the world while TP/PP/CP/EP and "
        "the global batch stay (more micro-batches per rank); a world the layout does not "
        "fit trains its largest fitting part and the other ranks wait as spares; every start "
        "resumes from the newest checkpoint in --save (docs/fault_tolerance.md).",
        action="store_true", requires="training.global_batch_size")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def sequence_parallel_active(self) -> bool:
        """Whether activations are actually split along the sequence: ``--sequence-parallel``
        has no effect without TP (Megatron's rule).  Derived, so the parsed flag stays as
        given; every reader that means "are we sharding the sequence" asks this."""
        return bool(self.sequence_parallel) and self.tp > 1

    def dims(self, world_size: int, num_layers: Optional[int] = None) -> ParallelDims:
        """The layout these sizes give ``world_size`` ranks (config/parallel_dims.py)."""
        return ParallelDims(world=world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                            etp=self.expert_tensor_parallel_size,
                            vpp=self.virtual_stages(num_layers),
                            dp_instances=self.num_distributed_optimizer_instances)

    def apply_dims(self, dims: ParallelDims) -> None:
        """Set the size flags to ``dims`` (the planner turns a candidate into a config);
        the inverse of ``dims``, kept beside it."""
        self.tensor_model_parallel_size, self.pipeline_model_parallel_size = dims.tp, dims.pp
        self.context_parallel_size, self.expert_model_parallel_size = dims.cp, dims.ep
        self.expert_tensor_parallel_size = dims.etp if dims.etp != dims.tp else None
        self.num_virtual_stages_per_pipeline_rank = dims.vpp if dims.vpp > 1 else None
        self.num_distributed_optimizer_instances = dims.dp_instances

    def data_parallel_size(self, world_size: int) -> int:
        return self.dims(world_size).dp

    def pipeline_slots(self, num_layers: int) -> int:
        """Layers the pipeline split counts: transformer layers plus the embedding and/or
        the loss when ``--account-for-embedding/loss-in-pipeline-split`` (Megatron)."""
        return num_layers + int(self.account_for_embedding_in_pipeline_split) + \
            int(self.account_for_loss_in_pipeline_split)

    def virtual_stages(self, num_layers: Optional[int]) -> int:
        """VPP size (1 when not interleaving; a schedule with fixed chunks per rank, such as
        DualPipeV's 2, sets it unless a flag gives it)."""
        if self.num_virtual_stages_per_pipeline_rank:
            return self.num_virtual_stages_per_pipeline_rank
        if self.pipeline_model_parallel_layout:
            return virtual_stages_of(self.pipeline_model_parallel_layout, self.pp)
        if self.num_layers_per_virtual_pipeline_stage and num_layers:
            return self.pipeline_slots(num_layers) // (
                self.pp * self.num_layers_per_virtual_pipeline_stage)
        if self.pp > 1 and self.pipeline_schedule in SCHEDULES:
            return SCHEDULES[self.pipeline_schedule].chunks_per_rank or 1
        return 1

    @property
    def pipeline_vshape(self) -> bool:
        """The schedule places each rank's second chunk on the way back up (DualPipeV), so
        the embedding and the loss are both on pipeline rank 0."""
        return self.pp > 1 and self.pipeline_schedule in SCHEDULES and \
            SCHEDULES[self.pipeline_schedule].vshape
