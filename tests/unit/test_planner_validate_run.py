"""The --validate-run report without spawning anything: which rows pass, what the table
says, and the exit status (the real runs are in tests/distributed)."""
import io

import megalite.commands.validate_run as vr
from megalite.commands.plan import plan

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--tensor-model-parallel-size", "2"]


def _meas(**kw):
    base = {"weights": 100, "grads": 100, "optimizer": 200, "activations": 1000,
            "comm": {"tp/all_reduce": {"calls": 4, "elements": 50, "bytes": 200}}}
    base.update(kw)
    return base


def test_tolerances_exact_10_and_1_percent():
    pred = _meas()
    ok = {r["what"]: r["ok"] for r in vr.compare(pred, _meas(activations=1099))}
    assert all(ok.values())
    bad = vr.compare(pred, _meas(grads=101, activations=1101,
                                 comm={"tp/all_reduce": {"calls": 4, "bytes": 203},
                                       "mp/all_reduce": {"calls": 1, "bytes": 4}}))
    assert {r["what"] for r in bad if not r["ok"]} == \
        {"grads", "activations", "tp/all_reduce", "mp/all_reduce"}


def test_predictions_cover_every_collective_the_loop_makes():
    cfg = vr.parse_args(vr.run_argv(FLAGS, 2))
    p = vr.predict(cfg, 0)
    assert set(p["comm"]) == {"tp/all_reduce", "mp/all_reduce"}      # grad norm over TP
    assert p["comm"]["tp/all_reduce"]["bytes"] % 4 == 0               # fp32 activations
    assert p["weights"] == p["grads"] and p["optimizer"] == 2 * p["weights"]


def test_cli_prints_table_and_exit_status(monkeypatch):
    rows = [vr.compare(_meas(), _meas())] * 2
    monkeypatch.setattr(vr, "validate", lambda flags, n, pool=None: (rows, True))
    out = io.StringIO()
    assert plan(["--validate-run", "--nproc", "2", *FLAGS], out=out) == 0
    text = out.getvalue()
    assert "TP2 CP1 PP1 DP1" in text and "0,1" in text and "PASS" in text
    rows = [vr.compare(_meas(), _meas(optimizer=400))]
    monkeypatch.setattr(vr, "validate", lambda flags, n, pool=None: (rows, False))
    out = io.StringIO()
    assert plan(["--validate-run", "--nproc", "2", *FLAGS], out=out) == 1
    assert "missed: optimizer" in out.getvalue()
