"""The pretraining loop: data -> schedule (forward/backward) -> gradient sync -> AdamW.

Numerical contract (docs/architecture.md#numerical-contract): each micro-batch loss is divided
by the number of loss tokens in the whole *global* batch, gradients are then summed over data
parallel, so the update is the same whatever DP size, micro-batch size or pipeline schedule;
the one loss-reduction policy that says so is ``transformer/loss_reduction.py``.

The loop is model-agnostic: a ``ModelFamily`` (``models/family.py``; GPT's is
``models/gpt_step.py``) builds the chunks and supplies ``get_batch`` and ``forward_step``.
The config is never mutated: values derived at setup (the tokenizer's vocabulary size)
live in the Trainer's resolved copy, ``trainer.cfg``.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import resource
import sys
import time

import torch

from megalite import comm
from megalite.backends.selection import describe_backend, resolve_backend_config
from megalite.checkpointing.checkpoint_io_policy import newest_complete
from megalite.cli import compat_flags
from megalite.cli.boundary import leave_for_peer_error
from megalite.config import ConfigError
from megalite.config.megatron_fsdp import describe as describe_megatron_fsdp
from megalite.data import (build_data_iterator, build_tokenizer_from_config,
                           build_train_valid_test_datasets)
from megalite.data.device_prefetch import prefetch_to_device
from megalite.diagnostics import hang_dumps
from megalite.comm.flight_recorder import site
from megalite.distributed.data_parallel import build_data_parallel
from megalite.elastic.resume import load_resume_state, resume_source
from megalite.elastic.snapshot import Snapshotter, snapshot_interval
from megalite.errors import Interrupted
from megalite.config.microbatches import BatchSizeSchedule
from megalite.models.family import ModelFamily, StepContext
from megalite.models.gpt_step import GPT_FAMILY
from megalite.models.parallelize import attach_data_parallel
from megalite.checkpointing.resume_schedule import scheduler_for_run
from megalite.data.position import DataPosition
from megalite.config.data_flags import blend_weight_note
from megalite.optimizer.lr_schedule import SchedulePosition
from megalite.optimizer.qk_clip import clip_qk
from megalite.parallel_state import ParallelState, initialize, pick_device_and_backend, usable_cores
from megalite.pipeline_parallel import get_forward_backward_func
from megalite.pipeline_parallel.schedules import NO_PIPELINING, pipeline_schedule_name
from megalite.pipeline_parallel.timeline import record_iteration
from megalite.planner.model_spec import active_params, total_params
from megalite.checkpointing import checkpoint, train_state
from megalite.transformer.attention_masks import mark_documents
from megalite.training.faults import ExitWatcher, check_finite
from megalite.transformer.loss_reduction import (extra_term_scale, global_loss_tokens,
                                                 reduce_extra_terms, reduce_lm_loss)
from megalite.training.flops import (device_peak_flops, flops_per_iteration,
                                     model_flops_utilization)
from megalite.training.memory_report import MemoryReporter
from megalite.training.metrics import TrainingLogger
from megalite.training.precision import log_precision, resolve_precision
from megalite.viz.loss_curve import plot_loss_curve


class Trainer:
    """Everything one rank holds during training; built by ``setup``."""

    def __init__(self, cfg, state: ParallelState, device: str,
                 family: ModelFamily = GPT_FAMILY):
        self.cfg, self.state, self.device, self.family = cfg, state, device, family
        # the loop's counters, each a Stateful part of the training state (train_state.py):
        # iterations and samples read per split; how far the lr schedule lags behind them
        # (--fp16 steps skipped on overflow: Megatron steps its scheduler on updates only)
        self.position = DataPosition()
        self.schedule_position = SchedulePosition()
        t = cfg.training
        self.batch_sizes = BatchSizeSchedule.of_run(t, state["dp"].size, cfg.model.seq_length)
        self.tokenizer = None
        self.model_chunks = []
        self.strategy = None        # data-parallel strategy: gradients, reductions, step
        self.scheduler = None
        self.train_ds = self.valid_ds = self.test_ds = None
        self.dataset_sizes = (0, 0, 0)      # samples each split is built for (_build_data)
        self.forward_backward = get_forward_backward_func(cfg, state)
        self.record_timeline = bool(cfg.logging.pipeline_timeline) and (
            state.pp.size > 1 or cfg.parallel.overlap_grad_reduce)   # schedule / DP buckets
        self._timeline_events = None       # this step's schedule events, recorded after sync
        self.exit_reason = ""       # set when a signal or the clock ended training early
        self.pending_save = None    # a checkpoint still being written (--async-save)
        self.snapshotter = None     # in-memory peer snapshots (--snapshot-interval)
        # start-up memory report; ``pretrain`` starts it before ``setup`` (tensor meter on CPU)
        self.memory_reporter = MemoryReporter(device)

    # -- construction ------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.position.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.position.iteration = value

    @property
    def consumed_samples(self) -> int:
        """Training samples consumed (``position.consumed["train"]``)."""
        return self.position.consumed["train"]

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.position.consumed["train"] = value

    @property
    def skipped_samples(self) -> int:
        return self.schedule_position.skipped_samples

    @property
    def optimizer(self):
        """The strategy's optimizer: the state checkpoints save (the loop itself only talks
        to the strategy)."""
        return None if self.strategy is None else self.strategy.optimizer

    @property
    def is_writer(self) -> bool:
        s = self.state
        return s.is_last_stage(ignore_virtual=True) and s.tp.rank == 0 and \
            s.cp.rank == 0 and s.dp.rank == 0

    @property
    def train_iters(self) -> int:
        t = self.cfg.training
        if t.train_iters is not None:
            return t.train_iters
        if t.train_samples is not None:
            return self.batch_sizes.train_iters(t.train_samples)
        return 0

    def setup(self):
        if self.tokenizer is None:       # pretrain() builds it before any process group
            self.tokenizer = build_tokenizer_from_config(self.cfg.data, self.cfg.model.vocab_size)
        self.cfg = cfg = resolve_config(self.cfg, self.tokenizer)
        if cfg.optimizer.disable_bf16_reduced_precision_matmul:     # a cuBLAS setting
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.manual_seed(cfg.training.seed)       # draws outside the name-seeded init
        self.model_chunks = self.family.build_model_chunks(cfg, self.state, self.device)
        self.strategy = attach_data_parallel(
            self.model_chunks, build_data_parallel(self.model_chunks, cfg, self.state))
        # evaluation (--skip-train) takes no optimizer flags: no --lr, no schedule
        self.scheduler = None if cfg.training.skip_train else \
            scheduler_for_run(cfg, self.train_iters)   # --use-checkpoint-opt_...
        if cfg.checkpoint.save:             # a bad --save fails now, not at the first save
            checkpoint.preflight_save_dir(cfg.checkpoint.save)
        source = resume_source(cfg)            # --load, or this run's own newest state
        if source is not None:
            load_resume_state(self, source)
        self._build_data()

    def _build_data(self):
        cfg, t = self.cfg, self.cfg.training
        gbs = t.global_batch_size
        evals = (self.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters else 0
        # Megatron builds the training set for --train-samples as given (the loop then runs
        # train_samples // global batch iterations): more epochs change every sample's order
        train = max(t.train_samples, self.batch_sizes.samples_in(self.train_iters)) \
            if t.train_samples else self.train_iters * gbs     # a step may end past it
        num_samples = (train, evals * gbs, t.eval_iters * gbs)
        self.dataset_sizes = num_samples
        self.train_ds, self.valid_ds, self.test_ds = build_train_valid_test_datasets(
            data_path=cfg.data.data_path, split=cfg.data.split, seq_length=cfg.model.seq_length,
            seed=t.seed, num_samples=num_samples, mock=cfg.data.mock_data,
            vocab_size=cfg.model.vocab_size, cache_dir=cfg.data.data_cache_path,
            eod_token=getattr(self.tokenizer, "eod", None), eod_mask_loss=cfg.data.eod_mask_loss,
            sample_windows=cfg.data.sample_windows,
            per_split_data_path=cfg.data.per_split_data_path())

    def data_iterator(self, dataset, consumed: int, cyclic: bool = False):
        t, dp = self.cfg.training, self.state["dp"]
        ramp = None if cyclic else self.batch_sizes.global_batch_size_at   # eval: full batch
        return build_data_iterator(dataset, consumed, t.micro_batch_size, t.global_batch_size,
                                   dp.rank, dp.size, cyclic=cyclic, batch_size_at=ramp)

    # -- one iteration -----------------------------------------------------------------
    def _next_batches(self, iterator, num_micro_batches=None) -> list:
        """This rank's micro-batches of one iteration, as the model family's ``get_batch``
        shapes them (where CP slices the sequence)."""
        raw = [next(iterator) for _ in range(num_micro_batches or self.cfg.num_micro_batches)]
        d = self.cfg.data
        if d.reset_position_ids or d.reset_attention_mask:   # documents of packed samples
            # rule "documents need a tokenizer" (cli/features.py): every tokenizer has an eod
            raw = [mark_documents(b, self.tokenizer.eod, d.reset_position_ids,
                                  d.reset_attention_mask) for b in raw]
        return [self.family.get_batch(b, self.state, self.device) for b in raw]

    def _step_context(self, batches) -> StepContext:
        names = tuple(self.family.extra_loss_names(self.cfg))
        return StepContext(num_loss_tokens=global_loss_tokens(batches, self.state, self.device),
                           extra_loss_names=names,
                           extra_loss_scale=extra_term_scale(len(batches), self.state),
                           grad_scale=self.strategy.loss_scale if self.strategy else 1.0)

    def _run_schedule(self, batches, forward_only: bool):
        """(mean loss over the global batch's tokens, {extra loss name: value} in training)."""
        site.phase = "loss tokens"          # flight recorder call sites: the loop's phase
        ctx = self._step_context(batches)
        denom = ctx.num_loss_tokens
        events = [] if self.record_timeline and not forward_only else None
        site.phase = "eval" if forward_only else "forward-backward"
        reports = self.forward_backward(functools.partial(self.family.forward_step, ctx=ctx),
                                        batches, self.model_chunks, self.state, self.cfg,
                                        forward_only=forward_only, events=events)
        self._timeline_events = events      # recorded after finish_grad_sync (buckets)
        site.phase = "loss"
        loss = reduce_lm_loss([r["loss_sum"] for r in reports or ()], denom, self.state,
                              self.device)
        extra = {} if forward_only else reduce_extra_terms(
            ctx.extra_loss_sums, ctx.extra_loss_names, ctx.extra_loss_scale, self.state)
        return loss, extra

    def train_step(self, iterator) -> dict:
        for chunk in self.model_chunks:
            chunk.train()
        site.iteration, site.phase = self.iteration + 1, "batch"
        gbs = self.batch_sizes.global_batch_size_at(self.consumed_samples)
        batches = self._next_batches(iterator, self.batch_sizes.num_micro_batches_at(
            self.consumed_samples))
        self.strategy.zero_grad()
        loss, extra_losses = self._run_schedule(batches, forward_only=False)
        site.phase = "grad sync"
        self.strategy.finish_grad_sync()
        if self._timeline_events is not None:     # a collective over pp: every stage records
            sched = self.strategy.scheduler
            record_iteration(self.cfg, self.state, self._timeline_events,
                             pipeline_schedule_name(self.cfg, self.state)
                             if self.state.pp.size > 1 else NO_PIPELINING,
                             sched.trace if sched is not None else ())
            self._timeline_events = None
        # Megatron's order: the update uses the lr (and weight decay) of the samples consumed
        # before it; then the schedule advances by this iteration's samples -- unless --fp16
        # skipped the update (grad_norm None), as Megatron's scheduler steps on updates only.
        settings = self.scheduler.settings_at(self.consumed_samples - self.skipped_samples)
        site.phase = "optimizer"
        grad_norm = self.strategy.step(settings)
        qk = {} if not self.cfg.model.qk_clip else {   # MuonClip, after the update
            "max_attention_logit": clip_qk(self.model_chunks, self.strategy, self.state,
                                           self.cfg.model, clip=grad_norm is not None)}
        site.phase = "after step"
        lr = settings.lr
        metrics = self.family.after_train_step(self.model_chunks, self.cfg, self.state)
        site.phase = "between iterations"
        self.iteration += 1
        self.consumed_samples += gbs
        if grad_norm is None:
            self.schedule_position.skip(gbs)
        out = {"lm_loss": loss, "lr": lr, "grad_norm": grad_norm, **extra_losses, **metrics,
               **qk}
        if self.strategy.grad_scaler is not None:   # Megatron's "loss scale" (after update)
            out.update(loss_scale=self.strategy.loss_scale, skipped_iter=int(grad_norm is None))
        if self.batch_sizes.varies:
            out["global_batch_size"] = gbs
        return out

    def loop_state(self) -> dict:
        """What a checkpoint's ``extra.loop_state`` says (read-only view of the parts): the
        lr schedule's lag behind the consumed samples and the fp16 loss scaler."""
        scaler = self.strategy.grad_scaler if self.strategy else None
        return {**self.schedule_position.state_dict(),
                "grad_scaler": scaler.state_dict() if scaler is not None else None}

    @torch.no_grad()
    def evaluate(self, dataset, iters: int, split: str = "valid") -> float:
        for chunk in self.model_chunks:
            chunk.eval()
        iterator = self.data_iterator(dataset, 0, cyclic=True)  # same batches every eval
        losses = [self._run_schedule(self._next_batches(iterator), forward_only=True)[0]
                  for _ in range(iters)]
        self.position.consumed[split] += iters * self.cfg.training.global_batch_size
        self.strategy.after_forward_only(self.model_chunks)
        return sum(losses) / max(len(losses), 1)

    # -- the loop ----------------------------------------------------------------------
    def train(self, logger: TrainingLogger):
        cfg, t = self.cfg, self.cfg.training
        if self.iteration >= self.train_iters:     # resumed from the run's final checkpoint
            logger.info(f"> nothing to train: the checkpoint is at iteration {self.iteration} "
                        f"of {self.train_iters}")
            return

        # CUDA: pinned copies of the next micro-batches in a background thread; CPU: as is
        iterator = prefetch_to_device(self.data_iterator(self.train_ds, self.consumed_samples),
                                      self.device)
        flops = flops_per_iteration(cfg)
        peak, peak_src = device_peak_flops(self.device)
        logger.info(f"> training {self.train_iters} iterations; model FLOPs/iteration "
                    f"{flops:.3e}; device peak {peak / 1e12:.3f} TFLOP/s ({peak_src})")
        world = self.cfg.world_size
        c = cfg.checkpoint
        watcher = ExitWatcher(c.exit_signal_handler, c.exit_duration_in_mins)
        first, start = self.iteration, time.perf_counter()
        every = snapshot_interval(cfg)
        self.snapshotter = Snapshotter(self, every) if every else None
        trained = False
        try:
            self._train_iterations(logger, iterator, flops, peak, world, watcher)
            trained = True
        finally:
            watcher.close()
            if hasattr(iterator, "close"):
                iterator.close()
            if self.snapshotter is not None and trained:   # a failure: a peer may be gone
                self.snapshotter.close(completed=self.iteration >= self.train_iters)
        logger.info(f"> training loop: {self.iteration - first} iterations in "
                    f"{time.perf_counter() - start:.3f} s")

    def _train_iterations(self, logger, iterator, flops, peak, world, watcher):
        cfg, t = self.cfg, self.cfg.training
        while self.iteration < self.train_iters:
            t0 = time.perf_counter()
            with self.memory_reporter.step(self.iteration + 1):
                out = self.train_step(iterator)
            elapsed = time.perf_counter() - t0
            snap = self.snapshotter
            stall = snap.maybe_take() if snap is not None else None   # after the step
            if stall is not None:
                out["snapshot_stall_ms"] = 1000 * stall
                for line in snap.lines:
                    logger.info(line)
                snap.lines.clear()
            gbs = out.get("global_batch_size", t.global_batch_size)
            tokens = gbs * cfg.model.seq_length
            flops_now = flops * gbs / t.global_batch_size      # ramp: this batch's FLOPs
            record = {"iteration": self.iteration, "train_iters": self.train_iters,
                      "consumed_samples": self.consumed_samples, **out,
                      "elapsed_ms": 1000 * elapsed, "tokens_per_sec": tokens / elapsed,
                      "tflops_per_device": flops_now / elapsed / world / 1e12,
                      "mfu": model_flops_utilization(flops_now / elapsed / world, peak),
                      "peak_mem_bytes": peak_memory_bytes(self.device)}
            logger.log_train(record)
            if snap is not None and (self.iteration % cfg.logging.log_interval == 0 or
                                     self.iteration == self.train_iters):
                line = snap.stats.report()
                if line:
                    logger.info(f"> snapshot: iteration {self.iteration}: {line}")
            self.memory_reporter.after_step(logger, cfg, self.state.rank, self.iteration,
                                            self.iteration == self.train_iters,
                                            record["peak_mem_bytes"],   # planner vs measured
                                            quiesce=self.join_background_writers)
            check_finite(out["lm_loss"], out["grad_norm"], self.iteration, self.state.rank,
                         cfg.checkpoint.check_for_nan_in_loss_and_grad)
            if t.eval_interval and t.eval_iters and self.valid_ds is not None and \
                    self.iteration % t.eval_interval == 0 and self.iteration < self.train_iters:
                logger.log_eval(self.iteration, self.evaluate(self.valid_ds, t.eval_iters),
                                consumed_samples=self.consumed_samples)
            if cfg.checkpoint.save and cfg.checkpoint.save_interval and \
                    self.iteration % cfg.checkpoint.save_interval == 0:
                logger.flush_metrics()     # the file holds every record the checkpoint has
                self.save()
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                break
            if watcher.should_exit():      # collective: every rank stops at this iteration
                self.exit_reason = watcher.reason
                logger.info(f"> {watcher.reason}: saving at iteration {self.iteration} "
                            f"and exiting")
                break

    def save(self):
        site.phase = "checkpoint"
        self.finish_saves()                 # the previous --async-save first
        _, self.pending_save = checkpoint.save(train_state.training_state(self),
                                               self.cfg.checkpoint, self.iteration)

    def finish_saves(self):
        """Wait until a background (--async-save) checkpoint is complete on disk."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.wait()

    def join_background_writers(self):
        """Wait for the threads that write beside training: the --async-save checkpoint
        and the peer snapshot."""
        self.finish_saves()
        if self.snapshotter is not None:
            self.snapshotter.wait()

    def load_checkpoint(self):
        """Resume from ``--load`` (``checkpoint.load``: the newest complete checkpoint)."""
        checkpoint.load(train_state.training_state(self), self.cfg.checkpoint)


def peak_memory_bytes(device: str) -> int:
    """This process's peak memory: the CUDA allocator's, or on CPU the resident high-water mark.

    On Linux the CPU figure comes from ``VmHWM`` in /proc/self/status, not ``ru_maxrss``:
    ``ru_maxrss`` survives exec, so a rank started by a large parent (torchrun, a benchmark
    script) would report the parent's size as its own.
    """
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def set_cpu_threads(world_size: int) -> str:
    """torch's intra-op threads = usable cores / processes on this node (torchrun's
    LOCAL_WORLD_SIZE; the world size when it is absent), so co-located ranks do not
    oversubscribe the cores (an OpenMP barrier with more threads than cores stalls every op).
    Called before the first training op; returns the line the log prints."""
    cores = usable_cores()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    threads = max(1, cores // max(local, 1))
    torch.set_num_threads(threads)
    return (f"> torch threads per process: {threads} ({cores} usable cores / {local} "
            f"local process{'es' if local > 1 else ''})")


def describe_parameters(cfg, model_chunks) -> str:
    """Megatron's start-up "number of parameters" line: the whole model's count (the
    planner's exact count, which mirrors the model tensor by tensor) and this rank's."""
    mine = sum(getattr(p, "_local_tensor", p).numel() for c in model_chunks
               for p in c.parameters())
    total = total_params(cfg.model)
    active = f", {active_params(cfg.model):,} active per token" if cfg.model.num_experts else ""
    return f"> number of parameters: {total:,} in the model{active}; {mine:,} on this rank"


def interrupted_at(trainer):
    """Ctrl-C outside a save: one line saying where the run stood and what is kept."""
    return Interrupted(f"interrupted by Ctrl-C at iteration {trainer.iteration}; newest "
                       f"complete checkpoint: {newest_complete(trainer.cfg.checkpoint.save)}")


def resolve_config(cfg, tokenizer=None):
    """``cfg`` with the values derived from other inputs filled in, as a copy: the
    vocabulary size from the tokenizer when ``--vocab-size`` was not given."""
    if cfg.model.vocab_size is None and tokenizer is not None:
        model = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
        return dataclasses.replace(cfg, model=model)
    return cfg


def pretrain(cfg, family: ModelFamily = GPT_FAMILY) -> int:
    """Entry from pretrain_gpt.py after validation: ``family`` supplies the model and its
    step functions (Megatron's ``pretrain(..., model_provider, forward_step)``)."""
    device, _ = pick_device_and_backend(cfg.training.device, cfg.parallel.distributed_backend)
    if cfg.logging.logging_level is not None:     # --logging-level (Megatron's)
        logging.basicConfig(level=cfg.logging.logging_level)
    threads_line = set_cpu_threads(cfg.world_size) if device == "cpu" else ""
    backend_line = describe_backend(cfg.model.transformer_impl, device)
    cfg = resolve_backend_config(cfg, device)      # auto -> local | transformer_engine
    tokenizer = build_tokenizer_from_config(cfg.data, cfg.model.vocab_size)  # files: one line
    state = initialize(cfg)
    hang_dumps.start(cfg, state)             # flight recorder: rank, dump folder, watchdog
    comm.watch_user_errors(leave_for_peer_error)   # a peer's user error ends this rank too
    cfg, precision = resolve_precision(           # --precision auto / --bf16: probe matmuls
        cfg, state.world_group(), device)
    trainer = Trainer(cfg, state, device, family)
    trainer.tokenizer = tokenizer
    trainer.memory_reporter.start()          # before the model is built: count every tensor
    try:
        trainer.setup()
    except BaseException:
        trainer.memory_reporter.close(failed=True)
        raise
    cfg = trainer.cfg                        # resolved copy (vocabulary size from the tokenizer)
    logger = TrainingLogger(cfg, trainer.is_writer, trainer.train_iters, trainer.iteration)
    logger.info(backend_line)
    if threads_line:
        logger.info(threads_line)
    if cfg.accepted_flags:
        logger.info(compat_flags.describe(cfg.accepted_flags))
    if cfg.parallel.use_megatron_fsdp:
        logger.info(describe_megatron_fsdp(cfg))
    log_precision(logger, precision)
    logger.info(describe_parameters(cfg, trainer.model_chunks))
    logger.info("> datasets target sizes (minimum size): train {}, validation {}, test {}"
                .format(*trainer.dataset_sizes))          # Megatron's line
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        note = blend_weight_note(getattr(cfg.data, flag), "--" + flag.replace("_", "-"))
        if note:
            logger.info(f"> note: {note}")
    t = cfg.training
    failed = False
    try:
        if not t.skip_train:
            trainer.train(logger)
            if cfg.checkpoint.save:
                trainer.save()
                trainer.finish_saves()
        if trainer.exit_reason:              # preempted: the checkpoint is what matters
            return 0
        if t.eval_iters and trainer.valid_ds is not None:    # Megatron: no data, no eval
            logger.log_eval(trainer.iteration, trainer.evaluate(trainer.valid_ds, t.eval_iters),
                            consumed_samples=trainer.consumed_samples)
        if cfg.logging.loss_plot and trainer.is_writer and cfg.logging.metrics_file:
            plot_loss_curve(cfg.logging.metrics_file, cfg.logging.loss_plot)
            logger.info(f"> wrote loss curve to {cfg.logging.loss_plot}")
    except KeyboardInterrupt:
        failed = True
        raise interrupted_at(trainer) from None
    except BaseException:
        failed = True       # no final barrier: a peer may be stuck in p2p (the caller aborts)
        raise
    finally:
        trainer.memory_reporter.close(failed)
        logger.close()
        if not failed:
            comm.barrier()
            hang_dumps.stop()
            comm.stop_watching_user_errors()
    return 0
