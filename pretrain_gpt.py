#!/usr/bin/env python
"""Pretrain a GPT / Llama-style model. Flags follow Megatron-LM; see --help."""
import sys

from megalite.training.entry import main

if __name__ == "__main__":
    sys.exit(main())
