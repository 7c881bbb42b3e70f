"""Pretraining: the loop, its logging and metrics, and the entry (``entry.main``) that
pretrain_gpt.py / pretrain_moe.py call: parse flags, start process groups, run the loop."""
