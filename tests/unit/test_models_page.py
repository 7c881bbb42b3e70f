"""docs/models.md's exactness table is what benchmarks/hf_families_exactness.py measures:
every family of tests/hf_families.py (and the DeepSeek-V3-style configs) has its row, each
measured max |delta logit| (TP1, and the export's) lies below the bound the page states,
and the refusals are the lines megalite prints today.  A stale page names the fix."""
import os
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import hf_families_exactness as bench  # noqa: E402


def test_the_models_page_exactness_table_is_current():
    rows = bench.measure()
    assert {r["family"] for r in rows} >= set(bench.FAMILIES)
    assert all(r["rel"] <= 1e-5 and r["export_rel"] <= 1e-5 for r in rows), rows
    page = open(bench.PAGE, encoding="utf-8").read()
    problems = bench.table_problems(rows, page)
    assert not problems, ("docs/models.md is stale: run python "
                          "benchmarks/hf_families_exactness.py --update; " + "; ".join(problems))
