#!/usr/bin/env python
"""Pretrain a mixture-of-experts model: pretrain_gpt.py with MoE defaults (8 experts, top-2,
load-balancing aux loss 1e-2, alltoall token dispatch).  Every flag of pretrain_gpt.py
works; --expert-model-parallel-size / --expert-tensor-parallel-size lay out the experts
(docs/moe.md).  Per MoE layer, the aux loss, z-loss, tokens per expert and max/mean load
go to the console summary and to --metrics-file.
"""
import sys

from megalite.training.entry import main

MOE_DEFAULTS = {"num_experts": 8, "moe_router_topk": 2, "moe_aux_loss_coeff": 1e-2,
                "moe_token_dispatcher_type": "alltoall"}

if __name__ == "__main__":
    sys.exit(main(prog="pretrain_moe.py", defaults=MOE_DEFAULTS))
