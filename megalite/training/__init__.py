"""Pretraining entry: parse flags, start process groups, run the loop."""
from megalite.training.entry import main  # noqa: F401
