"""A three-member etcd cluster on this machine, for the etcd rendezvous' tests and benchmark
(``python -m megalite.elastic.etcd_rdzv member``, each member its own ports and data folder).

``unavailable()`` says why it cannot run here (no ``etcd`` binary, no python client), so a
test can skip with that reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from typing import List, Optional

from megalite.elastic import etcd_rdzv


def unavailable() -> Optional[str]:
    if shutil.which("etcd") is None:
        return "no etcd binary (Debian: apt-get install etcd-server; .ci/run installs it)"
    try:
        etcd_rdzv.check_client()
    except etcd_rdzv.EtcdError as exc:
        return str(exc)
    return None


def _free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalEtcd:
    """``members`` etcd processes on 127.0.0.1; ``endpoint`` is the launcher's
    ``--rdzv-endpoint`` (member 0 first); ``kill(i)`` SIGKILLs member i."""

    def __init__(self, folder: str, members: int = 3, timeout: float = 60.0):
        ports = _free_ports(2 * members)
        self.members = [(f"m{i}", "127.0.0.1", ports[2 * i], ports[2 * i + 1])
                        for i in range(members)]
        spec = ",".join(f"{n}={h}:{c}:{p}" for n, h, c, p in self.members)
        self.endpoint = etcd_rdzv.client_endpoints(self.members)
        self.procs = []
        for name, *_ in self.members:
            log = open(os.path.join(folder, f"etcd-{name}.log"), "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "megalite.elastic.etcd_rdzv", "member", name,
                 os.path.join(folder, f"etcd-{name}"), spec], stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        try:
            etcd_rdzv.wait_healthy(self.endpoint, timeout)
        except etcd_rdzv.EtcdError:
            self.stop()
            raise

    def kill(self, i: int) -> None:
        try:
            os.killpg(self.procs[i].pid, signal.SIGKILL)
        except OSError:
            pass
        self.procs[i].wait()

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
