"""The test hook (``MEGALITE_FAULT_INJECT``) over layouts and ops the older hang tests do not
use, as a user would try it: each case drops one op of one rank in iteration 3 on 4 gloo
processes and asserts the rank the diagnosis names as the cause -- at run time (the
diagnosis printed while the job ends, by a rank or by ``megalite.elastic.launch``, and
``megalite hangs DIR`` afterwards) and before launch (``--dry-run --check-collectives``).
Many of these end in a backend abort (gloo's "Received data size doesn't match expected
size": SIGABRT), so the killed rank's fatal-signal record is part of what is read.

The cases and how they are run: benchmarks/hang_matrix.py (which prints the table of
docs/troubleshooting.md, "The test matrix").  Default tier: the distributed optimizer's
data-parallel all-gather at TP2 x DP2 (two-member groups), the loss all-reduce at DP4 (the
victim aborted by the backend) and the EP all-to-all of pretrain_moe.py.  The long tier
(tests/conftest.py) has the rest: the reduce-scatter, CP's ring exchange, the MoE
dispatcher's token-count all-gather and FSDP2's all-gather (run time only: the pre-launch
check refuses FSDP2, saying what is missing -- checked here in the default tier).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import hang_matrix  # noqa: E402

DEFAULT = ["dp-all-gather-distopt-tp2", "loss-all-reduce-dp4", "ep-all-to-all"]
LONG = [c for c in hang_matrix.CASES if c not in DEFAULT]


def _check(tmp_path, case):
    rank = hang_matrix.CASES[case][3]
    run = hang_matrix.run_time(case, str(tmp_path))
    assert run["status"] != 0 and run["printed"], run["stderr"][-4000:]
    assert run["hangs_status"] == 0, run["hangs"]
    for text in (run["printed"], run["hangs"]):
        assert hang_matrix.first_cause(text).startswith(f"cause: rank {rank} -- "), text
    leftovers = [f for f in os.listdir(run["dumps"]) if f.endswith(".fatal.txt") and
                 "Fatal Python error" not in open(os.path.join(run["dumps"], f)).read()]
    assert not leftovers, leftovers        # a rank that did not die of a signal leaves none
    if case == "fsdp2-all-gather":
        return
    p = hang_matrix.before_launch(case)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    causes = [l.strip() for l in p.stdout.splitlines() if l.strip().startswith("cause:")]
    assert causes and causes[0].startswith(f"cause: rank {rank} -- it left its own program"), \
        p.stdout[-3000:]
    assert all(c.startswith(f"cause: rank {rank} ") for c in causes), causes


@pytest.mark.parametrize("case", DEFAULT)
def test_the_cause_is_named_at_run_time_and_before_launch(tmp_path, case):
    _check(tmp_path, case)


@pytest.mark.parametrize("case", LONG)
def test_more_layouts_name_the_cause(tmp_path, case):
    _check(tmp_path, case)


def test_fsdp2_is_refused_by_the_collective_check_saying_what_is_missing():
    p = hang_matrix.before_launch("fsdp2-all-gather")
    assert p.returncode == 2
    (line,) = [l for l in p.stderr.splitlines() if l.strip()]
    assert "needs a device mesh of real process groups and refuses meta parameters" in line
    assert "MEGALITE_FAULT_INJECT see them" in line, line
