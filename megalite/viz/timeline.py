"""The classic pipeline diagram: one row per stage, F / B / W blocks numbered by micro-batch.

``megalite viz timeline trace.json -o schedule.png`` draws a ``--pipeline-timeline``
trace (measured wall times); ``megalite viz schedule --schedule 1f1b --pp 4
--micro-batches 8 -o x.png`` draws what the simulator predicts with unit costs.  Later
chunks of an interleaved schedule are drawn lighter and hatched.
"""
from __future__ import annotations

from typing import List, Optional

from megalite.errors import DataError
from megalite.config.pipeline_schedules import SCHEDULE_NAMES, get_schedule
from megalite.config import pipeline_program, pipeline_schedules
from megalite.pipeline_parallel.timeline_records import load_records, records_from_sim
from megalite.cli.boundary import run_cli
from megalite.cli.arguments import OneLineErrorParser
from megalite.viz.pyplot import matplotlib_modules

COLORS = {"F": "#4C72B0", "B": "#55A868", "BW": "#55A868", "W": "#DD8452"}
LABELS = {"F": "F forward", "BW": "B backward", "B": "B input grad", "W": "W weight grad"}
COMPUTE = ("F", "B", "BW", "W")


def bubble_of(records: List[dict]) -> float:
    """Idle time over compute time, all ranks together (Narayanan's t_pb / t_id)."""
    ranks = {r["rank"] for r in records}
    busy = sum(r["end"] - r["start"] for r in records if r["kind"] in COMPUTE)
    span = max(r["end"] for r in records) - min(r["start"] for r in records)
    return (span * len(ranks) - busy) / busy if busy else 0.0


def _shade(color: str, chunk: int, chunks: int) -> tuple:
    matplotlib, _ = matplotlib_modules()
    rgb = matplotlib.colors.to_rgb(color)
    f = 0.45 * chunk / max(chunks - 1, 1)
    return tuple(c + (1 - c) * f for c in rgb)


def draw_pipeline(records: List[dict], out: str, title: Optional[str] = None,
                  unit: str = "s", show_comm: bool = True) -> str:
    matplotlib, plt = matplotlib_modules()
    Patch = matplotlib.patches.Patch
    if not records:
        raise ValueError("no events to draw")
    ranks = sorted({r["rank"] for r in records})
    chunks = max(r.get("chunk", 0) for r in records) + 1
    t0 = min(r["start"] for r in records)
    span = max(r["end"] for r in records) - t0
    n_ops = sum(r["kind"] in COMPUTE for r in records) / len(ranks)
    fig, ax = plt.subplots(figsize=(min(26, max(9, 0.45 * n_ops)), 0.75 * len(ranks) + 1.6))
    for r in records:
        y = ranks.index(r["rank"])
        x, w = r["start"] - t0, r["end"] - r["start"]
        if r["kind"] in COMPUTE:
            c = r.get("chunk", 0)
            ax.broken_barh([(x, w)], (y - 0.38, 0.76),
                           facecolors=_shade(COLORS[r["kind"]], c, chunks),
                           edgecolors="white", linewidth=0.6, hatch="//" if c % 2 else None)
            if w > span / 140:
                ax.text(x + w / 2, y, str(r["mb"]), ha="center", va="center", color="white",
                        fontsize=7 if w > span / 60 else 5, fontweight="bold")
        elif show_comm and w > 0:
            ax.broken_barh([(x, w)], (y + 0.38, 0.08), facecolors="#999999")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"stage {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.45, -0.55)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    kinds = [k for k in ("F", "BW", "B", "W") if any(r["kind"] == k for r in records)]
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds]
    if chunks > 1:
        handles.append(Patch(facecolor=_shade(COLORS["F"], 1, 2), hatch="//",
                             label="later model chunks: lighter"))
    if show_comm and any(r["kind"] not in COMPUTE for r in records):
        handles.append(Patch(color="#999999", label="p2p (blocking)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16 - 0.1 / len(ranks)),
              ncol=len(handles), frameon=False, fontsize=8)
    ax.set_title(f"{title + ' - ' if title else ''}bubble {bubble_of(records):.1%} "
                 "(idle / compute)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def simulated_records(schedule: str, pp: int, micro_batches: int, vpp: int = 1,
                      costs: Optional[dict] = None) -> List[dict]:
    result = pipeline_program.simulate(pipeline_schedules.plan(schedule, pp, micro_batches, vpp),
                                       costs or pipeline_program.UNIT_COSTS)
    return records_from_sim(result)


def _costs(text: str) -> dict:
    out = dict(F=1.0, B=1.0, W=1.0)
    for part in filter(None, text.split(",")):
        k, v = part.split("=")
        out[k.strip()] = float(v)
    return out


def main(argv=None) -> int:
    return run_cli(_main, argv, prog="megalite viz")


def _main(argv=None) -> int:
    ap = OneLineErrorParser(prog="megalite viz", description="Pipeline pictures.")
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("timeline", help="draw a --pipeline-timeline Chrome trace")
    t.add_argument("path")
    t.add_argument("-o", "--output", default="schedule.png")
    t.add_argument("--iteration", type=int, default=None, help="default: the last recorded")
    s = sub.add_parser("schedule", help="draw the simulator's schedule")
    s.add_argument("--schedule", default=SCHEDULE_NAMES[0], choices=SCHEDULE_NAMES)
    s.add_argument("--pp", type=int, default=4)
    s.add_argument("--micro-batches", type=int, default=8)
    s.add_argument("--vpp", type=int, default=1)
    s.add_argument("--costs", default="F=1,B=1,W=1",
                   help="per-op costs; a full backward costs B+W")
    s.add_argument("-o", "--output", default="schedule.png")
    a = ap.parse_args(argv)
    if a.what == "timeline":
        records, meta = load_records(a.path, a.iteration)
        if not records:
            raise DataError(f"timeline '{a.path}' holds no recorded iteration"
                            f"{f' {a.iteration}' if a.iteration else ''}")
        title = f"{meta.get('schedule', '')} PP={meta.get('pp', '?')} " \
                f"m={meta.get('micro_batches', '?')} (measured)"
        draw_pipeline(records, a.output, title, unit="s")
    else:
        virtual = get_schedule(a.schedule).virtual_stages
        if virtual and a.vpp < 2:
            a.vpp = 2
        a.vpp = get_schedule(a.schedule).chunks_per_rank or a.vpp   # DualPipeV: always 2
        costs = _costs(a.costs)
        if virtual:  # a chunk holds 1/v of a stage's layers
            costs = {k: c / a.vpp for k, c in costs.items()}
        records = simulated_records(a.schedule, a.pp, a.micro_batches, a.vpp, costs)
        v = f" v={a.vpp}" if virtual else ""
        draw_pipeline(records, a.output, f"{a.schedule} p={a.pp}{v} m={a.micro_batches} "
                      "(simulated)", unit="one stage's forward = 1", show_comm=False)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
