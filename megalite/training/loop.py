"""The pretraining loop: data -> schedule (forward/backward) -> gradient sync -> AdamW.

Numerical contract (DESIGN.md §3): each micro-batch loss is divided by the number of loss
tokens in the whole *global* batch, gradients are then summed over data parallel, so the
update is the same whatever DP size, micro-batch size or pipeline schedule.
"""
from __future__ import annotations

import math
import os
import resource
import sys
import time

import torch

from megalite import comm
from megalite.distributed.data_parallel import build_data_parallel
from megalite.optimizer import LRScheduler
from megalite.parallel_state import ParallelState, initialize
from megalite.pipeline_parallel import get_forward_backward_func
from megalite.training.flops import device_peak_flops, flops_per_iteration
from megalite.training.metrics import TrainingLogger


class Trainer:
    """Everything one rank holds during training; built by ``setup``."""

    def __init__(self, cfg, state: ParallelState, device: str):
        self.cfg, self.state, self.device = cfg, state, device
        self.iteration = 0
        self.consumed_samples = 0
        self.tokenizer = None
        self.model_chunks = []
        self.strategy = None        # data-parallel strategy: gradients, reductions, step
        self.optimizer = None       # its optimizer (checkpointed state)
        self.scheduler = None
        self.train_ds = self.valid_ds = self.test_ds = None
        self.forward_backward = get_forward_backward_func(cfg, state)

    # -- construction ------------------------------------------------------------------
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
            return t.train_samples // t.global_batch_size
        return 0

    def setup(self):
        cfg = self.cfg
        from megalite.data import build_tokenizer

        d = cfg.data
        if d.tokenizer_type:
            self.tokenizer = build_tokenizer(d.tokenizer_type, d.tokenizer_model,
                                             cfg.model.vocab_size)
            if cfg.model.vocab_size is None:
                cfg.model.vocab_size = self.tokenizer.vocab_size
        self.model_chunks = build_model_chunks(cfg, self.state, self.device)
        self.strategy = build_data_parallel(self.model_chunks, cfg, self.state)
        self.optimizer = self.strategy.optimizer
        self.scheduler = LRScheduler.from_config(cfg, self.train_iters)
        if cfg.checkpoint.load:
            from megalite.training.checkpoint import load_training_checkpoint

            load_training_checkpoint(self)
        self._build_data()

    def _build_data(self):
        from megalite.data import build_train_valid_test_datasets

        cfg, t = self.cfg, self.cfg.training
        gbs = t.global_batch_size
        evals = (self.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters else 0
        num_samples = (self.train_iters * gbs, evals * gbs, t.eval_iters * gbs)
        self.train_ds, self.valid_ds, self.test_ds = build_train_valid_test_datasets(
            data_path=cfg.data.data_path, split=cfg.data.split, seq_length=cfg.model.seq_length,
            seed=t.seed, num_samples=num_samples, mock=cfg.data.mock_data,
            vocab_size=cfg.model.vocab_size, cache_dir=cfg.data.data_cache_path,
            eod_token=getattr(self.tokenizer, "eod", None), eod_mask_loss=cfg.data.eod_mask_loss,
            sample_windows=cfg.data.sample_windows)

    def data_iterator(self, dataset, consumed: int, cyclic: bool = False):
        from megalite.data import build_data_iterator

        t, dp = self.cfg.training, self.state["dp"]
        return build_data_iterator(dataset, consumed, t.micro_batch_size, t.global_batch_size,
                                   dp.rank, dp.size, cyclic=cyclic)

    # -- one iteration -----------------------------------------------------------------
    def _next_batches(self, iterator) -> list:
        batches = [next(iterator) for _ in range(self.cfg.num_micro_batches)]
        return [{k: v.to(self.device) for k, v in b.items()} for b in batches]

    def _global_tokens(self, batches) -> torch.Tensor:
        n = torch.zeros(1, dtype=torch.float64, device=self.device)
        for b in batches:
            n += b["loss_mask"].sum()
        comm.all_reduce(n, self.state["dp-cp"])
        return n

    def _run_schedule(self, batches, forward_only: bool):
        denom = self._global_tokens(batches)

        def forward_step(batch, model):
            output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"])

            def loss_func(per_token_loss):
                mask = batch["loss_mask"].to(per_token_loss.dtype)
                total = (per_token_loss.float() * mask).sum()
                return total / denom.to(total.dtype), {"loss_sum": total.detach()}

            return output, loss_func

        reports = self.forward_backward(forward_step, batches, self.model_chunks, self.state,
                                        self.cfg, forward_only=forward_only)
        loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        if reports:
            loss += sum(r["loss_sum"].double() for r in reports)
        comm.all_reduce(loss, self.state["dp-cp"])
        return (loss / denom).item()

    def train_step(self, iterator) -> dict:
        for chunk in self.model_chunks:
            chunk.train()
        batches = self._next_batches(iterator)
        self.strategy.zero_grad()
        loss = self._run_schedule(batches, forward_only=False)
        self.strategy.finish_grad_sync()
        lr = self.scheduler.lr(self.iteration + 1)
        grad_norm = self.strategy.step(lr)
        self.iteration += 1
        self.consumed_samples += self.cfg.training.global_batch_size
        return {"lm_loss": loss, "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self, dataset, iters: int) -> float:
        for chunk in self.model_chunks:
            chunk.eval()
        iterator = self.data_iterator(dataset, 0, cyclic=True)  # same batches every eval
        losses = [self._run_schedule(self._next_batches(iterator), forward_only=True)
                  for _ in range(iters)]
        return sum(losses) / max(len(losses), 1)

    # -- the loop ----------------------------------------------------------------------
    def train(self, logger: TrainingLogger):
        cfg, t = self.cfg, self.cfg.training
        iterator = self.data_iterator(self.train_ds, self.consumed_samples)
        flops = flops_per_iteration(cfg)
        peak, peak_src = device_peak_flops(self.device)
        logger.info(f"> training {self.train_iters} iterations; model FLOPs/iteration "
                    f"{flops:.3e}; device peak {peak / 1e12:.3f} TFLOP/s ({peak_src})")
        world = self.cfg.world_size
        while self.iteration < self.train_iters:
            t0 = time.perf_counter()
            out = self.train_step(iterator)
            elapsed = time.perf_counter() - t0
            tokens = t.global_batch_size * cfg.model.seq_length
            record = {"iteration": self.iteration, "train_iters": self.train_iters,
                      "consumed_samples": self.consumed_samples, **out,
                      "elapsed_ms": 1000 * elapsed, "tokens_per_sec": tokens / elapsed,
                      "tflops_per_device": flops / elapsed / world / 1e12,
                      "mfu": flops / elapsed / world / peak,
                      "peak_mem_bytes": peak_memory_bytes(self.device)}
            logger.log_train(record)
            if not math.isfinite(out["lm_loss"]):
                raise FloatingPointError(f"loss is {out['lm_loss']} at iteration {self.iteration}")
            if t.eval_interval and t.eval_iters and self.iteration % t.eval_interval == 0 and \
                    self.iteration < self.train_iters:
                logger.log_eval(self.iteration, self.evaluate(self.valid_ds, t.eval_iters))
            if cfg.checkpoint.save and cfg.checkpoint.save_interval and \
                    self.iteration % cfg.checkpoint.save_interval == 0:
                self.save()
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                break

    def save(self):
        from megalite.training.checkpoint import save_training_checkpoint

        save_training_checkpoint(self)


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


def build_model_chunks(cfg, state, device):
    """This rank's model chunks: one per virtual pipeline stage (one without PP)."""
    torch.manual_seed(cfg.training.seed)
    if state.pp.size == 1:
        from megalite.models.gpt import build_model

        chunks = [build_model(cfg, state)]
    else:
        from megalite.pipeline_parallel.stages import build_model_chunks as build_stages

        chunks = build_stages(cfg, state)
    dtype = torch.bfloat16 if cfg.optimizer.bf16 else torch.float32
    return [c.to(device=device, dtype=dtype) for c in chunks]


def pretrain(cfg) -> int:
    """Entry from pretrain_gpt.py after validation."""
    from megalite.parallel_state import pick_device_and_backend

    device, _ = pick_device_and_backend(cfg.training.device, cfg.parallel.distributed_backend)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(cfg.world_size, 1)))
    state = initialize(cfg)
    trainer = Trainer(cfg, state, device)
    trainer.setup()
    logger = TrainingLogger(cfg, trainer.is_writer, trainer.train_iters, trainer.iteration)
    t = cfg.training
    try:
        if not t.skip_train:
            trainer.train(logger)
            if cfg.checkpoint.save:
                trainer.save()
                logger.info(f"> saved checkpoint at iteration {trainer.iteration} to "
                            f"{cfg.checkpoint.save}")
        if t.eval_iters:
            logger.log_eval(trainer.iteration, trainer.evaluate(trainer.valid_ds, t.eval_iters))
        if cfg.logging.loss_plot and trainer.is_writer and cfg.logging.metrics_file:
            from megalite.viz.loss_curve import plot_loss_curve

            plot_loss_curve(cfg.logging.metrics_file, cfg.logging.loss_plot)
            logger.info(f"> wrote loss curve to {cfg.logging.loss_plot}")
    finally:
        logger.close()
        comm.barrier()
    return 0
