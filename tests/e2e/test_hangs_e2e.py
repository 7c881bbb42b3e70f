"""Hangs explained, as a user meets them (issue 28): pretrain_gpt.py under torchrun on 8 gloo
processes, TP2 x PP2 x DP2, tiny model, short timeouts.

* One launch, three stops (the test hook ``MEGALITE_FAULT_INJECT`` makes a rank SIGSTOP
  itself just before a given op): before a TP all-reduce, before a pipeline receive, before
  the DP gradient all-reduce.  The first two are caught by ``--hang-watchdog-seconds``: every
  running rank dumps, ``megalite hangs DIR`` names the stopped rank, and the test resumes it
  (SIGCONT) so training goes on; SIGUSR2 to another rank makes it write its buffer; the
  third stop runs into ``--distributed-timeout-minutes``:
  within the timeout + 15 s one rank prints the diagnosis and every rank that can run exits.
* One launch where rank 5 skips one pipeline send in iteration 3: the diagnosis names
  rank 5; ``--dry-run --check-collectives`` with the same hook names the unmatched message
  and both call sites before anything is launched.
"""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
        "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-iters", "0",
        "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TIMEOUT_S = 20


def _torchrun(*args):
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
            "pretrain_gpt.py", *TINY, *args]


def _workers(proc, n=8, limit=120):
    """rank -> pid of torchrun's workers (their RANK variable)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        assert proc.poll() is None, "torchrun ended early"
        found = {}
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            rank = [v for v in env if v.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = pid
        if len(found) == n:
            return found
        time.sleep(0.2)
    raise AssertionError("workers never started")


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _wait(cond, limit, what):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"{what} within {limit} s")


def _fresh_dumps(folder, since):
    try:
        return [f for f in os.listdir(folder) if f.startswith("rank") and f.endswith(".json")
                and os.stat(os.path.join(folder, f)).st_mtime >= since]
    except OSError:
        return []


def _dumps_at(folder, iteration):
    """Dumps written at ``iteration`` or later (a slow start may trigger the watchdog
    before the fault)."""
    out = []
    for name in _fresh_dumps(folder, 0):
        try:
            with open(os.path.join(folder, name)) as f:
                if json.load(f)["iteration"] >= iteration:
                    out.append(name)
        except (OSError, ValueError):
            pass
    return out


def _reason(path, since):
    try:
        if os.stat(path).st_mtime >= since:
            with open(path) as f:
                return json.load(f)["reason"]
    except (OSError, ValueError):
        pass
    return None


def _hangs(folder):
    p = subprocess.run([PY, "-m", "megalite.cli", "hangs", str(folder)], capture_output=True,
                       text=True, env=ENV, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_sigstop_at_a_tp_a_pp_and_a_dp_position_is_diagnosed(tmp_path):
    dumps = tmp_path / "dumps"
    faults = ";".join(["stop:rank=1,iteration=3,group=tp,op=all_reduce,nth=3",
                       "stop:rank=4,iteration=6,group=pp,op=recv",
                       "stop:rank=2,iteration=9,group=dp-cp,op=all_reduce,phase=grad sync"])
    log = open(tmp_path / "stderr.txt", "w+")       # a pipe would fill and block the ranks
    proc = subprocess.Popen(_torchrun("--train-iters", "100000", "--hang-watchdog-seconds", "2",
                                      "--distributed-timeout-minutes", str(TIMEOUT_S / 60),
                                      "--hang-dump-dir", str(dumps), "--log-interval", "1000"),
                            cwd=ROOT, env={**ENV, "MEGALITE_FAULT_INJECT": faults},
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        pids = _workers(proc)
        # -- TP and PP positions: the watchdog dumps, `megalite hangs` names the rank ------
        for rank, waits_in in ((1, "all_reduce #"), (4, "p2p [")):
            _wait(lambda: _state(pids[rank]) == "T", 120, f"rank {rank} stopped")
            t_stop = time.time()
            _wait(lambda: len(_fresh_dumps(dumps, t_stop - 0.5)) >= 7, 30,
                  "7 watchdog dumps")
            text = _hangs(dumps)
            head = f"cause: rank {rank} -- "
            cause = next((l for l in text.splitlines() if l.startswith("cause:")), "")
            assert cause.startswith(head) and "stopped (SIGSTOP)" in cause, text
            assert "last op it completed" in text, text
            group = "tp[0,1]" if rank == 1 else "pp[0,4]"
            assert any(f"waits for it in" in l and group in l and waits_in in l
                       for l in text.splitlines()), text
            os.kill(pids[rank], signal.SIGCONT)
        # -- SIGUSR2: a rank writes its buffer, even from inside a collective, and goes on ----
        t_usr = time.time()
        os.kill(pids[6], signal.SIGUSR2)
        _wait(lambda: _reason(dumps / "rank00006.json", t_usr) == "SIGUSR2", 30,
              "rank 6's SIGUSR2 dump")
        # -- DP position: the collective timeout; every rank that can run exits -------------
        _wait(lambda: _state(pids[2]) == "T", 120, "rank 2 stopped")
        others = [p for r, p in pids.items() if r != 2]
        took = _wait(lambda: all(_state(p) in ("gone", "Z") for p in others),
                     TIMEOUT_S + 15, "every other rank exited")
        os.kill(pids[2], signal.SIGKILL)   # torchrun 2.13 waits 30 s before killing it itself
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids.values() if "pids" in locals() else ():
            if _state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)
    log.seek(0)
    err = log.read()
    assert proc.returncode != 0
    assert took <= TIMEOUT_S + 15, took
    printed = [l[len("[hang diagnosis] "):] for l in err.splitlines()
               if l.startswith("[hang diagnosis] ")]
    heads = [i for i, l in enumerate(printed) if l.startswith("hang diagnosis:")]
    assert heads, err[-4000:]                  # the last one printed is the timeout's
    assert printed[heads[-1] + 1].startswith("cause: rank 2 -- "), "\n".join(printed)
    saved = (dumps / "diagnosis.txt").read_text()
    assert "cause: rank 2 -- " in saved and "stopped (SIGSTOP)" in saved, saved
    assert any("waits for it in all_reduce" in l and "dp-cp[0,2]" in l and "grad sync" in l
               for l in saved.splitlines()), saved


def test_a_skipped_pipeline_send_is_named_before_launch_and_at_run_time(tmp_path):
    """TP2 x PP2 on 4 processes; rank 3 (last stage) drops one gradient send in iteration 3."""
    hook = {**ENV, "MEGALITE_FAULT_INJECT": "skip:rank=3,iteration=3,group=pp,op=send"}
    small = [*TINY, "--global-batch-size", "4", "--train-iters", "100000"]
    p = subprocess.run([PY, "pretrain_gpt.py", *small, "--dry-run", "--check-collectives",
                        "--world-size", "4"], capture_output=True, text=True, cwd=ROOT,
                       env=hook, timeout=300)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    line = next((l for l in p.stdout.splitlines() if "pp[1,3]" in l), "")
    assert "rank 3's send #1 to rank 1 (grad mb 1 stage 0" in line, p.stdout[-3000:]
    assert "is received by rank 1 as #1 (grad mb 0 stage 0" in line, line
    assert line.count("at iteration 3, forward-backward, comm[") == 2, line   # both sites
    assert "this layout would hang at launch" in p.stderr

    dumps = tmp_path / "dumps"
    log = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "4", "pretrain_gpt.py", *small,
                             "--hang-watchdog-seconds", "2", "--log-interval", "1000",
                             "--hang-dump-dir", str(dumps)],
                            cwd=ROOT, env=hook, stdout=subprocess.DEVNULL, stderr=log)
    try:
        _workers(proc, n=4)
        _wait(lambda: len(_dumps_at(dumps, 3)) >= 4, 180, "4 watchdog dumps in iteration 3")
        text = _hangs(dumps)
    finally:
        proc.terminate()          # SIGTERM: every rank writes its dump once more and exits
        proc.wait(timeout=60)
    cause = next((l for l in text.splitlines() if l.startswith("cause:")), "")
    assert cause.startswith("cause: rank 3 -- ") and "left its own program" in cause, text
    assert "evidence: rank 3 left its program at iteration 3" in text, text
