"""When a rank writes its flight recorder, where, and which rank prints the diagnosis.

A rank writes ``rank00003.json`` into the run's dump folder
* when a collective or p2p op fails or times out (``comm.CommError``, written by megalite.comm);
* when the rank fails with any other error, before it ends every rank (its peers' diagnosis
  then reads why it left);
* on SIGUSR2 (``kill -USR2 <pid>``), even while its main thread sits in a collective: the
  signal's byte arrives on a wakeup pipe that a monitor thread reads;
* from the watchdog (``--hang-watchdog-seconds S``): an op has waited and none has completed
  for S seconds.  Training is not interrupted; the dump is replaced on the next stall.

A rank the backend kills from C++ can write no dump: its ``rank00003.fatal.txt``
(``FatalRecord``) holds the op it began last and, from ``faulthandler``, its threads' stacks.

The folder is ``--hang-dump-dir``, else ``<--save>/hang_dumps``, else ``hang_dumps`` beside
``--metrics-file``, else ``/tmp/megalite-hangs/<run id>``.  After a ``CommError`` the first
rank to claim the folder's lock waits until the dumps stop arriving and prints the diagnosis
(also written to ``diagnosis.txt``); after a watchdog dump rank 0 does; after a rank died
of a signal, the first survivor ended by SIGTERM does, or ``megalite.elastic.launch`` once
the workers are gone (``diagnosis_after_exit``).  ``megalite hangs DIR`` prints it again
afterwards, from any machine that sees the folder.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import mmap
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Optional

import torch.distributed as dist

from megalite.comm import flight_recorder as fr
from megalite import comm
from megalite.comm import CommError
from megalite.diagnostics.hang_diagnosis import diagnose_folder
from megalite.diagnostics.hang_folder import BOX_HEAD, FATAL_HEADER, load_fatal, wait_for_dumps

QUIET_SECONDS = 3.0        # the diagnosis waits until no dump has arrived for this long ...
MAX_WAIT_SECONDS = 30.0    # ... or this long in all
LOCK_NAME = ".diagnosis-{run_id}.lock"
PRINTED_NAME = ".diagnosis-{run_id}.printed"


def dump_dir_for(cfg, run_id: str) -> str:
    p, c, lg = cfg.parallel, cfg.checkpoint, cfg.logging
    if p.hang_dump_dir:
        return p.hang_dump_dir
    if c.save:
        return os.path.join(c.save, "hang_dumps")
    if lg.metrics_file:
        return os.path.join(os.path.dirname(os.path.abspath(lg.metrics_file)), "hang_dumps")
    return os.path.join(tempfile.gettempdir(), "megalite-hangs", run_id)


def _ignore(signum, frame):
    """SIGTERM's Python-level handler while the monitor runs: the monitor thread (woken by
    the signal's byte even while the main thread is blocked in a collective) dumps and
    ends the process, as the default action would have."""


class Monitor(threading.Thread):
    """SIGUSR2 dumps, SIGTERM dumps and the watchdog, on a thread of their own: the main
    thread may be blocked inside a collective, where no Python signal handler runs.

    SIGTERM is how torchrun ends the other workers once one has failed, so without a dump
    on it the ranks still waiting would leave nothing.  It is handled only when nothing
    else handles it (``--exit-signal-handler`` saves and exits instead)."""

    def __init__(self, rec: fr.FlightRecorder, watchdog_seconds: Optional[float]):
        super().__init__(name="megalite-flight-recorder", daemon=True)
        self.rec, self.watchdog = rec, watchdog_seconds
        self.stopped = threading.Event()
        self.hurry = threading.Event()        # SIGTERM while the diagnosis waits for dumps
        self.diagnosing = False
        self.wake_r = None
        self._previous = {}
        self.fired_at_completed = -1          # the stall already dumped (completed count)
        if threading.current_thread() is threading.main_thread():
            self._install_signals()

    def _install_signals(self):
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w)
        except ValueError:
            previous = None
        if previous != -1:             # someone else owns the wakeup fd: leave it to them
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(r), os.close(w)
            return
        self.wake_r, self._wake_w = r, w
        self._previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, lambda *_: None)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _ignore)

    def run(self):
        while not self.stopped.is_set():
            if self.wake_r is not None:
                ready, _, _ = select.select([self.wake_r], [], [], 0.25)
                got = os.read(self.wake_r, 512) if ready else b""
                if signal.SIGUSR2 in got:
                    self.report("SIGUSR2", announce=False)
                if signal.SIGTERM in got and signal.getsignal(signal.SIGTERM) is _ignore:
                    if self.diagnosing or _claimed_here:   # the main thread prints, exits
                        self.hurry.set()
                    else:
                        self.rec.dump("SIGTERM (the job is being ended)")
                        if peer_died_of_a_signal(self.rec) and claim_diagnosis(self.rec):
                            self.hurry.set()     # only the dumps the SIGTERM brings
                            print_diagnosis(self.rec)
                        _fatal.close()
                        os._exit(128 + signal.SIGTERM)
            else:
                self.stopped.wait(0.25)
            if self.watchdog:
                self._check_watchdog()

    def _check_watchdog(self):
        rec = self.rec
        done = rec.completed
        if rec.started <= done or done == self.fired_at_completed:
            return
        idle = time.time() - rec.last_progress
        if idle >= self.watchdog:
            self.fired_at_completed = done
            self.report(f"watchdog: no collective completed for {idle:.1f} s", announce=True)

    def report(self, reason: str, announce: bool):
        path = self.rec.dump(reason)
        if path and announce:
            print(f"[rank {self.rec.rank}] flight recorder: {reason}; wrote {path} "
                  f"(diagnosis: megalite hangs {self.rec.dump_dir})", file=sys.stderr, flush=True)
        if path and announce and self.rec.rank == 0:    # waits for the others' dumps
            threading.Thread(target=print_diagnosis, args=(self.rec,), daemon=True).start()

    def close(self):
        self.stopped.set()
        if self.wake_r is not None:
            signal.set_wakeup_fd(-1)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self.join(timeout=2)
            os.close(self.wake_r), os.close(self._wake_w)
            self.wake_r = None


_monitor: Optional[Monitor] = None


def start(cfg, state) -> fr.FlightRecorder:
    """Set this process's recorder up for the run: size, rank, dump folder and what a dump
    needs to name peers (grid, hosts and pids of the ranks it shares a group with); start
    the monitor.  Collective: one small all-gather over the world."""
    global _monitor

    p = cfg.parallel      # flag values: checked by validation.check_hang_flags
    rec = fr.recorder
    if rec.capacity != p.flight_recorder_size:
        rec = fr.FlightRecorder(p.flight_recorder_size, faults=rec.faults)
        fr.install(rec)
    rec.rank = state.rank
    me = (socket.gethostname(), os.getpid(), time.time())
    world = state.world_group()
    everyone = comm.all_gather_object(me, world) if world.size > 1 else [me]
    host0, pid0, t0 = everyone[0]
    run_id = f"{host0}-{pid0}-{int(t0)}"
    neighbours = sorted({r for g in state.groups.values() for r in g.ranks})
    grid = state.grid
    rec.meta = {"run_id": run_id, "world_size": grid.world_size,
                "grid": {"tp": grid.dims["dense"]["tp"], "cp": grid.dims["dense"]["cp"],
                         "pp": grid.dims["dense"]["pp"], "ep": grid.dims["expert"]["ep"],
                         "etp": grid.dims["expert"]["tp"], "vpp": grid.vpp},
                "peers": {str(r): list(everyone[r][:2]) for r in neighbours},
                "backend": _backend(),
                "timeout_s": 60.0 * p.distributed_timeout_minutes,
                "watchdog_s": p.hang_watchdog_seconds}
    rec.dump_dir = dump_dir_for(cfg, run_id)
    _tell_the_launcher(rec)
    stop()                                   # a monitor left by an earlier run in-process
    if rec.enabled:
        _fatal.open(rec)
        _monitor = Monitor(rec, p.hang_watchdog_seconds)
        _monitor.start()
    return rec


class FatalRecord:
    """This rank's fatal-signal handler: ``faulthandler`` writes every thread's Python stack
    to ``rankNNNNN.fatal.txt`` in the dump folder when the process dies of SIGABRT, SIGSEGV,
    SIGBUS, SIGFPE or SIGILL -- how a backend ends a rank from C++ (gloo's "Received data
    size doesn't match expected size", NCCL's async error handling), where no Python runs
    and no dump can be written.  The file holds only a header until then and is removed
    when the process ends any other way; a folder it had to create goes with it."""

    def __init__(self):
        self.file = self.path = None
        self.made_dir = None
        self.was_enabled = False

    def open(self, rec: fr.FlightRecorder) -> None:
        self.close()
        # a folder this run creates is marked, so that whichever rank leaves last removes it
        # (ranks race to create it: "made" alone would leave it to one rank, maybe not last)
        marker = os.path.join(rec.dump_dir, f".created-by-{rec.meta.get('run_id', 'run')}")
        try:
            if not os.path.isdir(rec.dump_dir):
                os.makedirs(rec.dump_dir, exist_ok=True)
                open(marker, "a").close()
            self.path = os.path.join(rec.dump_dir, fr.fatal_name(rec.rank))
            self.file = open(self.path, "w+b")     # read too: a shared mapping needs it
            head = (FATAL_HEADER.format(run_id=rec.meta.get("run_id", "?"), rank=rec.rank,
                                        pid=os.getpid(), host=socket.gethostname())
                    + "\n" + BOX_HEAD).encode()
            self.file.write(head + b" " * fr.BOX_BYTES + b"\n")
            self.file.flush()
            self.header_size = self.file.tell()
            self.map = mmap.mmap(self.file.fileno(), self.header_size)
        except OSError as exc:
            print(f"[rank {rec.rank}] flight recorder: cannot write a fatal-signal record in "
                  f"{rec.dump_dir}: {exc}", file=sys.stderr, flush=True)
            self.file = self.path = None
            return
        self.rec, rec.box = rec, fr.InFlight(self.map, len(head))
        self.made_dir, self.marker = rec.dump_dir, marker     # removed if the mark is there
        self.was_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=self.file, all_threads=True)

    def close(self) -> None:
        if self.file is None:
            return
        faulthandler.disable()
        if self.was_enabled:                # back to the process's stderr, as it was
            try:
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
            except (AttributeError, ValueError, io.UnsupportedOperation):
                pass                        # no file descriptor behind stderr (embedded)
        self.rec.box = None
        self.map.close()
        written = os.fstat(self.file.fileno()).st_size > self.header_size
        self.file.close()
        if not written:
            with contextlib.suppress(OSError):    # a folder not empty, a file gone
                os.remove(self.path)
                # the last rank out of a folder this run created removes it (and its mark)
                if self.made_dir and os.listdir(self.made_dir) == [
                        os.path.basename(self.marker)]:
                    os.remove(self.marker)
                    os.rmdir(self.made_dir)     # only if empty
        self.file = self.path = self.made_dir = None


_fatal = FatalRecord()
atexit.register(_fatal.close)


def _backend() -> str:
    return str(dist.get_backend()) if dist.is_initialized() else "none"


def stop() -> None:
    global _monitor
    if _monitor is not None:
        _monitor.close()
        _monitor = None
    _fatal.close()


def on_failure(exc: BaseException) -> None:
    """A rank is about to end every rank because of ``exc``: make sure its dump is written,
    and after a failed collective let one rank print the diagnosis."""
    rec = fr.recorder
    if not rec.enabled or not rec.dump_dir:
        return
    try:
        rec.settle()
        if not isinstance(exc, CommError) and isinstance(exc, RuntimeError) and rec.outstanding:
            for e, _work in rec.outstanding:   # torch's own wait on FSDP2's op failed
                rec.fail(e, exc)
        elif not isinstance(exc, CommError):
            rec.dump(f"error: {type(exc).__name__}: {str(exc).strip()[:300]}")
            return
        if claim_diagnosis(rec):     # else another rank prints it (or the folder is unwritable)
            print_diagnosis(rec)
    finally:
        _fatal.close()               # the process ends by os._exit: no atexit


_claimed_here = False       # this process holds the run's diagnosis lock: it prints


def claim_diagnosis(rec: fr.FlightRecorder) -> bool:
    """True for the first rank to ask: it prints the run's diagnosis."""
    global _claimed_here
    _claimed_here = _claim(rec.dump_dir, rec.meta.get("run_id", ""))
    return _claimed_here


def _claim(folder: str, run_id: str) -> bool:
    try:
        os.close(os.open(os.path.join(folder, LOCK_NAME.format(run_id=run_id)),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return False
    return True


def peer_died_of_a_signal(rec: fr.FlightRecorder) -> bool:
    """Some rank of this run left a fatal-signal record: the backend aborted it (or it
    crashed), so no rank saw an error to print the diagnosis after."""
    return bool(load_fatal([rec.dump_dir], rec.meta.get("run_id")))


# The launcher (megalite.elastic.launch) names a file in this variable; a node's first
# worker writes its dump folder and run id there, so that the launcher can print the
# diagnosis once the workers are gone when none of them did.
LAUNCHER_NOTE_ENV = "MEGALITE_HANG_NOTE"


def _tell_the_launcher(rec: fr.FlightRecorder) -> None:
    note = os.environ.get(LAUNCHER_NOTE_ENV)
    if not note or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        with open(f"{note}.tmp", "w") as f:
            f.write(f"{rec.meta.get('run_id', '')}\n{rec.dump_dir}\n")
        os.replace(f"{note}.tmp", note)
    except OSError:
        pass                        # no diagnosis from the launcher; the ranks' stands


def diagnosis_after_exit(note: str) -> Optional[str]:
    """For the launcher, once its workers are gone: the diagnosis of the run its workers
    noted in ``note``, when a rank died of a signal and no rank printed one (it claims
    the folder's lock and writes diagnosis.txt); None otherwise."""
    try:
        with open(note) as f:
            run_id, folder = f.read().splitlines()[:2]
    except (OSError, ValueError):
        return None
    if not load_fatal([folder], run_id) or \
            os.path.exists(os.path.join(folder, PRINTED_NAME.format(run_id=run_id))):
        return None                 # (a rank that claimed the lock may have died unprinted)
    text = diagnose_folder([folder], run_id)
    _written(folder, run_id, text)
    return text


def _written(folder: str, run_id: str, text: str) -> None:
    """diagnosis.txt, and the mark that the run's diagnosis has been printed."""
    try:
        with open(os.path.join(folder, "diagnosis.txt"), "w") as f:
            f.write(text + "\n")
        open(os.path.join(folder, PRINTED_NAME.format(run_id=run_id)), "w").close()
    except OSError:
        pass


def print_diagnosis(rec: fr.FlightRecorder) -> None:
    """Wait for the other ranks' dumps, then print the diagnosis and write diagnosis.txt.
    A SIGTERM meanwhile (torchrun ending the job) cuts the wait short."""
    monitor = _monitor
    if monitor is not None:
        monitor.diagnosing = True
    try:
        wait_for_dumps(rec.dump_dir, rec.meta.get("run_id"), rec.meta.get("world_size", 1),
                       QUIET_SECONDS, MAX_WAIT_SECONDS,
                       hurry=monitor.hurry if monitor is not None else None)
        text = diagnose_folder([rec.dump_dir])
        _written(rec.dump_dir, rec.meta.get("run_id", ""), text)
    except Exception as exc:        # the diagnosis must never hide the original error
        text = f"hang diagnosis failed: {type(exc).__name__}: {exc}"
    finally:
        if monitor is not None:
            monitor.diagnosing = False
    print_prefixed(text)


def print_prefixed(text: str) -> None:
    """The diagnosis on stderr, each line marked ``[hang diagnosis]`` (docs/troubleshooting.md)."""
    sys.stderr.write("".join(f"[hang diagnosis] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()
