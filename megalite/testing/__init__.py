"""Run a function on N real gloo processes, reusing the processes across calls.

Spawning and importing torch is the slow part of a multi-process test on a 2-core
machine, so a ``WorkerPool`` per world size stays alive for the whole pytest session
and runs one test function after another.  A failure on any rank is re-raised in the
caller with every rank's traceback; a rank that errors or hangs poisons the pool, which
is then torn down and re-spawned for the next call so one bad test cannot hang the rest.
"""
from __future__ import annotations

import importlib
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp
import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, sys_path, tasks, results, timeout_s):
    sys.path[:] = sys_path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:    # the test process was killed: do not linger
                os._exit(0)
            continue
        if task is None:
            break
        module, name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistributedTestError(AssertionError):
    pass


class WorkerPool:
    def __init__(self, world_size: int, timeout_s: float = 120.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, port, list(sys.path), self.tasks[r],
                                        self.results, timeout_s))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order."""
        for q in self.tasks:
            q.put((fn.__module__, fn.__qualname__, args, kwargs))
        out, errors = {}, {}
        deadline = time.monotonic() + self.timeout_s + 30
        first_error_at = None
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                now = time.monotonic()
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    self.broken = True
                    raise DistributedTestError(f"ranks {dead} died running {fn.__qualname__}")
                if first_error_at is not None and now - first_error_at > 5.0:
                    break  # peers of a failed rank are stuck in a collective
                if now > deadline:
                    self.broken = True
                    missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                    raise DistributedTestError(f"ranks {missing} did not finish "
                                               f"{fn.__qualname__} in {self.timeout_s + 30:.0f}s")
                continue
            (out if ok else errors)[rank] = value
            if not ok and first_error_at is None:
                first_error_at = time.monotonic()
        if errors:
            self.broken = True
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise DistributedTestError(f"{fn.__qualname__} failed on ranks "
                                       f"{sorted(errors)}:\n{text}")
        return [out[r] for r in range(self.world_size)]

    def close(self):
        self.stop()
        self.reap(time.monotonic() + 5)

    def stop(self):
        """Ask every worker to leave (a broken pool's are killed by ``reap``)."""
        if not self.broken:
            for q in self.tasks:
                q.put(None)

    def reap(self, deadline: float):
        """Wait for the workers until ``deadline`` (time.monotonic), then kill the rest."""
        for p in self.procs:
            if not self.broken:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=1.0)      # reaped: no zombie left for the rest of the session


class PoolManager:
    """One live ``WorkerPool`` per world size, re-spawned after a failure."""

    def __init__(self):
        self.pools = {}

    def run(self, world_size: int, fn, *args, **kwargs) -> list:
        pool = self.pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self.pools[world_size] = WorkerPool(world_size)
        return pool.run(fn, *args, **kwargs)

    def close(self):
        """Every pool's workers are asked to leave first, then waited for together (a
        worker's ``destroy_process_group`` waits for its peers: pool by pool, the waits
        added up to seconds)."""
        for pool in self.pools.values():
            pool.stop()
        deadline = time.monotonic() + 5
        for pool in self.pools.values():
            pool.reap(deadline)
        self.pools.clear()


def process_tree(pid: int, include_self: bool = True) -> list:
    """``pid`` and every live process under it, read from /proc: what a test or benchmark
    kills to stand for a lost node (an agent and its workers) without touching anything
    else on the machine."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out if include_self else out[1:]
