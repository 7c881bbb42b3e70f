#!/usr/bin/env python
"""Every Hugging Face family's import against transformers, side by side, in one process:
the tiny random model of each family (``tests/hf_families.py``, and the DeepSeek-V3-style
configs of ``tests/unit/test_deepseek_v3_configs.py``: an own ``rms_norm_eps``, Moonlight,
Kimi K2) imported through the adapter, its logits on 2 x 40 tokens compared with
transformers' (max |delta logit| and max relative), then exported and reloaded by
transformers (relative).  TP2 / PP2 losses of the newer families are printed by
``tests/distributed/test_hf_families_dist.py -s``.

The same measurements make docs/models.md's exactness table (``render_table``): each
family's bound is the power of ten above twice its measured max |delta logit| (so another
CPU's rounding keeps the page), and what its config may hold that megalite refuses is the one
line the user sees (``tests/unit/test_hf_families.py``'s ``REFUSALS``).
``tests/unit/test_models_page.py`` fails when the page differs; ``--update`` rewrites it.
A new family joins by its entry in ``tests/hf_families.py`` (``FAMILIES``).

    python benchmarks/hf_families_exactness.py            # print the measurements
    python benchmarks/hf_families_exactness.py --update   # and rewrite docs/models.md's table
"""
import math
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "unit"),
                os.path.join(ROOT, "tests", "distributed")]

from hf_families import FAMILIES, VOCAB, save_hf_model  # noqa: E402
from megalite.checkpointing import hf  # noqa: E402
from megalite.checkpointing.model_io import load_full_state_dict  # noqa: E402
from megalite.config import MegaliteConfig, ModelConfig  # noqa: E402
from megalite.models.gpt import build_model, single_rank_state  # noqa: E402
import test_deepseek_v3_configs as ds  # noqa: E402
import test_hf_families_dist as dist_test  # noqa: E402

import transformers  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "models.md")
BEGIN = "<!-- exactness table: python benchmarks/hf_families_exactness.py --update -->"
END = "<!-- end of exactness table -->"
# where each family's other layouts are held to transformers' loss (rel <= 1e-5)
LAYOUTS_TEST = "tests/distributed/test_hf_families_dist.py"
LAYOUTS = {f: ", ".join(n.upper() for n in dist_test.family_layouts(f)) for f in dist_test.NEW}
BOUND_COLUMNS = (2, 3, 4)       # the measured columns of a row (a bound each)


def _row(name, ref, path, vocab) -> dict:
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    model_cfg, full = hf.import_hf(path)
    model = build_model(MegaliteConfig(model=ModelConfig(**model_cfg)), single_rank_state())
    load_full_state_dict(model.eval(), full, single_rank_state())
    with torch.no_grad():
        expected = ref(ids).logits
        delta = (model(ids)[..., :vocab] - expected).abs().max().item()
    out = path + "_out"
    hf.export_hf(out, model_cfg, full, architecture=ref.config.architectures[0])
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        back_rel = ((back(ids).logits - expected).abs().max() / expected.abs().max()).item()
    return {"family": name, "architecture": ref.config.architectures[0], "delta": delta,
            "rel": delta / expected.abs().max().item(), "export_rel": back_rel}


def measure(print_rows: bool = False) -> list:
    """One row per family: its TP1 logits against transformers' and the export's."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows = []
    if print_rows:
        print(f"{'family':18s} {'architecture':24s} {'max|dlogit|':>14s} {'rel':>10s} "
              f"{'export rel':>12s}")
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(f, lambda p, f=f: save_hf_model(f, p), VOCAB) for f in FAMILIES] + \
                [(n, lambda p, n=n: ds._save(n, p), ds.VOCAB) for n in ds.CONFIGS]
        for name, save, vocab in cases:
            path = os.path.join(tmp, name)
            row = _row(name, save(path), path, vocab)
            rows.append(row)
            if print_rows:
                print(f"{name:18s} {row['architecture']:24s} {row['delta']:14.2e} "
                      f"{row['rel']:10.2e} {row['export_rel']:12.2e}")
    return rows


def bound(value: float) -> str:
    """The power of ten above twice ``value`` (0 stays 0): another CPU's rounding moves a
    measurement by far less than 2x, so the page does not flip on it."""
    return "0" if value == 0 else f"1e{math.floor(math.log10(2 * value)) + 1}"


def refusals() -> dict:
    """family -> [(config key, the one line megalite prints)] of the refusal cases."""
    from test_hf_families import REFUSALS, _cfg
    from megalite.checkpointing.hf_adapters import UnsupportedModelError

    out = {}
    for family, change, _ in REFUSALS:
        try:
            hf.hf_config_to_model_config(_cfg(family, **change))
        except UnsupportedModelError as exc:
            out.setdefault(family, []).append((next(iter(change)), str(exc)))
    return out


def render_table(rows: list) -> str:
    refused = refusals()
    lines = [BEGIN, "",
             "| family | architecture | TP1: max \\|Δlogit\\| below | TP1: rel below | "
             f"export: rel below | other layouts at transformers' loss ({LAYOUTS_TEST}) | "
             "refused in one line (config key: what megalite says) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        why = "; ".join(f"`{k}`: {msg}".replace("|", "/")
                        for k, msg in refused.get(r["family"], [])) or "—"
        lines.append(f"| {r['family']} | `{r['architecture']}` | {bound(r['delta'])} | "
                     f"{bound(r['rel'])} | {bound(r['export_rel'])} | "
                     f"{LAYOUTS.get(r['family'], '—')} | {why} |")
    return "\n".join(lines + ["", END])


def _cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def table_problems(rows: list, page: str) -> list:
    """What the page's table gets wrong about ``rows``: a family missing or extra, a cell
    other than a bound that differs, a measurement at or above its documented bound."""
    if BEGIN not in page or END not in page:
        return [f"no exactness table markers ({BEGIN})"]
    documented = {_cells(line)[0]: _cells(line) for line in
                  page.split(BEGIN, 1)[1].split(END, 1)[0].splitlines()[4:] if line.strip()}
    wanted = {_cells(line)[0]: _cells(line) for line in render_table(rows).splitlines()[4:-2]}
    problems = [f"family {f} is {'missing' if f in wanted else 'extra'}"
                for f in set(wanted) ^ set(documented)]
    keys = {2: "delta", 3: "rel", 4: "export_rel"}
    for r in rows:
        doc, want = documented.get(r["family"]), wanted[r["family"]]
        if doc is None:
            continue
        for i, (a, b) in enumerate(zip(doc, want)):
            if i in BOUND_COLUMNS:
                if r[keys[i]] > 0 and not r[keys[i]] < float(a):
                    problems.append(f"{r['family']}: measured {r[keys[i]]:.2e} is not below "
                                    f"the documented {a}")
            elif a != b:
                problems.append(f"{r['family']}: '{a}' should be '{b}'")
    return problems


def page_with(table: str) -> str:
    page = open(PAGE, encoding="utf-8").read()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE} has no exactness table markers ({BEGIN})")
    head, rest = page.split(BEGIN, 1)
    return head + table + rest.split(END, 1)[1]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rows = measure(print_rows=True)
    if "--update" in argv:
        page = page_with(render_table(rows))      # read before the file is truncated
        with open(PAGE, "w", encoding="utf-8") as fh:
            fh.write(page)
        print(f"wrote the exactness table of {os.path.relpath(PAGE, ROOT)}")


if __name__ == "__main__":
    main()
