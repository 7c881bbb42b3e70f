"""OptimizerConfig: AdamW or Muon, mixed precision, loss scaling, clipping and the LR/WD
schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.domain_checks import warmup_problem, whole_number_problem
from megalite.config.fields import opt


@dataclass
class OptimizerConfig:
    """AdamW or Muon, mixed precision, clipping and the learning-rate schedule."""
    optimizer: str = opt("adam", "Optimizer: AdamW, SGD, or Muon (2-D weights; AdamW for "
                         "embeddings, output layer, norms and biases; optimizer/muon.py).",
                         choices=["adam", "sgd", "muon"])
    lr: Optional[float] = opt(None, "Peak learning rate.", ge=0)
    min_lr: float = opt(0.0, "Learning rate floor after decay.", ge=0, le="lr")
    lr_decay_style: str = opt("linear", "Decay style (Megatron-Core's OptimizerParamScheduler).",
                              choices=["constant", "linear", "cosine", "inverse-square-root",
                                       "WSD"])
    lr_decay_iters: Optional[int] = opt(None, "Iterations to decay over; default --train-iters.",
        gt=0)
    lr_decay_samples: Optional[int] = opt(
        None, "Samples to decay over (--train-samples runs); default --train-samples.", gt=0)
    lr_warmup_iters: int = opt(0, "Linear warmup iterations.", ge=0,
                               check=warmup_problem("iters"))
    lr_warmup_samples: int = opt(0, "Linear warmup samples (--train-samples runs).", ge=0,
                                 check=warmup_problem("samples"))
    lr_warmup_fraction: Optional[float] = opt(None, "Warmup as a fraction of the decay steps.",
        ge=0, le=1)
    lr_warmup_init: float = opt(0.0, "Learning rate at the start of warmup.", ge=0)
    lr_wsd_decay_iters: Optional[int] = opt(
        None, "WSD: iterations of the final decay phase (default: 10%% of the decay).", ge=0)
    lr_wsd_decay_samples: Optional[int] = opt(
        None, "WSD: samples of the final decay phase (--train-samples runs).", ge=0)
    lr_wsd_decay_style: str = opt("linear", "WSD: shape of the final decay.",
                                  choices=["linear", "cosine", "exponential", "minus_sqrt"])
    decoupled_lr: Optional[float] = opt(
        None, "Separate peak lr for the input embedding and output layer.", ge=0)
    decoupled_min_lr: Optional[float] = opt(
        None, "Minimum lr of the input embedding and output layer under --decoupled-lr.",
        ge=0, le="decoupled_lr", requires="decoupled_lr")
    weight_decay: float = opt(0.01, "Weight decay (not applied to norms and biases).", ge=0)
    start_weight_decay: Optional[float] = opt(
        None, "Weight decay at the start of the run (default --weight-decay).", ge=0)
    end_weight_decay: Optional[float] = opt(
        None, "Weight decay at the end of the run (default --weight-decay).", ge=0)
    weight_decay_incr_style: str = opt("constant", "How weight decay moves from start to end.",
                                       choices=["constant", "linear", "cosine"])
    clip_grad: float = opt(1.0, "Clip the global gradient norm to this; 0 disables.", ge=0)
    adam_beta1: float = opt(0.9, "Adam beta1.", ge=0, lt=1)
    adam_beta2: float = opt(0.999, "Adam beta2.", ge=0, lt=1)
    adam_eps: float = opt(1e-8, "Adam epsilon.", gt=0)
    muon_momentum: float = opt(0.9, "Muon: momentum factor.", ge=0, lt=1)
    muon_nesterov: bool = opt(False, "Muon: Nesterov-style momentum.", action="store_true")
    muon_num_ns_steps: int = opt(5, "Muon: Newton-Schulz (quintic) iterations.", ge=1)
    muon_scale_mode: str = opt("spectral", "Muon: scale of the orthogonalised update "
                               "(rows m, columns n): spectral sqrt(max(m, n)), unit_rms_norm "
                               "sqrt(m/n), shape_scaling sqrt(max(1, m/n)).",
                               choices=["spectral", "unit_rms_norm", "shape_scaling"])
    muon_extra_scale_factor: float = opt(1.0, "Muon: extra factor on the update.", gt=0)
    muon_split_qkv: bool = opt(True, "Muon: orthogonalise Q, K and V of linear_qkv as "
                               "separate matrices (--muon-no-split-qkv: one matrix).",
                               flag="--muon-no-split-qkv", action="store_false")
    muon_tp_mode: str = opt("duplicated", "Muon under TP: gather each matrix whole and "
                            "orthogonalise it (duplicated: the single-process update).",
                            choices=["duplicated"])
    muon_scalar_optimizer: str = opt("adam", "Muon: optimizer of the non-matrix parameters.",
                                     choices=["adam"])
    bf16: bool = opt(False, "bf16 compute with fp32 master weights.", action="store_true")
    disable_bf16_reduced_precision_matmul: bool = opt(
        False, "bf16 matmuls accumulate in full precision on CUDA (cuBLAS's reduced-precision "
        "reduction off: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction).",
        action="store_true")
    precision: Optional[str] = opt(
        None, "Training precision: fp32, bf16 (as --bf16) or auto (time bf16 and fp32 matmuls "
        "at start-up and train in the faster; training/precision.py).",
        choices=["auto", "fp32", "bf16"])
    fp16: bool = opt(False, "fp16 compute with fp32 master weights and a loss scaler.",
                     action="store_true")
    loss_scale: Optional[float] = opt(
        None, "Static loss scale (a power of 2; fp16, or bf16 as in Megatron); default under "
        "--fp16: dynamic loss scaling.", gt=0)
    initial_loss_scale: float = opt(2.0 ** 32, "fp16: initial dynamic loss scale.", gt=0)
    min_loss_scale: float = opt(1.0, "fp16: smallest dynamic loss scale.",
        gt=0, le="initial_loss_scale")
    loss_scale_window: float = opt(1000, "fp16: steps without overflow before the scale grows.",
        ge=1, check=whole_number_problem)
    hysteresis: int = opt(2, "fp16: overflows in a row before the scale shrinks.", ge=1)

    def __post_init__(self):
        if self.precision == "bf16":    # one switch downstream: dry run, planner, optimizer
            self.bf16 = True
