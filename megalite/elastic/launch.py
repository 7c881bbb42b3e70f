"""``python -m megalite.elastic.launch [--result-file F] TORCHRUN-ARGS``: torchrun for jobs
that lose and regain nodes.

torchrun's defaults are made for a fixed world; with them a re-formation after a lost node
took 41 s here and a survivor could wait 300 s at the exit barrier.  This wrapper runs
torchrun's own agent with:

- rendezvous settings for seconds-scale re-formation (``RDZV_DEFAULTS``; ``--rdzv-conf``
  overrides each): a dead node's heartbeat expires after ``keep_alive_interval`` x
  ``keep_alive_max_attempt`` seconds, and a rendezvous that has its minimum waits only
  ``last_call_timeout`` more for late nodes;
- an exit barrier of ``--exit-barrier-timeout`` seconds (torchrun: 300, not settable);
- each restart attempt with a store of its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``):
  otherwise restarted workers read the previous attempt's gloo/NCCL addresses;
- no restart after a user error (exit status 2): the same flags fail the same way again;
  the worker's one line is all that is printed (no failure summary, none of torch's
  shutdown log lines: the result file and the exit status say the rest);
- ``--standalone`` (one machine): none of the launcher's timeline lines either;
- the exit status of the failing worker (the first failure, as torchrun's summary names it;
  128 + N for a signal N) instead of torchrun's 1;
- the hang diagnosis once the workers are gone, when a worker died of a signal (the
  backend's own abort: gloo's "Received data size doesn't match expected size", NCCL's
  async error handling) and no worker printed it (``hang_dumps.diagnosis_after_exit``);
- ``--rdzv-backend etcd-v2 --rdzv-endpoint H1:P,H2:P,H3:P``: the rendezvous state in an
  etcd cluster instead of a store on the first node (``etcd_rdzv``: the first member that
  answers; none, or no etcd client: one line, exit status 2);
- ``--warm-spares N`` (``MEGALITE_WARM_SPARES``): N processes kept with torch and megalite
  imported, which a restart's workers run in instead of starting cold (``warm``);
- ``--result-file``: one line when the agent ends (``write_result``), which
  ``launch/slurm/pretrain.sbatch`` reads to end the job with the training's status without
  waiting for a node that is gone.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
import torch.distributed.launcher.api as launcher_api
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from megalite.diagnostics import hang_dumps
from megalite.elastic import etcd_rdzv, warm
from megalite.errors import EXIT_USER_ERROR, UserError

# Why each value: docs/fault_tolerance.md, "Rendezvous settings".
RDZV_DEFAULTS: Dict[str, str] = {
    "join_timeout": "600",          # a (re)start waits this long for --nnodes MIN nodes
    "last_call_timeout": "2",       # after MIN nodes joined, wait this long for more
    "close_timeout": "10",
    "keep_alive_interval": "1",     # heartbeat period of every agent
    "keep_alive_max_attempt": "3",  # a node silent for interval x attempts is dropped
}
EXIT_BARRIER_TIMEOUT_S = 15.0       # finished agents wait this long for each other
SHUTDOWN_TIMEOUT_S = 5              # SIGTERM -> SIGKILL of workers at a restart (torchrun: 30)


def merge_rdzv_conf(user: str) -> str:
    """``RDZV_DEFAULTS`` overridden by the user's ``--rdzv-conf k=v,k=v``."""
    conf = dict(RDZV_DEFAULTS)
    for item in filter(None, (user or "").split(",")):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    return ",".join(f"{k}={v}" for k, v in conf.items())


def exit_status(exitcode: int) -> int:
    """A worker's status as a shell reports it: 128 + N for death by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def root_cause(failures) -> Tuple[int, object]:
    """(global rank, ProcessFailure) of the failure that ended the run: the earliest, as
    torchrun's summary names it.  Timestamps have one-second resolution; within a second a
    specific status beats 1 (what a rank reports when a peer's failure broke its collective,
    megalite.training.faults.abort_all_ranks), and both beat SIGTERM (the agent stopping the
    remaining workers)."""
    def priority(code: int) -> int:
        return 2 if code == -15 else 1 if code == 1 else 0
    return min(failures.items(), key=lambda kv: (kv[1].timestamp, priority(kv[1].exitcode)))


def _agent_class():
    """torchrun's LocalElasticAgent with a short exit barrier and no restart after a user
    error; launch_agent builds it by this module-level name."""
    class MegaliteAgent(LocalElasticAgent):
        exit_barrier_timeout = EXIT_BARRIER_TIMEOUT_S

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("exit_barrier_timeout", type(self).exit_barrier_timeout)
            super().__init__(*args, **kwargs)

        timeline = True     # the launcher's own timestamped lines (off for --standalone)
        warm_spares = 0     # --warm-spares: processes kept with torch imported (warm.py)
        warm_pool = ""

        def _start_workers(self, worker_group):
            spec = worker_group.spec
            python = os.path.basename(spec.entrypoint or "").startswith("python")
            if not (self.warm_spares and python):
                return super()._start_workers(worker_group)
            original = self._warm_args = spec.args
            spec.args = ("-m", "megalite.elastic.warm", "client", self.warm_pool, *original)
            try:
                return super()._start_workers(worker_group)
            finally:
                spec.args = original
                self._top_up_warm()

        def _top_up_warm(self):
            """Spawn warm processes until ``warm_spares`` are starting or waiting."""
            procs = getattr(self, "_warm_procs", [])
            procs = [p for p in procs if p.poll() is None]
            for _ in range(self.warm_spares - sum(warm.idle(self.warm_pool, p) for p in procs)):
                procs.append(warm.spawn(self.warm_pool, warm.script_of(self._warm_args)))
            self._warm_procs = procs

        def _say(self, line: str) -> None:
            if self.timeline:
                say(line)

        def _monitor_workers(self, worker_group):
            with _held_torch_logs() as held:
                result = super()._monitor_workers(worker_group)
            if getattr(self, "_warm_args", None) is not None and \
                    result.state == WorkerState.HEALTHY:
                # a worker's client claims its spare after _start_workers returned (it is a
                # process of its own), possibly one the top-up there still counted as idle:
                # topping up on every check keeps warm_spares waiting
                self._top_up_warm()
            user_error = result.is_failed() and \
                exit_status(root_cause(result.failures)[1].exitcode) == EXIT_USER_ERROR
            if not user_error:   # a user error: the worker's one line says it all
                _release(held)
            if result.is_failed():
                codes = sorted({exit_status(f.exitcode) for f in result.failures.values()})
                if EXIT_USER_ERROR in codes:
                    self._remaining_restarts = 0  # a user error fails every attempt alike
                self._say(f"worker group failed (status {', '.join(map(str, codes))}); " + (
                    "a user error: not restarted" if EXIT_USER_ERROR in codes
                    else f"{self._remaining_restarts} restart(s) left"))
            return result

        def _rendezvous(self, worker_group):
            started = time.monotonic()
            super()._rendezvous(worker_group)
            g = worker_group
            self._say(f"rendezvous done in {time.monotonic() - started:.1f} s: node {g.group_rank} "
                f"of {g.group_world_size}, world {g.group_world_size * g.spec.local_world_size}, "
                f"restart {g.spec.max_restarts - self._remaining_restarts}")

    return MegaliteAgent


@contextlib.contextmanager
def _held_torch_logs():
    """The records torch's own loggers (``torch.distributed...``: the agent's "Sending
    process ... SIGTERM", "failed (exitcode: 2)") emit inside the block, held back instead
    of printed; yields the list, for ``_release`` or to be dropped."""
    handlers = logging.getLogger("torch.distributed").handlers
    held: list = []

    class Hold(logging.Filter):
        def filter(self, record) -> bool:
            if not any(r is record for r in held):
                held.append(record)
            return False
    hold = Hold()
    for handler in handlers:
        handler.addFilter(hold)
    try:
        yield held
    finally:
        for handler in handlers:
            handler.removeFilter(hold)


def _release(held: list) -> None:
    """Print held records after all, through their loggers."""
    for record in held:
        logging.getLogger(record.name).handle(record)


def say(line: str) -> None:
    """A timestamped line of the launcher's own (the fault timeline in each node's log)."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    print(f"[megalite launch {stamp}] {line}", file=sys.stderr, flush=True)


def _install_agent(exit_barrier_timeout: float, timeline: bool = True, warm_spares: int = 0,
                   warm_pool: str = "") -> None:
    agent = _agent_class()
    agent.exit_barrier_timeout = exit_barrier_timeout
    agent.timeline = timeline
    agent.warm_spares, agent.warm_pool = warm_spares, warm_pool
    launcher_api.LocalElasticAgent = agent


def write_result(path: Optional[str], code: int, kind: str, detail: str = "") -> None:
    """One line ``STATUS TIME HOST KIND DETAIL`` in ``path`` (``{host}`` is this host).
    KIND: ``done`` (this node's workers finished training), ``failed`` (the run failed: a
    user error or no restarts left; the rendezvous is closed) or ``left`` (only this agent
    ended -- cut off, rendezvous timeout, signal -- while the others may go on)."""
    if not path:
        return
    host = socket.gethostname()
    path = path.replace("{host}", host)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(f"{code} {time.time():.3f} {host} {kind} {detail}".rstrip() + "\n")


def parse(argv: List[str]):
    own = argparse.ArgumentParser(prog="python -m megalite.elastic.launch", add_help=False)
    own.add_argument("--result-file", default=os.environ.get("MEGALITE_RESULT_FILE"))
    own.add_argument("--exit-barrier-timeout", type=float, default=float(
        os.environ.get("MEGALITE_EXIT_BARRIER_TIMEOUT", EXIT_BARRIER_TIMEOUT_S)))
    own.add_argument("--warm-spares", type=int, default=int(os.environ.get(warm.ENV, "0")))
    ours, rest = own.parse_known_args(argv)
    if ours.warm_spares < 0:
        raise UserError(f"--warm-spares {ours.warm_spares}: give 0 (off) or the number of "
                        f"warm processes to keep (the workers per node restart warm)")

    args = torchrun.parse_args(rest)
    if args.rdzv_backend in ("c10d", etcd_rdzv.BACKEND) and not args.standalone:
        args.rdzv_conf = merge_rdzv_conf(args.rdzv_conf)   # both are torch's dynamic rendezvous
    if args.rdzv_backend == etcd_rdzv.BACKEND and not args.standalone:
        args.rdzv_endpoint = etcd_rdzv.first_live_endpoint(args.rdzv_endpoint)
        etcd_rdzv.install_retries()
    return ours, args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    try:
        ours, args = parse(argv)
    except UserError as exc:     # e.g. no etcd member answers: one line, no restart
        print(f"megalite launch: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    notes = _notes_folder()
    pool = os.path.join(notes, "warm")
    os.makedirs(pool)
    _install_agent(ours.exit_barrier_timeout, timeline=not args.standalone,
                   warm_spares=ours.warm_spares, warm_pool=pool)
    os.environ[hang_dumps.LAUNCHER_NOTE_ENV] = os.path.join(notes, "hang_note")
    try:
        return _run(ours, args)
    finally:
        shutil.rmtree(notes, ignore_errors=True)


NOTES_PREFIX = "megalite-launch-"


def _notes_folder() -> str:
    """This launcher's scratch folder (warm pool, hang note), named after its pid, after
    removing those of launchers on this host that ended without their ``finally`` (SIGKILL,
    the OOM killer): a folder whose pid is no longer a process is stale."""
    tmp = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            m = re.fullmatch(re.escape(NOTES_PREFIX) + r"(\d+)-\w+", name)
            if m is None or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            except PermissionError:      # another user's live launcher
                pass
    return tempfile.mkdtemp(prefix=f"{NOTES_PREFIX}{os.getpid()}-")


def _run(ours, args) -> int:
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        rank, failure = root_cause(exc.failures)
        code = exit_status(failure.exitcode)
        if code != EXIT_USER_ERROR:     # a user error: the worker printed its one line
            print(exc.format_msg(), file=sys.stderr, flush=True)
            text = hang_dumps.diagnosis_after_exit(os.environ[hang_dumps.LAUNCHER_NOTE_ENV])
            if text is not None:
                hang_dumps.print_prefixed(text)
        write_result(ours.result_file, code, "failed", f"rank {rank} exited with status {code}")
        return code
    except SignalException as exc:    # SLURM's SIGTERM (cancel, time limit): workers stopped
        code = 128 + int(exc.sigval)
        print(f"megalite launch: agent ended by {exc.sigval.name}", file=sys.stderr, flush=True)
        write_result(ours.result_file, code, "left", f"agent ended by {exc.sigval.name}")
        return code
    except Exception as exc:  # noqa: BLE001  (the agent's own failure: one line, status 1)
        line = f"megalite launch: error: {type(exc).__name__}: {exc}"
        print(line, file=sys.stderr, flush=True)
        write_result(ours.result_file, 1, "left", line)
        return 1
    write_result(ours.result_file, 0, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
