"""What a person watches: a Megatron-style console line, a progress bar on a terminal, a
JSONL metrics file, TensorBoard and Weights & Biases.  Only the writer rank (last pipeline
stage, first TP/CP/DP rank -- the rank that holds the loss) writes anything."""
from __future__ import annotations

import json
import math
import os
import sys
import time

from tqdm import tqdm

from megalite.training.memory_report import format_memory_report



def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _extra_loss_summary(record: dict) -> str:
    """MTP depths' losses (Megatron's "mtp_1 loss"), MoE terms and the worst layer's max/mean
    tokens per expert (per layer: metrics file)."""
    mtp = sorted((k for k in record if k.startswith("mtp_") and k.endswith("_loss")),
                 key=lambda k: int(k.split("_")[1]))
    parts = [f" | {k[:-len('_loss')]} loss: {record[k]:.6E}" for k in mtp]
    parts += [f" | {k.replace('_', ' ')}: {record[k]:.6E}" for k in ("moe_aux_loss", "moe_z_loss")
              if k in record]
    if "moe_load_balance" in record:
        parts.append(f" | moe load max/mean: {record['moe_load_balance']:.3f}")
    return "".join(parts)


class TrainingLogger:
    def __init__(self, cfg, is_writer: bool, total_iters: int, start_iter: int = 0):
        self.cfg, self.is_writer = cfg, is_writer
        lg = cfg.logging
        self.metrics = self.tb = self.wandb = self.bar = None
        self.skipped_since_log = 0     # --fp16 steps skipped since the last log line
        self._pending = []      # metrics-file lines not yet written (flushed per log line)
        if not is_writer:
            return
        if lg.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(lg.metrics_file)), exist_ok=True)
            self.metrics = open_metrics_file(lg.metrics_file, start_iter)
        if lg.tensorboard_dir:  # presence of the package was checked in validation
            # optional dependency: tensorboard (the tensorboard extra)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(lg.tensorboard_dir)
        if lg.wandb_project:
            # optional dependency: wandb
            import wandb

            mode = os.environ.get("WANDB_MODE") or (
                "online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name,
                                    config=cfg.to_dict(), mode=mode)
        if not lg.no_progress_bar and sys.stdout.isatty():
            self.bar = tqdm(total=total_iters, initial=start_iter, unit="it", dynamic_ncols=True)

    def _print(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def info(self, line: str):
        if self.is_writer:
            self._print(line)

    def log_train(self, record: dict):
        if not self.is_writer:
            return
        it = record["iteration"]
        if self.metrics:
            self._pending.append(json.dumps(record) + "\n")
        scalars = train_scalars(record, self.cfg.training.global_batch_size)
        if self.tb:
            for tag, value, step in scalars:
                self.tb.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log({tag: v for tag, v, step in scalars if step == it}, step=it)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['lm_loss']:.4f}")
        self.skipped_since_log += record.get("skipped_iter", 0)
        if it % self.cfg.logging.log_interval == 0 or it == 1:
            gbs = record.get("global_batch_size", self.cfg.training.global_batch_size)
            norm = record["grad_norm"]
            fp16 = "" if "loss_scale" not in record else (   # Megatron's fp16 fields
                f" | loss scale: {record['loss_scale']:.1f}"
                f" | number of skipped iterations: {self.skipped_since_log:>3d}")
            self.skipped_since_log = 0
            self.flush_metrics()
            self._print(
                f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {it:>8d}/{record['train_iters']:>8d}"
                f" | consumed samples: {record['consumed_samples']:>10d}"
                f" | elapsed time per iteration (ms): {record['elapsed_ms']:.1f}"
                f" | learning rate: {record['lr']:.6E}"
                f" | global batch size: {gbs:>5d}"
                f" | lm loss: {record['lm_loss']:.6E}" + fp16 +
                ("" if norm is None else f" | grad norm: {norm:.3f}") +
                f" | tokens/s: {record['tokens_per_sec']:.0f}"
                f" | TFLOP/s/device: {record['tflops_per_device']:.3f}"
                f" | MFU: {100 * record['mfu']:.2f}%"
                f" | peak mem: {_fmt_bytes(record['peak_mem_bytes'])}" + _extra_loss_summary(record))

    def log_eval(self, iteration: int, loss: float, split: str = "valid",
                 consumed_samples: int | None = None):
        if not self.is_writer:
            return
        ppl = math.exp(min(loss, 20))
        rec = {"split": split, "iteration": iteration, "lm_loss": loss, "ppl": ppl}
        if self.metrics:
            self._pending.append(json.dumps(rec) + "\n")
            self.flush_metrics()
        scalars = eval_scalars(loss, ppl, split, iteration, consumed_samples)
        if self.tb:
            for tag, value, step in scalars:
                self.tb.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log({tag: v for tag, v, step in scalars if step == iteration},
                           step=iteration)
        bar = "-" * 80
        self._print(f"{bar}\n {split} loss at iteration {iteration} | lm loss value: {loss:.6E} "
                    f"| lm loss PPL: {ppl:.6E}\n{bar}")

    def log_memory(self, record: dict):
        """The start-up memory report (``training.memory_report``): log and metrics file."""
        if not self.is_writer:
            return

        if self.metrics:
            self._pending.append(json.dumps(record) + "\n")
            self.flush_metrics()
        self._print(format_memory_report(record))

    def flush_metrics(self):
        """Write the records held since the last log line in one write: whole lines only,
        so a run killed between flushes never leaves half a JSON record."""
        if self.metrics and self._pending:
            self.metrics.write("".join(self._pending))
            self.metrics.flush()
            self._pending.clear()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.metrics:
            self.flush_metrics()
            self.metrics.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


# Megatron-LM's TensorBoard / W&B names (``training_log`` / ``evaluate_and_print_results``):
# each series by iteration, and again "vs samples" by consumed samples; megalite's own
# figures live under "megalite/".
_MEGATRON_TRAIN_TAGS = (("lm_loss", "lm loss"), ("lr", "learning-rate"),
                        ("grad_norm", "grad-norm"), ("loss_scale", "loss-scale"))
_MEGALITE_EXTRAS = ("tokens_per_sec", "tflops_per_device", "mfu", "peak_mem_bytes",
                    "elapsed_ms")
_NOT_SCALARS = {"iteration", "train_iters", "consumed_samples"}


def train_scalars(record: dict, global_batch_size: int) -> list:
    """``[(tag, value, step)]`` of one training record under Megatron's names."""
    it, samples = record["iteration"], record["consumed_samples"]
    out = []
    named = {"batch-size": record.get("global_batch_size", global_batch_size)}
    for key, tag in _MEGATRON_TRAIN_TAGS:
        if record.get(key) is not None:      # grad norm: None on a skipped fp16 step
            named[tag] = record[key]
    for tag, value in named.items():
        out += [(tag, value, it), (f"{tag} vs samples", value, samples)]
    known = {k for k, _ in _MEGATRON_TRAIN_TAGS} | _NOT_SCALARS | {"global_batch_size"}
    for key, value in record.items():
        if key not in known and isinstance(value, (int, float)):
            out.append((f"megalite/{key.replace('_', '-')}", value, it))
    return out


def eval_scalars(loss: float, ppl: float, split: str, iteration: int,
                 consumed_samples: int | None) -> list:
    """Megatron's "lm loss validation" (and "... ppl", "... vs samples") tags."""
    name = "validation" if split == "valid" else split
    out = [(f"lm loss {name}", loss, iteration), (f"lm loss {name} ppl", ppl, iteration)]
    if consumed_samples is not None:
        out += [(f"lm loss {name} vs samples", loss, consumed_samples),
                (f"lm loss {name} ppl vs samples", ppl, consumed_samples)]
    return out


def open_metrics_file(path: str, start_iter: int):
    """A fresh metrics file per run; a run resumed at ``start_iter`` keeps the records up
    to it and continues them, so the file (and the loss plot) holds one run."""
    kept = []
    if start_iter > 0 and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line).get("iteration", 0) <= start_iter:
                        kept.append(line)
                except ValueError:
                    continue
    out = open(path, "w")       # the logger writes whole batches of lines and flushes
    out.writelines(kept)
    return out
