"""``isinstance`` checks against DTensor and FSDP2's module class that do not import them.

Why: importing ``torch.distributed.tensor``, ``torch.distributed.fsdp`` or
``torch.distributed.pipelining`` pulls in ``torch._dynamo``: about 0.8 s of start-up on
every process (each torchrun worker, each one-line user error, ``--help``).  Only FSDP2
creates DTensors and FSDP modules, and it imports those packages when it shards; before
that nothing can be an instance, so a check needs the class only once its package is
loaded.  Code that *builds* DTensors (``distribute_tensor``, ``DTensor.from_local``)
imports torch's package where it does so.
"""
from __future__ import annotations

import sys


def is_dtensor(obj) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(obj, tensor.DTensor)


def is_fsdp_module(obj) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(obj, fsdp.FSDPModule)
