"""The commands that sit above training: ``megalite plan`` (``plan.py``: the planner's
search from flags; its ``--check-collectives`` traces the training step) and
``--validate-run`` (``validate_run.py``: trains one iteration and compares the planner's
prediction with what it measured).  The planner itself (``megalite/planner/``) is the
torch-free library below training, which reads it for ``--dry-run``, MFU and the memory
report."""
