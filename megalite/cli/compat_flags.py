"""Megatron-LM flags megalite accepts without a setting of its own.

A Megatron script ports by changing the program name, so every flag its ``examples/``
training scripts pass must parse.  Two kinds live here (flags with a real setting are
dataclass fields in ``megalite/config/``, never listed here: a test holds that):

* ``NO_EFFECT``: distinctions megalite does not have (fusion switches, kernel backends,
  memory housekeeping, Megatron-FSDP's buffer registration).  Accepted and listed once in
  the log as having no effect here.
* ``RUNTIME_ONLY``: features that need hardware (FP8 needs Transformer Engine on a GPU with
  FP8).  They parse and pass ``--dry-run``; a run refuses them with one line where the
  machine cannot run them (the rule engine, ``megalite/cli/features.py``).

Unknown flags stay errors.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

FLAG = "store_true"   # a switch
VALUE = None          # one value
LIST = "+"            # one or more values


@dataclass(frozen=True)
class CompatFlag:
    flag: str
    nargs: Optional[str]      # FLAG, VALUE or LIST
    note: str

    @property
    def dest(self) -> str:
        return "compat_" + self.flag.lstrip("-").replace("-", "_")


_FUSION = "fusion switch: megalite runs one PyTorch implementation"
NO_EFFECT = [
    CompatFlag("--use-mcore-models", FLAG, "megalite has one model implementation"),
    CompatFlag("--use-legacy-models", FLAG, "megalite has one model implementation"),
    CompatFlag("--use-flash-attn", FLAG, "attention runs PyTorch SDPA, which picks the kernel"),
    CompatFlag("--no-masked-softmax-fusion", FLAG, _FUSION),
    CompatFlag("--no-bias-gelu-fusion", FLAG, _FUSION),
    CompatFlag("--no-bias-swiglu-fusion", FLAG, _FUSION),
    CompatFlag("--no-bias-dropout-fusion", FLAG, _FUSION),
    CompatFlag("--no-gradient-accumulation-fusion", FLAG, _FUSION),
    CompatFlag("--no-rope-fusion", FLAG, _FUSION),
    CompatFlag("--cross-entropy-fusion-impl", VALUE, _FUSION),
    CompatFlag("--manual-gc", FLAG, "Python's garbage collector is left alone"),
    CompatFlag("--manual-gc-interval", VALUE, "Python's garbage collector is left alone"),
    CompatFlag("--empty-unused-memory-level", VALUE, "the allocator cache is not emptied"),
    CompatFlag("--log-throughput", FLAG, "throughput (tokens/s, TFLOP/s, MFU) is always logged"),
    CompatFlag("--log-timers-to-tensorboard", FLAG, "timers are not separate series here"),
    CompatFlag("--log-memory-to-tensorboard", FLAG, "peak memory is always logged"),
    CompatFlag("--log-validation-ppl-to-tensorboard", FLAG,
               "validation perplexity is always logged"),
    CompatFlag("--log-params-norm", FLAG, "parameter norms are not computed here"),
    CompatFlag("--log-num-zeros-in-grad", FLAG, "zero-gradient counts are not computed here"),
    CompatFlag("--timing-log-level", VALUE, "timers are not separate series here"),
    CompatFlag("--num-workers", VALUE, "samples are read in-process from memory-mapped files"),
    CompatFlag("--no-mmap-bin-files", FLAG, ".bin files are always memory-mapped"),
    CompatFlag("--no-create-attention-mask-in-dataloader", FLAG,
               "the causal mask is built inside attention"),
    CompatFlag("--calculate-per-token-loss", FLAG,
               "the loss is always divided by the loss tokens of the global batch"),
    CompatFlag("--grad-reduce-in-bf16", FLAG, "gradients are reduced in fp32 here"),
    CompatFlag("--no-position-embedding", FLAG,
               "--position-embedding-type decides (rope/none have no learned table)"),
    CompatFlag("--yarn-correction-range-round-to-int", FLAG,
               "already the default; --no-yarn-correction-range-round-to-int turns it off"),
    CompatFlag("--profile", FLAG, "no torch profiler hook yet; see --pipeline-timeline"),
    CompatFlag("--profile-step-start", VALUE, "no torch profiler hook yet"),
    CompatFlag("--profile-step-end", VALUE, "no torch profiler hook yet"),
    CompatFlag("--profile-ranks", LIST, "no torch profiler hook yet"),
    CompatFlag("--use-pytorch-profiler", FLAG, "no torch profiler hook yet"),
    CompatFlag("--moe-grouped-gemm", FLAG,
               "the experts always run as one grouped loop over their tokens (GroupedMLP)"),
    CompatFlag("--ckpt-format", VALUE,
               "megalite writes one format, torch.distributed.checkpoint shards that reshard "
               "on load to any layout (as Megatron's torch_dist / torch_dcp / fsdp_dtensor)"),
    # Megatron-FSDP's own buffers (megalite's ZeRO-3 is torch FSDP2: config/megatron_fsdp.py)
    CompatFlag("--init-model-with-meta-device", FLAG,
               "each rank builds its TP-sharded chunks on its device; FSDP2 shards them after "
               "the name-seeded init"),
    CompatFlag("--use-nccl-ub", FLAG, "torch FSDP2 allocates its own communication buffers"),
    CompatFlag("--fsdp-double-buffer", FLAG,
               "torch FSDP2 allocates its own communication buffers"),
    CompatFlag("--fsdp-manual-registration", FLAG,
               "torch FSDP2 allocates its own communication buffers"),
    # gpt-oss (examples/gptoss/02_train.sh)
    CompatFlag("--export-force-local-attention", FLAG,
               "a ModelOpt export switch (Megatron's post-training model builder); megalite's "
               "export, tools/checkpoint/convert.py, writes weights and reads no kernel"),
    CompatFlag("--enable-gpt-oss", FLAG,
               "ModelOpt's gpt-oss builder switch; here the model flags (--softmax-type, "
               "--quick-geglu, --window-size, ...) build the gpt-oss layer"),
    CompatFlag("--moe-permute-fusion", FLAG, _FUSION),
    CompatFlag("--attention-softmax-in-fp32", FLAG,
               "PyTorch's softmax of 16-bit scores already accumulates in fp32"),
    CompatFlag("--accumulate-allreduce-grads-in-fp32", FLAG,
               "gradients are accumulated and reduced in fp32 here"),
    CompatFlag("--moe-per-layer-logging", FLAG,
               "MoE statistics are always logged per layer (moe_layer_N_* metrics)"),
]

RUNTIME_ONLY = [
    # --fp8-format / --fp8-amax-history-len / --fp8-amax-compute-algo are ModelConfig fields
    # (the TE backend, megalite/backends/transformer_engine.py); these remain unwired.
    CompatFlag("--fp8-recipe", VALUE, "FP8 needs Transformer Engine on a GPU with FP8 support"),
    CompatFlag("--fp8-param-gather", FLAG, "FP8 needs Transformer Engine"),
    CompatFlag("--fp8-margin", VALUE, "FP8 needs Transformer Engine"),
]

ALL = NO_EFFECT + RUNTIME_ONLY
FP8_UNWIRED = tuple(c.flag for c in RUNTIME_ONLY)   # refused for a run by cli/features.py


def register(parser: argparse.ArgumentParser) -> None:
    """Add every compat flag the parser does not define already (a config field wins)."""
    taken = {s for a in parser._actions for s in a.option_strings}
    group = parser.add_argument_group(
        "Megatron-LM flags accepted without effect here (listed once in the log)")
    for c in ALL:
        if c.flag in taken:
            continue
        if c.nargs == FLAG:
            group.add_argument(c.flag, dest=c.dest, action="store_true", default=False,
                               help=argparse.SUPPRESS)
        else:
            group.add_argument(c.flag, dest=c.dest, nargs=c.nargs, default=None,
                               help=argparse.SUPPRESS)


def pop_given(namespace: dict) -> list:
    """Remove the compat entries from parsed flags; ``[(flag, value, note)]`` of those given."""
    given = []
    for c in ALL:
        if c.dest not in namespace:
            continue
        value = namespace.pop(c.dest)
        if value not in (None, False):
            given.append((c.flag, value, c.note))
    return given


def describe(given: list) -> str:
    """The one log block naming each accepted flag that has no effect here."""
    return "\n".join(f"> {flag} accepted, no effect here: {note}" for flag, _, note in given)
