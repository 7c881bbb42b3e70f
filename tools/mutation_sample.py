#!/usr/bin/env python
"""Mutation sampling: cosmic-ray mutates, each module's targeted tests judge.

    python tools/mutation_sample.py --changed-since origin/main --max-mutants 30
    python tools/mutation_sample.py --sample --max-mutants 30      # docs/testing.md's sample
    python tools/mutation_sample.py --modules megalite/moe/router.py --max-mutants 10

For each module (the ``megalite/*.py`` files changed since REV, or those named) this copies
the checkout (tracked and untracked, not ignored, files) to a scratch directory, so your
own tree is never mutated, writes a cosmic-ray config whose test command runs only the
module's targeted tests (``tests/mutation_map.py``), lets ``cosmic-ray init`` enumerate
the mutants, draws a seeded sample of them (the budget spread evenly over the modules),
marks the rest skipped and runs ``cosmic-ray exec``.  It prints one line per mutant and
the diff of each survivor; ``--json FILE`` writes them too.  Exit status 1 when a mutant
survived, 2 for a module without a map entry.  Run it with an interpreter that has
cosmic-ray (kept out of the test extra: its ~15 dependencies are not the suite's) and name
the project's with ``--python`` (docs/testing.md, "Mutation sampling").
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from mutation_map import MAP, SAMPLE  # noqa: E402


def _git(*args, cwd=ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def changed_modules(rev: str) -> list:
    names = _git("diff", "--name-only", rev, "--", "megalite").split()
    names += _git("ls-files", "--others", "--exclude-standard", "megalite").split()
    return sorted({n for n in names if n.endswith(".py") and os.path.exists(os.path.join(ROOT, n))})


def copy_checkout(dest: str) -> None:
    files = _git("ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    for name in filter(None, files):
        src = os.path.join(ROOT, name)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, name)) or dest, exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))


def test_command(module: str, work: str, python: str) -> str:
    tests = [t for t in MAP[module] if os.path.exists(os.path.join(work, t.split("::")[0]))]
    if not tests:
        return ""
    return (f"{python} -m pytest -x -q -p no:cacheprovider "
            + " ".join(tests))


def focus_lines(path: str, functions) -> set:
    """The line numbers of the named functions (methods too) of the file at ``path``."""
    lines = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in functions:
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def write_config(path: str, module: str, command: str, timeout: float) -> None:
    with open(path, "w") as f:
        f.write(f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {timeout}\n'
                f'excluded-modules = []\ntest-command = "{command}"\n\n'
                '[cosmic-ray.distributor]\nname = "local"\n')


def run_module(cr: str, work: str, module: str, budget: int, seed: int, timeout: float,
               python: str, functions=None) -> list:
    # cosmic-ray is optional (the test extra does not install it): imported where needed,
    # so the map checks of tests/unit/test_mutation_map.py run without it
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    command = test_command(module, work, python)
    name = module.replace("/", "_")
    cfg, db = os.path.join(work, f"{name}.toml"), os.path.join(work, f"{name}.sqlite")
    write_config(cfg, module, command or "false", timeout)
    env = dict(os.environ, PYTHONPATH=work)
    subprocess.run([cr, "init", cfg, db], cwd=work, env=env, check=True)
    with use_db(db, WorkDB.Mode.open) as wdb:
        items = sorted(wdb.work_items, key=lambda w: (       # job ids are random: order by
            w.mutations[0].start_pos, w.mutations[0].operator_name,    # place, so a seed
            w.mutations[0].occurrence))                                # draws the same
        if functions:
            lines = focus_lines(os.path.join(work, module), functions)
            items = [w for w in items if w.mutations[0].start_pos[0] in lines]
        rng = random.Random(f"{seed}:{module}")     # a module's draw ignores the others
        picked = rng.sample(items, min(budget, len(items)))
        chosen = set(w.job_id for w in picked)
        skip = [w.job_id for w in wdb.work_items if w.job_id not in chosen]
        if skip:
            wdb.set_multiple_results(skip, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    if not command:
        return [dict(module=module, line=w.mutations[0].start_pos[0],
                     operator=w.mutations[0].operator_name, occurrence=w.mutations[0].occurrence,
                     outcome="no-targeted-test", diff="") for w in picked]
    subprocess.run([cr, "exec", cfg, db], cwd=work, env=env, check=True)
    rows = []
    with use_db(db, WorkDB.Mode.open) as wdb:
        for item, result in wdb.completed_work_items:
            if item.job_id not in chosen:
                continue
            spec = item.mutations[0]
            outcome = result.test_outcome.value if result.test_outcome else \
                result.worker_outcome.value
            rows.append(dict(module=module, line=spec.start_pos[0], operator=spec.operator_name,
                             occurrence=spec.occurrence, outcome=outcome,
                             diff=result.diff or ""))
    return sorted(rows, key=lambda r: (r["line"], r["operator"], r["occurrence"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--changed-since", metavar="REV", help="modules changed since REV")
    which.add_argument("--modules", nargs="+", metavar="PATH")
    which.add_argument("--sample", action="store_true", help="docs/testing.md's sample")
    ap.add_argument("--focus", action="store_true", help="only the functions SAMPLE names "
                    "(implied by --sample)")
    ap.add_argument("--max-mutants", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    ap.add_argument("--cosmic-ray", default=shutil.which("cosmic-ray") or os.path.join(
        os.path.dirname(sys.executable), "cosmic-ray"))
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter that runs the tests (default: this one)")
    ap.add_argument("--json", metavar="FILE", help="write every mutant's result")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    a = ap.parse_args(argv)
    # the tests run inside the scratch copy: a relative interpreter path would name a
    # file there (a checkout's .venv is not copied)
    a.python = os.path.abspath(a.python) if os.sep in a.python else a.python
    modules = (changed_modules(a.changed_since) if a.changed_since else
               list(SAMPLE) if a.sample else a.modules)
    unmapped = [m for m in modules if m not in MAP]
    for m in unmapped:
        print(f"unmapped: {m} (add its targeted tests to tests/mutation_map.py)")
    modules = [m for m in modules if m in MAP]
    if not modules:
        return 2 if unmapped else 0
    share = [a.max_mutants // len(modules) + (i < a.max_mutants % len(modules))
             for i in range(len(modules))]
    work = tempfile.mkdtemp(prefix="megalite-mutation-")
    rows = []
    try:
        copy_checkout(work)
        for module, budget in zip(modules, share):
            if budget:
                rows += run_module(a.cosmic_ray, work, module, budget, a.seed, a.timeout,
                                   a.python, SAMPLE.get(module) if a.sample or a.focus else None)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        print(f"{r['outcome']:>9}  {r['module']}:{r['line']}  {r['operator']}")
    survivors = [r for r in rows if r["outcome"] in ("survived", "no-targeted-test")]
    broken = [r for r in rows if r["outcome"] not in ("killed", "survived", "no-targeted-test")]
    for r in survivors:
        print(f"\n--- survived: {r['module']}:{r['line']} {r['operator']}\n{r['diff']}")
    killed = sum(r["outcome"] == "killed" for r in rows)
    judged = killed + len(survivors)
    print(f"\nkilled {killed} of {judged} mutants"
          + (f" ({100 * killed / judged:.0f}%)" if judged else ""))
    if broken:   # the test command could not judge them: a setup fault, not a survivor
        kinds = ", ".join(sorted({r["outcome"] for r in broken}))
        print(f"{len(broken)} mutants not judged ({kinds}): check --python and the map's tests")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 2 if unmapped or (broken and not judged) else int(bool(survivors))


if __name__ == "__main__":
    sys.exit(main())
