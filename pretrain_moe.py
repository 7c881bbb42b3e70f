#!/usr/bin/env python
"""Pretrain a mixture-of-experts model: pretrain_gpt.py with MoE defaults (8 experts, top-2).

MoE layers have not landed yet: today this entry validates flags and prints the expert grid
with --dry-run; a training run stops with a one-line error instead of training a dense model.
"""
import sys

from megalite.training import main

MOE_DEFAULTS = {"num_experts": 8, "moe_router_topk": 2, "moe_aux_loss_coeff": 1e-2}

if __name__ == "__main__":
    sys.exit(main(prog="pretrain_moe.py", defaults=MOE_DEFAULTS))
