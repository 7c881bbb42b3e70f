"""Start-up matmul-rate probe and ``--precision auto|fp32|bf16``.

Why: whether bf16 pays depends on the CPU.  With native bf16 (AVX512-BF16, AMX) a bf16
matmul runs 3-7x faster than fp32; without it (AVX2-only) PyTorch emulates bf16 and runs
~50x SLOWER.  A bf16 run on such a machine silently takes a day instead of an hour.  So
at start-up, when the precision is bf16 or left to ``auto``, megalite times bf16 and fp32
matmuls on shapes like the model's (well under a second), then:

* ``--precision auto`` trains in the faster of the two (bf16 means Megatron's ``--bf16``:
  bf16 weights and activations in the matmuls, fp32 master weights, fp32 gradient
  accumulation and reduction, fp32 loss and grad norm);
* ``--bf16`` / ``--precision bf16`` trains in bf16 and warns, with both figures, when
  bf16 is much slower (below ``SLOW_BF16_RATIO`` of fp32);
* ``--precision fp32`` (and the default without ``--bf16``) trains in fp32 without probing.

Every rank probes, the rates are averaged over the world so all ranks choose the same, and
the choice with both rates goes to the log and to ``--metrics-file`` (one line with
``"split": "precision"``, like the start-up memory record).  ``resolve_precision`` takes the
probe as an argument so the choice is tested without timing anything.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megalite.config.activations import activation_of
from megalite import comm

SLOW_BF16_RATIO = 0.5       # warn when bf16 runs below half the fp32 rate
PROBE_SECONDS = 0.4         # total timing budget, both dtypes, all shapes
MAX_PROBE_FLOPS = 4e8       # per matmul: 0.2 s even at an emulated-bf16 2 GFLOP/s

Shape = Tuple[int, int, int]    # (m, k, n): [m, k] @ [k, n]


@dataclasses.dataclass(frozen=True)
class MatmulRates:
    fp32: float                 # FLOP/s
    bf16: float
    shapes: Tuple[Shape, ...] = ()

    @property
    def bf16_over_fp32(self) -> float:
        return self.bf16 / self.fp32 if self.fp32 > 0 else float("inf")


def probe_shapes(model_cfg, tokens: int, tp: int = 1) -> List[Shape]:
    """The model's two kinds of large matmul, the MLP's first linear and the output layer:
    up to 512 tokens, and the output features cut so one matmul stays near
    ``MAX_PROBE_FLOPS`` (the rate, not the whole layer, is what is measured)."""
    h = min(model_cfg.hidden_size, 4096)
    ffn = model_cfg.ffn_hidden_size or 4 * model_cfg.hidden_size
    mlp_out = max(1, ffn * activation_of(model_cfg).fc1_blocks // tp)
    vocab = max(1, (model_cfg.vocab_size or 32000) // tp)
    m = max(1, min(tokens, 512))
    cap = max(64, int(MAX_PROBE_FLOPS // (2 * m * h)))
    return [(m, h, min(mlp_out, cap)), (m, h, min(vocab, cap))]


def measure_matmul_rates(shapes: Sequence[Shape], seconds: float = PROBE_SECONDS,
                         device: str = "cpu", min_rounds: int = 3) -> MatmulRates:
    """FLOP/s of fp32 and bf16 matmuls over ``shapes`` (one of each shape per "step").

    Rounds alternate the dtypes call by call, so a busy machine slows both alike, and run
    until ``seconds`` have passed (at least ``min_rounds``); each (dtype, shape) keeps its
    fastest call, the least disturbed by other processes."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    dtypes = (torch.float32, torch.bfloat16)
    pairs = {}
    for m, k, n in shapes:
        for dtype in dtypes:
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            torch.matmul(a, b)                                  # warm-up (kernel choice)
            pairs[(m, k, n), dtype] = (a, b)
    best = {key: float("inf") for key in pairs}
    t_start, rounds = time.perf_counter(), 0
    while rounds < min_rounds or time.perf_counter() - t_start < seconds:
        for key, (a, b) in pairs.items():
            sync()
            t0 = time.perf_counter()
            torch.matmul(a, b)
            sync()
            best[key] = min(best[key], time.perf_counter() - t0)
        rounds += 1
    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    rates = [flops / sum(best[s, d] for s in shapes) for d in dtypes]
    return MatmulRates(rates[0], rates[1], tuple(shapes))


def requested_precision(opt_cfg) -> str:
    """"fp32", "bf16" or "auto" from ``--precision`` and ``--bf16`` (validated together)."""
    if opt_cfg.precision:
        return opt_cfg.precision
    return "bf16" if opt_cfg.bf16 else "fp32"


def choose_precision(requested: str, rates: Optional[MatmulRates]) -> Tuple[str, Optional[str]]:
    """(chosen "fp32" or "bf16", warning or None)."""
    if requested == "fp32":
        return "fp32", None
    if requested == "auto":
        return ("bf16" if rates.bf16 > rates.fp32 else "fp32"), None
    warning = None
    if rates is not None and rates.bf16_over_fp32 < SLOW_BF16_RATIO:
        warning = (f"WARNING: bf16 matmuls run at {rates.bf16 / 1e9:.1f} GFLOP/s here, "
                   f"{rates.bf16_over_fp32:.2f}x the fp32 rate ({rates.fp32 / 1e9:.1f} GFLOP/s): "
                   f"this CPU has no native bf16; --precision auto (or fp32) would train faster")
    return "bf16", warning


def resolve_precision(cfg, world=None, device: str = "cpu",
                      probe: Callable[..., MatmulRates] = measure_matmul_rates):
    """(``cfg`` with ``optimizer.bf16`` set to the chosen precision, the record to log or
    None).  ``world``: a ``Group`` over every rank (its rates are averaged so every rank
    chooses the same); ``probe(shapes, device=...)`` measures the rates."""
    o = cfg.optimizer
    requested = requested_precision(o)
    if requested == "fp32":
        return cfg, None
    tokens = cfg.training.micro_batch_size * cfg.model.seq_length
    rates = probe(probe_shapes(cfg.model, tokens, cfg.parallel.tp), device=device)
    if world is not None and world.size > 1:
        both = torch.tensor([rates.fp32, rates.bf16], dtype=torch.float64)
        comm.all_reduce(both, world, op="avg")
        rates = MatmulRates(float(both[0]), float(both[1]), rates.shapes)
    chosen, warning = choose_precision(requested, rates)
    record = {"split": "precision", "requested": requested, "chosen": chosen,
              "fp32_flops_per_s": rates.fp32, "bf16_flops_per_s": rates.bf16,
              "bf16_over_fp32": rates.bf16_over_fp32,
              "probe_shapes": [list(s) for s in rates.shapes], "warning": warning}
    resolved = dataclasses.replace(cfg, optimizer=dataclasses.replace(o, bf16=chosen == "bf16"))
    return resolved, record


def format_precision(record: dict) -> str:
    return (f"> precision: {record['chosen']} (requested {record['requested']}); matmul rates "
            f"on the model's shapes: fp32 {record['fp32_flops_per_s'] / 1e9:.1f} GFLOP/s, "
            f"bf16 {record['bf16_flops_per_s'] / 1e9:.1f} GFLOP/s "
            f"({record['bf16_over_fp32']:.2f}x)")


def log_precision(logger, record: Optional[dict]) -> None:
    """The choice, both rates and any warning: to the log and the metrics file (writer)."""
    if record is None or not logger.is_writer:
        return
    if logger.metrics:
        logger.metrics.write(json.dumps(record) + "\n")
    logger.info(format_precision(record))
    if record["warning"]:
        logger.info(record["warning"])
