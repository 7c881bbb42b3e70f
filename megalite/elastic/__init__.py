"""Elastic training: what changes when the world changes between (re)starts.

- ``launch``: ``python -m megalite.elastic.launch`` is torchrun with the settings an elastic
  job needs (fast re-formation, a short exit barrier, the worker's exit status, no restart
  for a user error) and a per-node result file for the batch script.
- ``relayout``: the re-layout rule at every (re)start: DP follows the world, TP/PP/CP/EP and
  the global batch stay; a world the layout does not fit trains its largest fitting part and
  the rest of the ranks wait as spares.
- ``resume``: where restarted workers take their state from (one function).

docs/fault_tolerance.md says what survives what.
"""
