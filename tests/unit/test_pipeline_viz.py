"""Pictures and traces: the simulator's schedule drawn via ``megalite viz``, Chrome traces."""
import json
import os

import pytest

from megalite.cli.main import main as cli
from megalite.config import pipeline_program, pipeline_schedules
from megalite.pipeline_parallel.timeline import (chrome_trace, load_records, records_from_sim,
                                                 write_chrome_trace)
from megalite.viz.timeline import bubble_of


@pytest.mark.parametrize("args", [["--schedule", "1f1b"], ["--schedule", "zero-bubble"],
                                  ["--schedule", "interleaved", "--vpp", "2"]])
def test_viz_schedule_cli(tmp_path, args):
    out = tmp_path / "x.png"
    assert cli(["viz", "schedule", *args, "--pp", "4", "--micro-batches", "8",
                "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_trace_round_trip_keeps_bubble(tmp_path):
    sim = pipeline_program.simulate(pipeline_schedules.plan("1f1b", 4, 8))
    records = records_from_sim(sim)
    assert bubble_of(records) == pytest.approx(3 / 8)
    path = tmp_path / "t.json"
    write_chrome_trace(str(path), records, {"schedule": "1f1b", "pp": 4})
    data = json.loads(path.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"
             and e["name"] == "process_name"}
    assert names == {f"stage {r} (rank {r})" for r in range(4)}
    back, meta = load_records(str(path))
    assert meta["pp"] == 4 and len(back) == len(records)
    assert bubble_of(back) == pytest.approx(3 / 8)
    assert cli(["viz", "timeline", str(path), "-o", os.fspath(tmp_path / "t.png")]) == 0


def test_chrome_trace_events_are_complete_events():
    trace = chrome_trace(records_from_sim(pipeline_program.simulate(pipeline_schedules.plan("zero-bubble", 2, 4))),
                         {})
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["tid"] in (0, 1) for e in xs)
    assert {e["cat"] for e in xs} == {"F", "B", "W", "comm"}
