"""Warm spare workers: a restart that does not pay the interpreter's start-up.

A restarted worker spends most of its start-up importing torch and megalite (about 11 s of
wall time on this project's loaded 2-core machine) before it can join a process group.  With
``python -m megalite.elastic.launch --warm-spares N`` the agent keeps N processes that have
done that already (``serve``: torch, torch.distributed and the modules the training script
imports at its top level, imported; nothing rank-specific built), each waiting on a unix socket in the
agent's pool folder.

Every worker the agent starts is a small client (``client``: no torch) that claims one warm
process (an atomic rename of its socket), hands it its argv, environment, working folder and
standard streams (file descriptors over the socket), forwards the agent's signals to it and
exits with its status.  The warm process then runs the training script as ``__main__``; when
the client goes away (the agent SIGKILLs it), the warm process kills itself.  No warm process
left: the client becomes the cold worker (exec).  The agent tops the pool up after every
start, so the next restart finds it warm again; a warm process dies with its agent.
"""
from __future__ import annotations

import ast
import ctypes
import importlib
import glob
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import List, Optional

ENV = "MEGALITE_WARM_SPARES"
WORKER_ENV = "MEGALITE_WARM_WORKER"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the agent that spawned it dies."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def script_of(python_args) -> Optional[str]:
    """The script of ``python [-u ...] SCRIPT ARGS`` (None for ``-m MODULE``)."""
    for arg in python_args:
        if arg == "-m":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def top_level_imports(script: Optional[str]) -> List[str]:
    """The modules ``script`` imports at its top level (what a warm process imports ahead)."""
    try:
        tree = ast.parse(open(script).read())
    except (OSError, SyntaxError, TypeError, ValueError):
        return []
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
    return out


def spawn(pool: str, script: Optional[str]) -> "object":
    """Start one warm process for ``pool`` that imports what ``script`` imports (a child of
    the caller: it dies with it)."""
    return subprocess.Popen([sys.executable, "-m", "megalite.elastic.warm", "serve", pool,
                             *top_level_imports(script)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def idle(pool: str, proc) -> bool:
    """Whether warm process ``proc`` of ``pool`` is still to be claimed (starting or waiting)."""
    base = os.path.join(pool, f"warm-{proc.pid}")
    return proc.poll() is None and (os.path.exists(base + ".starting") or
                                    os.path.exists(base + ".sock"))


def serve(pool: str, modules: List[str]) -> int:
    """A warm process: import torch and ``modules``, then wait for one client."""
    _die_with_parent()
    path = os.path.join(pool, f"warm-{os.getpid()}.sock")
    open(path[:-len(".sock")] + ".starting", "w").close()
    started = time.monotonic()
    for name in ("torch", "torch.distributed", *modules):   # the point: imported before needed
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (the worker will meet the same error, cold)
            pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    srv.listen(1)
    os.rename(path + ".tmp", path)          # visible to clients only once listening
    os.unlink(path[:-len(".sock")] + ".starting")
    imported = time.monotonic() - started
    conn, _ = srv.accept()
    srv.close()
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    job = json.loads(msg.decode())
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    os.environ[WORKER_ENV] = "1"             # tests and logs can tell a warm start
    print(f"> warm spare: this worker runs in a process that imported torch and "
          f"{len(modules)} more module(s) ({imported:.1f} s) before it was needed",
          file=sys.stderr, flush=True)
    os.chdir(job["cwd"])
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")

    def client_gone():                      # the client is the agent's handle on us
        while conn.recv(1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=client_gone, daemon=True).start()
    return _run_script(job["argv"], conn)


def _run_script(argv: List[str], conn) -> int:
    """Run ``python ARGV`` in this process: -u honoured, the script as ``__main__``."""
    args = list(argv)
    while args and args[0].startswith("-") and args[0] != "-m":
        if args.pop(0) == "-u":
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(line_buffering=True, write_through=True)
    code = 0
    try:
        if args[:1] == ["-m"]:
            sys.argv = args[1:]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (a bug in the script: its traceback, status 1)
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    except OSError:
        pass
    os._exit(code)


def _claim(pool: str) -> Optional[str]:
    for path in sorted(glob.glob(os.path.join(pool, "warm-*.sock"))):
        claimed = f"{path}.claimed-{os.getpid()}"
        try:
            os.rename(path, claimed)        # atomic: one client per warm process
        except OSError:
            continue
        return claimed
    return None


def client(pool: str, argv: List[str]) -> int:
    """The worker the agent sees: hand the job to a warm process, relay signals and status."""
    claimed = _claim(pool)
    if claimed is None:                      # none warm: be the cold worker
        os.execv(sys.executable, [sys.executable, *argv])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(claimed)
    os.unlink(claimed)
    job = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(job).encode()], [0, 1, 2])
    reader = conn.makefile("r")
    pid = json.loads(reader.readline())["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    line = reader.readline()
    if line:
        return int(json.loads(line)["exit"])
    # the warm process died without a status: by a signal (SIGKILL is the one it cannot
    # report); die the same way so that the agent sees a signal death
    os.kill(os.getpid(), signal.SIGKILL)
    return 137


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "serve":
        return serve(argv[1], argv[2:])
    if len(argv) >= 3 and argv[0] == "client":
        return client(argv[1], argv[2:])
    print("usage: python -m megalite.elastic.warm serve POOL [MODULE...] | client POOL PYTHON-ARGS...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
