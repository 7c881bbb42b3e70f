"""Loss-curve PNG from a --metrics-file (train and validation points; an MoE run's aux
loss on a second axis)."""
from __future__ import annotations

import json

from megalite.viz.pyplot import matplotlib_modules


def plot_loss_curve(metrics_file: str, out_png: str) -> str:
    _, plt = matplotlib_modules()
    train, valid, aux = [], [], []
    with open(metrics_file) as fh:
        for line in fh:
            rec = json.loads(line)
            if "lm_loss" not in rec:          # e.g. the start-up memory report
                continue
            (valid if rec.get("split") == "valid" else train).append(
                (rec["iteration"], rec["lm_loss"]))
            if "moe_aux_loss" in rec:
                aux.append((rec["iteration"], rec["moe_aux_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("megalite training loss")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if aux:
        ax2 = ax.twinx()
        ax2.plot(*zip(*aux), color="tab:red", lw=1, label="moe aux loss")
        ax2.set_ylabel("moe aux loss")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
