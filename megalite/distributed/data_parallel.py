"""Data-parallel strategies: who owns the gradients, how they are reduced, and the step.

One interface (Megatron-Core's DDP wrapper + optimizer pair, as one object) so the loop
never reaches into optimizer internals and FSDP2 can be a third implementation:

    strategy.zero_grad()            before the micro-batches
    ... forward/backward ...
    strategy.finish_grad_sync()     every reduction a gradient needs
    norm = strategy.step(settings)  global norm, clip, update (the schedule's lr and decay),
                                    parameter sync

* ``DDPStrategy``: a gradient tensor per parameter (fp32 ``main_grad`` under bf16, ``.grad``
  in fp32), all-reduced over data parallel; ``MixedPrecisionOptimizer`` keeps whole masters.
* ``DistributedOptimizerStrategy`` (``--use-distributed-optimizer``): flat padded buffers per
  (DP group, dtype), reduce-scattered; ``DistributedOptimizer`` steps this rank's shard and
  the strategy all-gathers the parameters.  With ``--overlap-grad-reduce``: one buffer per
  bucket, and only the reduced shard of the gradient is kept (ZeRO-2).
* ``FSDP2Strategy`` (``--use-torch-fsdp2``): torch's ``fully_shard`` (ZeRO-3), with TP, PP,
  CP and EP, over chunks the parallelize step sharded; the strategy owns the step, not the
  sharding.

``--num-distributed-optimizer-instances R`` (hybrid sharding): the distributed optimizer and
FSDP2 shard over one instance of DP x CP / R neighbouring ranks ("dp-cp-shard") and
all-reduce the reduced shards over the other instances ("dp-cp-replicate"); experts alike
over expert-DP.

``--overlap-grad-reduce`` (DDP and distributed optimizer): gradients live in per-bucket
buffers whose reductions start during backward (``grad_buckets.OverlapScheduler``).

A strategy allocates its buffers and lists the hooks it needs (``grad_hooks``,
``forward_pre_hooks``) but touches no module: the parallelize step
(``models.parallelize.attach_data_parallel``) installs them, as it applies FSDP2.

The grad norm is per parameter class (``grad_sync.param_class``): dense squares summed over
TP x PP ("mp"), expert squares over expert-TP x EP x PP ("expert-mp"), then added -- each
distinct gradient element counted once.  The expert reduction runs only when the model has
experts (``--num-experts``), so every rank of the expert group takes part in it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from megalite import comm
from megalite.state_format.sharded_state import param_index
from megalite.distributed.distributed_optimizer import DistributedOptimizer
from megalite.distributed.grad_buckets import (Bucket, OverlapScheduler, bucket_size,
                                               split_into_buckets)
from megalite.distributed.grad_sync import (PARAM_CLASS_GROUPS, allreduce_data_parallel_grads,
                                            counts_toward_norm, dp_group_name,
                                            is_tied_embedding, param_class,
                                            reduce_model_parallel_grads)
from megalite.distributed.replicas import broadcast_tied_embeddings
from megalite.torch_classes import is_dtensor, is_fsdp_module
from megalite.distributed.sharded_buffer import ShardedBuffer, contiguous_runs
from megalite.optimizer.grad_scaler import build_grad_scaler, unscale_and_find_inf
from megalite.optimizer.lr_schedule import StepSettings
from megalite.optimizer.optimizer_state import OptimizerState
from megalite.optimizer.optimizer import (MasterWeightOptimizer, MixedPrecisionOptimizer,
                                          has_fp32_masters)
from megalite.param_spec import ParamSpec, group_coords, named_specs
from megalite.parallel_state import shard_group_names


def accumulate_main_grad(param) -> None:
    """bf16/fp16 post-accumulate hook: add this backward's gradient into the fp32 ``main_grad``
    (accumulation over micro-batches happens in fp32) and drop the bf16 one."""
    param.main_grad.add_(param.grad.float())
    param.grad = None


def add_into(buffer, view: torch.Tensor):
    """ZeRO-2 hook (any dtype): make sure ``buffer``'s full-size storage exists, add this
    backward's gradient into ``view`` and drop ``.grad`` (0 + g == g: the first micro-batch
    is exact, later ones accumulate as autograd would)."""
    def hook(p):
        buffer.ensure_full_grads()
        view.add_(p.grad)
        p.grad = None
    return hook


def needs_model_parallel_reduction(spec: ParamSpec, state) -> bool:
    """Sequence-parallel replicated params and PP-tied embeddings are summed over TP / the
    embedding group before DP: their bucket is reduced after those sums (deferred)."""
    return bool(spec.sequence_parallel) or (is_tied_embedding(spec) and state.pp.size > 1)


def keep_grad_in_buffer(view: torch.Tensor):
    """fp32 hook: autograd accumulates into ``.grad`` in place, i.e. into the buffer view.
    Should something have reset ``.grad`` (e.g. ``module.zero_grad()``), move the new
    gradient into the buffer instead of losing it."""
    def hook(p):
        if p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
            p.grad = view
    return hook


class DataParallelStrategy:
    """Owns the gradient storage of ``named_params`` (trainable only) and every reduction
    after backward; ``self.optimizer`` (a ``MasterWeightOptimizer``) updates the masters.

    ``specs`` maps each name to its ``ParamSpec`` (the model chunks' tables: which params
    are experts, sequence-parallel, tied, split over which group); a name it lacks is a
    plain replicated parameter.  ``self.specs`` is aligned with ``self.params``."""

    optimizer: MasterWeightOptimizer
    sharded_buffers: tuple = ()      # flat buffers whose DP reduction is a reduce-scatter
    # (param, post-accumulate-grad hook) pairs, in order, that the parallelize step installs:
    # how each backward's gradient enters this strategy's buffers
    grad_hooks: list

    def __init__(self, named_params, cfg, state, specs=None):
        # bf16 / fp16 params: gradients accumulate in an fp32 main_grad, fp32 masters step
        self.cfg, self.state, self.bf16 = cfg, state, has_fp32_masters(cfg.optimizer)
        self.grad_scaler = build_grad_scaler(cfg.optimizer)     # --fp16 only
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.params: List[torch.nn.Parameter] = [p for _, p in self.named]
        specs = specs or {}
        self.specs = [specs.get(n) or ParamSpec(tuple(p.shape)) for n, p in self.named]
        self._spec_of = {id(p): s for p, s in zip(self.params, self.specs)}
        self.coords = group_coords(state)
        self.grad_hooks = []
        self.classes = ["dense"] + (["expert"] if cfg.model.num_experts else [])
        strays = {n for (n, _), s in zip(self.named, self.specs)
                  if param_class(s) not in self.classes}
        if strays:
            raise ValueError(f"parameters {sorted(strays)} are marked as experts but the "
                             f"model has no --num-experts: their grad norm would be wrong")

    # -- gradients ---------------------------------------------------------------------
    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The tensor holding ``p``'s accumulated (after ``finish_grad_sync``: reduced)
        gradient."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    scheduler = None            # OverlapScheduler with --overlap-grad-reduce
    gathers_waited_in_forward = 0   # --overlap-param-gather: gathers a forward hook waited on

    def wait_param_gathers(self) -> None:
        """Finish parameter all-gathers still in flight (before reading parameters outside a
        forward: checkpoints, replica checks)."""

    def forward_pre_hooks(self, model_chunks) -> list:
        """(module, forward pre-hook) pairs the parallelize step installs (none here)."""
        return []

    def after_forward_only(self, model_chunks) -> None:
        """After forward passes with no backward (evaluation): leave parameters as a training
        step expects them."""

    def finish_grad_sync(self) -> None:
        """Every reduction a gradient needs after the last micro-batch's backward: SP
        replicated params over TP, tied embeddings over 'embedding', then data parallel.
        With --overlap-grad-reduce most buckets are in flight already: wait for them, then
        the model-parallel sums and the deferred buckets (``needs_model_parallel_reduction``)."""
        if self.scheduler is not None:
            deferred = [(p, s) for p, s in zip(self.params, self.specs)
                        if needs_model_parallel_reduction(s, self.state)]
            self.scheduler.finish(between=lambda: reduce_model_parallel_grads(
                [p for p, _ in deferred], self.grad, self.state, [s for _, s in deferred]))
            return
        reduce_model_parallel_grads(self.params, self.grad, self.state, self.specs)
        self._reduce_data_parallel()

    def _bucket_keys(self):
        """Per parameter: (DP group, dtype, deferred) -- params of one bucket share all three."""
        return [(dp_group_name(s), p.dtype, needs_model_parallel_reduction(s, self.state))
                for p, s in zip(self.params, self.specs)]

    def _start_overlap(self, buckets: List[Bucket], max_in_flight=None) -> None:
        names = {id(p): n for n, p in self.named}
        self.scheduler = OverlapScheduler(buckets, names, max_in_flight)
        # after each parameter's buffer hook: the scheduler counts what reached the buffer
        self.grad_hooks += [(p, self.scheduler.on_accumulated)
                            for b in buckets for p in b.params]

    def _reduce_data_parallel(self) -> None:
        raise NotImplementedError

    # -- norm and step -----------------------------------------------------------------
    def _local_squares(self, cls: str) -> torch.Tensor:
        """Sum of squares of this rank's counted gradient elements of class ``cls``, summed
        over every rank that holds the same elements' shards (DP for sharded buffers)."""
        raise NotImplementedError

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient, every element counted once."""
        total = None
        for cls in self.classes:
            sq = self._local_squares(cls)
            comm.all_reduce(sq, self.state[PARAM_CLASS_GROUPS[cls].norm])
            total = sq if total is None else total + sq
        return total.sqrt().item()

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without --fp16)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def _scaled_grads(self) -> List[torch.Tensor]:
        """The fp32 gradients this rank steps from (and counts in the norm): what the
        loss scale must be divided out of."""
        return [self.grad(p) for p in self.params]

    def unscale_and_check(self) -> bool:
        """--fp16: divide the loss scale out of the gradients and update the scaler; True
        when any rank's gradients overflowed (then the step is skipped everywhere, as
        Megatron-Core's ``MixedPrecisionOptimizer.prepare_grads``)."""
        found = unscale_and_find_inf(self._scaled_grads(), self.grad_scaler.inv_scale)
        found = found.to(self._device())
        if self.state.grid.world_size > 1:                      # every shard, every stage
            comm.all_reduce(found, self.state.world_group(), op="max")
        overflow = bool(found.item() > 0)
        self.grad_scaler.update(overflow)
        return overflow

    def step(self, settings: StepSettings) -> Optional[float]:
        """Clip by the global norm, update with ``settings`` (the lr schedule's lr and
        weight decay), sync parameter copies; returns the norm before clipping, or None when
        --fp16 found an overflow and skipped the step (parameters and optimizer state
        untouched)."""
        if self.grad_scaler is not None and self.unscale_and_check():
            return None
        norm = self.grad_norm()
        self.optimizer.step(settings, norm)
        self._sync_params()
        return norm

    def _sync_params(self) -> None:
        """Make every copy of a parameter equal after the update: the tied embedding's
        owner (first stage) broadcasts it (``replicas.broadcast_tied_embeddings``)."""
        broadcast_tied_embeddings(self.params, self.state, self.specs)

    # -- checkpoints -------------------------------------------------------------------
    def reload_model_params(self) -> None:
        self.wait_param_gathers()
        self.optimizer.reload_model_params()

    def state_part(self, model_chunks):
        """The optimizer and its fp32 masters as a DCP ``Stateful`` at global shapes
        (``megalite.optimizer.optimizer_state``), named by ``model_chunks``' tables."""
        return OptimizerState(self.optimizer, param_index(model_chunks), self.state,
                              before=self.wait_param_gathers)


class DDPStrategy(DataParallelStrategy):
    """Plain data parallelism: a whole gradient per parameter, all-reduced."""

    def __init__(self, named_params, cfg, state, specs=None):
        super().__init__(named_params, cfg, state, specs)
        self._views: Dict[int, torch.Tensor] = {}
        if cfg.parallel.overlap_grad_reduce:
            self._build_buckets()
        elif self.bf16:
            for p in self.params:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                self.grad_hooks.append((p, accumulate_main_grad))
        self.optimizer = MixedPrecisionOptimizer(self.named, cfg.optimizer, self.grad)

    def _build_buckets(self):
        """One flat gradient buffer per bucket; each parameter's gradient is a view of it."""
        size = bucket_size(self.cfg, self.state["dp-cp"].size)
        buckets, self.bucket_buffers = [], []
        for i, ((group, dtype, deferred), ps) in enumerate(
                split_into_buckets(self.params, self._bucket_keys(), size)):
            flat = torch.zeros(sum(p.numel() for p in ps),
                               dtype=torch.float32 if self.bf16 else dtype, device=ps[0].device)
            off = 0
            for p in ps:
                view = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
                self._views[id(p)] = view
                if self.bf16:
                    p.main_grad = view
                    self.grad_hooks.append((p, accumulate_main_grad))
                else:
                    p.grad = view
                    self.grad_hooks.append((p, keep_grad_in_buffer(view)))
            g = self.state[group]
            buckets.append(Bucket(i, ps, lambda flat=flat, g=g: comm.all_reduce_async(flat, g),
                                  deferred))
            self.bucket_buffers.append(flat)
        self._start_overlap(buckets)

    def grad(self, p):
        """``main_grad`` under bf16; ``.grad`` in fp32 (zeros if backward left none, so an
        unused parameter still takes part in the reduction and the update)."""
        if self.bf16:
            return p.main_grad
        if p.grad is None:
            p.grad = self._views[id(p)] if id(p) in self._views else torch.zeros_like(p)
        return p.grad

    def zero_grad(self):
        if self.scheduler is not None:
            for flat in self.bucket_buffers:
                flat.zero_()
            for p in self.params:
                if self.bf16:
                    p.grad = None
                elif p.grad is None or p.grad.data_ptr() != self._views[id(p)].data_ptr():
                    p.grad = self._views[id(p)]
            self.scheduler.start_step()
            return
        if self.bf16:       # one foreach call instead of a zero_ per parameter
            torch._foreach_zero_([p.main_grad for p in self.params])
        # fp32: no zeroing pass at all -- the first backward hands its gradient over
        # (autograd's AccumulateGrad steals it) instead of adding it into zeros, as torch's
        # ``zero_grad(set_to_none=True)``; 0 + g == g, so the values are the same
        for p in self.params:
            p.grad = None

    def _reduce_data_parallel(self):
        allreduce_data_parallel_grads(self.params, self.grad, self.state, self.specs)

    def _local_squares(self, cls):
        """One ``_foreach_norm`` over the counted gradients (fp32), then the sum of their
        squares: no per-parameter ``pow``/``sum`` and no fp32 copy of each gradient."""
        sq = torch.zeros(1, dtype=torch.float32, device=self._device())
        grads = [self.grad(p) for p, spec in zip(self.params, self.specs)
                 if param_class(spec) == cls and counts_toward_norm(spec, self.coords)]
        if grads:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            sq += torch.stack(norms).square().sum()
        return sq


class DistributedOptimizerStrategy(DataParallelStrategy):
    """Flat grad buffers reduce-scattered over DP; the optimizer steps this rank's shard;
    the updated shards are all-gathered back (docs/distributed_optimizer.md)."""

    def __init__(self, named_params, cfg, state, specs=None):
        super().__init__(named_params, cfg, state, specs)
        overlap = cfg.parallel.overlap_grad_reduce
        self.param_gathers: Dict[int, comm.Pending] = {}
        if overlap:     # one sharded buffer per bucket; ZeRO-2: only the shard is kept
            size = bucket_size(cfg, state["dp-cp"].size)
            groups = [((g, dt), ps, deferred) for (g, dt, deferred), ps in
                      split_into_buckets(self.params, self._bucket_keys(), size)]
        else:
            by_key: Dict[tuple, list] = {}
            for p, spec in zip(self.params, self.specs):
                by_key.setdefault((dp_group_name(spec), p.dtype), []).append(p)
            groups = [(key, ps, False) for key, ps in by_key.items()]
        self.sharded_buffers = [
            ShardedBuffer(ps, self._shard_groups(g)[0], torch.float32 if self.bf16 else dt,
                          keep_shard_only=overlap, replicate=self._shard_groups(g)[1])
            for (g, dt), ps, _ in groups]
        self._grad_of: Dict[int, torch.Tensor] = {}
        for buf in self.sharded_buffers:
            for p, view in zip(buf.params, buf.grad_views):
                self._grad_of[id(p)] = view
                if overlap:
                    p.grad = None
                    self.grad_hooks.append((p, add_into(buf, view)))
                elif self.bf16:
                    p.main_grad = view
                    self.grad_hooks.append((p, accumulate_main_grad))
                else:
                    p.grad = view
                    self.grad_hooks.append((p, keep_grad_in_buffer(view)))
        names = {id(p): n for n, p in self.named}
        self.optimizer = DistributedOptimizer(self.sharded_buffers, names, cfg.optimizer)
        if overlap:
            self._start_overlap([
                Bucket(i, buf.params, buf.start_reduce_scatter, deferred,
                       on_done=buf.release_full_grads)
                for i, (buf, (_, _, deferred)) in enumerate(zip(self.sharded_buffers, groups))],
                max_in_flight=2)
        # per buffer: the shard ranges [lo, hi) that count toward the grad norm
        self._norm_spans = []
        for buf in self.sharded_buffers:
            cls = param_class(self._spec_of[id(buf.params[0])])
            runs = contiguous_runs(
                buf.shard_ranges(), buf.shard_size,
                lambda p: p is not None and counts_toward_norm(self._spec_of[id(p)], self.coords))
            self._norm_spans.append((cls, buf, [(lo, hi) for lo, hi, c in runs if c]))

    def _shard_groups(self, dp_group: str) -> tuple:
        """(shard group, replicate group or None) for buffers of ``dp_group``: the group
        itself, or with --num-distributed-optimizer-instances its instance and the same
        shard's ranks in the other instances (Megatron's intra / inter partial DP)."""
        grid = "expert" if dp_group == "expert-dp" else "dense"
        shard, replicate = shard_group_names(grid, self.state.grid.dp_instances)
        return self.state[shard], (self.state[replicate] if replicate else None)

    def grad(self, p):
        """``p``'s view of its grad buffer (ZeRO-2: storage-less between the reduce-scatter
        and the next step's first gradient; the shard is in ``buf.grad_shard``)."""
        return self._grad_of[id(p)]

    def finish_grad_sync(self):
        self.wait_param_gathers()        # buckets no forward used: before the next update
        if self.scheduler is not None:   # deferred buckets are read before their reduction
            for b in self.scheduler.buckets:
                if b.deferred:
                    self.sharded_buffers[b.index].ensure_full_grads()
        super().finish_grad_sync()

    def zero_grad(self):
        if self.scheduler is not None:     # ZeRO-2: full buffers come back on first use
            for buf in self.sharded_buffers:
                buf.release_full_grads()
            for p in self.params:
                p.grad = None
            self.scheduler.start_step()
            return
        for buf in self.sharded_buffers:
            buf.grad_data.zero_()
        for p in self.params:
            if self.bf16:
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != self.grad(p).data_ptr():
                p.grad = self.grad(p)           # someone reset it: point it back

    def _reduce_data_parallel(self):
        for buf in self.sharded_buffers:
            buf.reduce_scatter_grads()

    def _scaled_grads(self):
        return [buf.grad_shard for buf in self.sharded_buffers]

    def _local_squares(self, cls):
        """Squares over this rank's shards of the class's buffers, summed over the class's
        DP group: the shards of all DP ranks together cover each element once."""
        sq = torch.zeros(1, dtype=torch.float32, device=self._device())
        mine = [(buf, spans) for c, buf, spans in self._norm_spans if c == cls]
        for buf, spans in mine:
            g = buf.grad_shard
            for lo, hi in spans:
                sq += g[lo:hi].float().pow(2).sum()
        if mine:        # the shard group's members hold the same parameters: all or none
            comm.all_reduce(sq, mine[0][0].group)
        return sq

    def _sync_params(self):       # the all-gathers run inside each shard group (instance)
        if not self.cfg.parallel.overlap_param_gather:
            for buf in self.sharded_buffers:
                buf.all_gather_params()
            super()._sync_params()
            return
        # --overlap-param-gather: bucket k's gather is waited on by the forward pre-hook of
        # the first module that uses it (``forward_pre_hooks``)
        self.param_gathers = {i: buf.start_all_gather_params()
                              for i, buf in enumerate(self.sharded_buffers)}
        tied = {i for i, buf in enumerate(self.sharded_buffers)
                for p in buf.params if is_tied_embedding(self._spec_of[id(p)])}
        for i in tied:              # the owner's broadcast below overwrites the copy
            self._wait_param_gather(i)
        super()._sync_params()

    def _wait_param_gather(self, index: int, in_forward: bool = False) -> None:
        pending = self.param_gathers.pop(index, None)
        if pending is not None:
            pending.wait()
            self.gathers_waited_in_forward += int(in_forward)

    def wait_param_gathers(self) -> None:
        for i in list(self.param_gathers):
            self._wait_param_gather(i)

    def forward_pre_hooks(self, model_chunks) -> list:
        """--overlap-param-gather: a forward pre-hook on every module that owns parameters,
        waiting for the gathers of the buckets holding them (the first forward use of each
        bucket)."""
        if not self.cfg.parallel.overlap_param_gather:
            return []
        index = {id(p): i for i, buf in enumerate(self.sharded_buffers) for p in buf.params}
        hooks = []
        for chunk in model_chunks:
            for module in chunk.modules():
                mine = sorted({index[id(p)] for p in module.parameters(recurse=False)
                               if id(p) in index})
                if mine:
                    hooks.append((module, lambda _m, _args, mine=mine: [
                        self._wait_param_gather(i, True) for i in mine] and None))
        return hooks


class FSDP2Strategy(DataParallelStrategy):
    """ZeRO-3 through torch FSDP2 (``megalite.distributed.fsdp2``): parameters (DTensor
    shards over DP x CP, experts over expert-DP; HSDP: inside an instance), gradients and
    optimizer states are all 1/DP per rank.  FSDP reduce-scatters each unit's gradients
    during backward (with PP: after each chunk's last backward, ``pipeline_parallel.
    fsdp_sync``); ``finish_grad_sync`` adds, on the local shards, the sequence-parallel sums
    over TP and the PP-tied embedding's sum over the first and last stage (every TP rank,
    and both stages, shard alike: the same DP x CP position holds the same rows)."""

    def __init__(self, named_params, cfg, state, specs=None):
        super().__init__(named_params, cfg, state, specs)
        # the fp32 shards are the masters (bf16/fp16 live in FSDP's compute copies only)
        optim = dataclasses.replace(cfg.optimizer, bf16=False, fp16=False)
        self.optimizer = MixedPrecisionOptimizer(self.named, optim, self.grad)

    def grad(self, p):
        """The sharded gradient (a DTensor; zeros if backward left none)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad

    @staticmethod
    def local_grad(p):
        return None if p.grad is None else p.grad.to_local()

    def _scaled_grads(self):
        return [g for g in (self.local_grad(p) for p in self.params) if g is not None]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def after_forward_only(self, model_chunks) -> None:
        """FSDP2 keeps the root unit gathered after its forward, for the backward; an
        evaluation has none, so reshard every unit: the model's parameters are the sharded
        DTensors again (the optimizer's, the checkpoint's)."""
        for chunk in model_chunks:
            for m in chunk.modules():
                if is_fsdp_module(m):
                    m.reshard()

    def finish_grad_sync(self):
        for p in self.params:           # a tied copy / replicated param that saw no
            self.grad(p)                # gradient still joins its group's sums
        reduce_model_parallel_grads(self.params, self.local_grad, self.state, self.specs)

    def _local_squares(self, cls):
        """Squares of this rank's shards of counted parameters, summed over the group that
        shards them (DP x CP / expert-DP; HSDP: the instance) -- those shards cover each
        element once; the base class adds TP x PP."""
        sq = torch.zeros(1, dtype=torch.float32, device=self._device())
        for p, spec in zip(self.params, self.specs):
            if param_class(spec) == cls and counts_toward_norm(spec, self.coords):
                g = self.local_grad(p)
                if g is not None:
                    sq += g.float().pow(2).sum()
        comm.all_reduce(sq, self.state[shard_group_names(
            "expert" if cls == "expert" else "dense", self.state.grid.dp_instances)[0]])
        return sq


def build_data_parallel(model_chunks, cfg, state) -> DataParallelStrategy:
    """The strategy for ``cfg``: ``FSDP2Strategy`` with --use-torch-fsdp2 (over chunks the
    parallelize step fully sharded), ``DistributedOptimizerStrategy`` with
    --use-distributed-optimizer, else ``DDPStrategy``.  Its hooks are not installed yet:
    ``models.parallelize.attach_data_parallel`` does."""
    triples = named_specs(model_chunks)      # FQNs are unique over a rank's chunks
    named = [(n, p) for n, p, _ in triples]
    specs = {n: spec for n, _, spec in triples}
    if len(specs) != len(triples):
        raise ValueError("parameter names repeat across this rank's model chunks")
    if cfg.parallel.use_torch_fsdp2:
        if not all(is_dtensor(p) for _, p in named):
            raise ValueError("--use-torch-fsdp2: the model chunks were not fully sharded; build "
                             "them through the model family's parallelize step")
        strategy = FSDP2Strategy(named, cfg, state, specs)
    elif cfg.parallel.use_distributed_optimizer:
        strategy = DistributedOptimizerStrategy(named, cfg, state, specs)
    else:
        strategy = DDPStrategy(named, cfg, state, specs)
    # --optimizer muon: each matrix orthogonalised whole, however this layout cuts it
    strategy.optimizer.use_whole_matrices(state, cfg.model, strategy._spec_of)
    return strategy
