"""megalite: Megatron-style LLM pretraining that also runs on CPU processes.

Importing the package needs neither CUDA, Transformer Engine nor apex.
"""
__version__ = "0.1.0"
