"""Every shell command in README.md and docs/*.md either runs here, as written, or is listed
below with the reason it does not (GPU, SLURM, several nodes, the reader's own files, elided
flags, or long and run by a named test).

Commands are taken from fenced blocks: ``bash``/``sh``/``shell`` blocks line by line,
``console`` blocks from their ``$ `` lines, untagged blocks where a line has a ``$ `` prompt or
starts with a program (``python``, ``torchrun``, ``megalite``, ...). Continuation lines are joined and
comments dropped. Each document's commands run in order, in a fresh directory that links the
repository's files (``data/`` is copied, so outputs never land in the checkout), with this
interpreter first on ``PATH``. Two documents run at a time (the file's wall time was a third idle core). ``megalite`` runs as ``python -m megalite.cli`` (the same entry
point, without needing the console script installed).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PROGRAMS = {"python", "python3", "torchrun", "megalite", "bash", "sbatch", "pip", ".",
            "pretrain_gpt.py", "pretrain_moe.py"}
TIMEOUT_S = 300


@dataclass
class DocCommand:
    doc: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _strip_comment(line: str) -> str:
    """Drop a trailing ``# comment`` that is outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _looks_like_command(line: str) -> bool:
    """In an untagged block (diagrams, file trees, logs), only a line that starts with a
    program, a ``launch/*.sh`` script or a ``VAR=value`` prefix is a command."""
    words = line.split()
    while words and re.match(r"^[A-Z_]+=\S*$", words[0]):   # NPROC=8 launch/run_local.sh
        words.pop(0)
    if not words or (len(words) > 1 and words[1] == "/"):   # "a.py / b.py   description"
        return False
    return words[0] in PROGRAMS or bool(re.match(r"^launch/\S+\.sh$", words[0]))


def extract_commands(doc: str) -> List[DocCommand]:
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    out = []
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        lang, body = m.group(1), m.group(2)
        first_line = text[:m.start(2)].count("\n") + 1
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        pending, start = "", 0
        for k, raw in enumerate(body.split("\n")):
            if not pending:
                if raw.startswith("$ ") and lang in ("console", ""):
                    raw = raw[2:]                            # a prompt: the rest is a command
                elif lang == "console":
                    continue                                 # output
                stripped = _strip_comment(raw).strip()
                if not stripped:
                    continue
                if lang == "" and not _looks_like_command(stripped):
                    continue
                start = first_line + k
            else:
                stripped = _strip_comment(raw).strip()
            if stripped.endswith("\\"):
                pending += stripped[:-1].rstrip() + " "
                continue
            out.append(DocCommand(doc, start, (pending + stripped).strip()))
            pending = ""
    return out


# ---- what each command needs: (regex searched in the command, reason) ---------------------
SKIP = [
    (r"^bash launch/test\.sh", "runs the whole test suite, which includes this test"),
    (r"^pip install", "installs packages; the test environment is already installed"),
    (r"^\. \.venv/bin/activate", "activates the environment launch/setup_env.sh creates"),
    (r"(^|\s)\.\.\.(\s|$)", "elided flags ('...'): a fragment, not a command"),
    (r"^sbatch ", "SLURM; tests/e2e/test_slurm_e2e.py runs pretrain.sbatch under slurmd"),
    (r"^srun --jobid", "SLURM: a step in a running job; tests/e2e/test_slurm_elastic_e2e.py "
     "runs the script's steps"),
    (r"--nnodes 2", "needs two nodes"),
    (r"RECIPE\.yaml", "template: RECIPE.yaml stands for the reader's recipe"),
    (r"--input my\.jsonl|--tokenizer-model tok\.model",
     "template: my.jsonl and tok.model are the reader's own files"),
    (r"--hf-config path/to/config\.json",
     "template: the reader's config.json; tests/unit/test_planner_cli.py runs --hf-config"),
    (r"viz timeline trace\.json",
     "needs trace.json from a --pipeline-timeline run; tests/unit/test_pipeline_viz.py"),
    (r"^megalite hangs /checkpoints/",
     "needs the dumps of a hung run; tests/e2e/test_hangs_e2e.py runs it on real ones"),
    (r"^python benchmarks/",
     "benchmark (minutes on CPU, needs a quiet machine); its output is quoted, not checked"),
    (r"^NPROC=8 launch/run_local\.sh launch/recipes/twins/gpt3-175b\.yaml",
     "long (8 processes); tests/e2e/test_recipes_e2e.py runs this twin through run_local.sh"),
    (r"^megalite plan --validate-run --nproc 4 .*--use-torch-fsdp2 --pipeline-model-parallel-size 2",
     "long (4 processes); tests/distributed/test_planner_validate_dist.py::fsdp2_pp2_llama "
     "runs these flags"),
    (r"cosmic-ray", "mutation sampling: installs cosmic-ray and runs minutes of mutants; "
     "tests/unit/test_mutation_map.py checks the map and the tool's rules"),
    (r"^megalite plan --validate-run --nproc 4 --num-layers 4 .*--pipeline-model-parallel-size 2",
     "long (4 processes); tests/distributed/test_planner_validate_dist.py::"
     "tp2_pp2_sp_llama_bf16 runs these flags"),
]
# Commands run with a shorter run length: (regex, extra environment, extra arguments, why).
SHRINK = [
    (r"^bash launch/demo\.sh", {"DEMO_ITERS": "2", "DEMO_NPROC": "2"}, [],
     "README's quick form (DEMO_ITERS, DEMO_NPROC)"),
    (r"^python -m megalite\.elastic\.launch --standalone --nproc-per-node 4 pretrain_gpt\.py "
     r".*--train-iters 100", {},
     ["--train-iters", "3", "--eval-iters", "2"], "100 -> 3 iterations, 2 evaluation batches"),
    (r"^launch/run_local\.sh launch/recipes/twins/llama3-405b\.yaml --train-iters 20", {},
     ["--train-iters", "3"], "20 -> 3 iterations (the twin warms up over 2)"),
]


def classify(cmd: DocCommand, seen: Dict[str, str]) -> Optional[str]:
    """The reason ``cmd`` is skipped, or None when it runs."""
    for pattern, reason in SKIP:
        if re.search(pattern, cmd.text):
            return reason
    if cmd.text in seen:
        return f"same command as {seen[cmd.text]} (run there)"
    seen[cmd.text] = cmd.where
    return None


def plan() -> Dict[str, List[tuple]]:
    """{doc: [(command, skip reason or None), ...]} in document order."""
    seen: Dict[str, str] = {}
    return {doc: [(c, classify(c, seen)) for c in extract_commands(doc)] for doc in DOCS}


def _sandbox(tmp_path) -> str:
    box = tmp_path / "box"
    box.mkdir()
    for name in os.listdir(ROOT):
        if name in (".git", "outputs", ".venv", "data") or name.startswith(".pytest"):
            continue
        os.symlink(os.path.join(ROOT, name), box / name)
    shutil.copytree(os.path.join(ROOT, "data"), box / "data")
    return str(box)


def _fake_venv(tmp_path) -> str:
    """launch/setup_env.sh's environment, already made: this interpreter, installed stamps
    newer than setup.py, so the demo installs nothing."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"        # a wrapper: a symlink would lose the venv's packages
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / "bin" / "activate").write_text(
        f'export PATH="{os.path.dirname(sys.executable)}:$PATH"\n')
    for extras in ("plot", "test"):
        (venv / f".megalite-installed-{extras}").write_text("")
    return str(venv)


def _run(cmd: DocCommand, box: str, env: dict) -> None:
    text = re.sub(r"^megalite ", "python -m megalite.cli ", cmd.text)
    extra_env, extra_args = {}, []
    for pattern, e, a, _ in SHRINK:
        if re.search(pattern, cmd.text):
            extra_env, extra_args = e, a
    if extra_args:
        text += " " + " ".join(extra_args)
    proc = subprocess.run(["bash", "-c", "set -eo pipefail; " + text], cwd=box,
                          env={**env, **extra_env}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, (f"{cmd.where}: {text}\nexit {proc.returncode}\n"
                                  f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}")


def test_every_command_is_found_and_classified():
    """The extraction sees the documented commands, and every skip rule is still used
    (a rule whose command left the docs must go too)."""
    p = plan()
    flat = [c for cmds in p.values() for c in cmds]
    texts = [c.text for c, _ in flat]
    assert any(t.startswith("python tools/checkpoint/convert.py --source-format hf") for t in texts)
    assert any(t.startswith("megalite plan --recipe llama3-8b --num-gpus 64") for t in texts)
    assert all("\\" not in t and not t.startswith("#") for t in texts)
    for pattern, reason in SKIP:
        assert any(re.search(pattern, t) for t in texts), f"unused skip rule: {pattern}"
    for pattern, *_ in SHRINK:
        assert any(re.search(pattern, t) for t in texts), f"unused shrink rule: {pattern}"
    runs = [c for c, why in flat if why is None]
    assert len(runs) >= 15, [c.where for c in runs]


RUN_DOCS = [d for d, cmds in plan().items() if any(w is None for _, w in cmds)]


def _run_doc(doc: str, tmp_path) -> Optional[str]:
    """``doc``'s commands in order, in a sandbox under ``tmp_path``: None, or the failure."""
    box = _sandbox(tmp_path)
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONPATH": box, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
           "MPLBACKEND": "Agg", "MEGALITE_VENV": _fake_venv(tmp_path),
           "DEMO_OUT": str(tmp_path / "demo")}
    env.pop("PYTHONSTARTUP", None)
    try:
        for cmd, why in plan()[doc]:
            if why is None:
                _run(cmd, box, env)
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def doc_results(tmp_path_factory) -> Dict[str, Optional[str]]:
    """Every document's commands, two documents at a time (each in its own sandbox): most
    commands are one process, and the second core idled while one ran."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {doc: pool.submit(_run_doc, doc, tmp_path_factory.mktemp("doc"))
                   for doc in RUN_DOCS}
    return {doc: f.result() for doc, f in futures.items()}


@pytest.mark.parametrize("doc", RUN_DOCS)
def test_doc_commands_run(doc, doc_results):
    assert doc_results[doc] is None, doc_results[doc]
