"""Megatron-FSDP's flags on megalite's data-parallel strategies.

Megatron-LM's ``--use-megatron-fsdp --data-parallel-sharding-strategy S`` picks a ZeRO stage;
megalite runs each stage with a strategy of its own (docs/data_parallel.md):

    no_shard            ZeRO-0  DDP
    optim               ZeRO-1  --use-distributed-optimizer
    optim_grads         ZeRO-2  --use-distributed-optimizer --overlap-grad-reduce
                                (bucketed reduce-scatters; only the gradient shard is kept)
    optim_grads_params  ZeRO-3  --use-torch-fsdp2 (torch's fully_shard)

so ``apply_megatron_fsdp`` sets those fields at parse time (before any check reads them).
Megatron-FSDP's scripts also pass ``--use-distributed-optimizer`` and the overlap flags
(Megatron-FSDP v1 forces the first); where the stage makes a flag part of the strategy it is
reported as having no effect of its own, never silently dropped.  Pure Python.
"""
from __future__ import annotations

import dataclasses

from megalite.errors import ConfigError

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_STAGE = {"no_shard": "ZeRO-0, DDP", "optim": "ZeRO-1, the distributed optimizer",
          "optim_grads": "ZeRO-2, the distributed optimizer keeping only its gradient shard",
          "optim_grads_params": "ZeRO-3, torch FSDP2 as with --use-torch-fsdp2"}
# (field, flag) megalite sets for each strategy: True / False
_FIELDS = {
    "no_shard": {"use_distributed_optimizer": False, "use_torch_fsdp2": False,
                 "overlap_param_gather": False},
    "optim": {"use_distributed_optimizer": True, "use_torch_fsdp2": False},
    "optim_grads": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                    "use_torch_fsdp2": False},
    "optim_grads_params": {"use_torch_fsdp2": True, "use_distributed_optimizer": False,
                           "overlap_grad_reduce": False, "overlap_param_gather": False},
}
_FLAGS = {"use_distributed_optimizer": "--use-distributed-optimizer",
          "overlap_grad_reduce": "--overlap-grad-reduce",
          "overlap_param_gather": "--overlap-param-gather"}


def apply_megatron_fsdp(cfg):
    """``cfg`` with ``--use-megatron-fsdp``'s strategy set in the strategy fields (a copy;
    ``cfg`` itself when the flag is off); flags the strategy absorbs join
    ``cfg.accepted_flags`` (listed once in the log as having no effect of their own)."""
    p = cfg.parallel
    if not p.use_megatron_fsdp:
        return cfg
    strategy = p.data_parallel_sharding_strategy
    if p.use_torch_fsdp2:
        raise ConfigError("give one of --use-megatron-fsdp and --use-torch-fsdp2 (Megatron "
                          "refuses both): --use-megatron-fsdp --data-parallel-sharding-strategy "
                          "optim_grads_params runs torch FSDP2")
    if strategy == "optim" and p.overlap_grad_reduce:
        raise ConfigError("--data-parallel-sharding-strategy optim with --overlap-grad-reduce: "
                          "megalite's overlapped distributed optimizer keeps only the gradient "
                          "shard, which is optim_grads; give optim_grads or drop "
                          "--overlap-grad-reduce")
    changes = _FIELDS[strategy]
    absorbed = [(flag, True, f"part of --use-megatron-fsdp --data-parallel-sharding-strategy "
                 f"{strategy} ({_STAGE[strategy]})")
                for name, flag in _FLAGS.items()
                if getattr(p, name) and changes.get(name) is False]
    parallel = dataclasses.replace(p, **changes)
    return dataclasses.replace(cfg, parallel=parallel,
                               accepted_flags=list(cfg.accepted_flags) + absorbed)


def describe(cfg) -> str:
    """The log line of a run with ``--use-megatron-fsdp`` ('' without)."""
    p = cfg.parallel
    if not p.use_megatron_fsdp:
        return ""
    return (f"> --use-megatron-fsdp --data-parallel-sharding-strategy "
            f"{p.data_parallel_sharding_strategy}: {_STAGE[p.data_parallel_sharding_strategy]}")
