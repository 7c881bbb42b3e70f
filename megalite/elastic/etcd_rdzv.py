"""The etcd rendezvous: no node of the job is a single point of failure.

torchrun's c10d rendezvous keeps its state in a store on the first node: when that node
dies the other agents cannot re-form.  With ``--rdzv-backend etcd-v2`` the state lives in
an etcd cluster instead (torch's ``etcd_rendezvous_backend``, etcd's v2 API through the
``python-etcd`` client), and each round's worker store is hosted by that round's first
node (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set by the launcher), so it moves with the
re-formed world.  A three-member etcd cluster keeps its quorum when one member dies.

- ``--rdzv-endpoint H1:P,H2:P,H3:P``: the members; the launcher hands torch the first one
  that answers, and the client learns the others from it (``allow_reconnect``): when that
  member dies later, the agent's next request goes to another one.
- ``python -m megalite.elastic.etcd_rdzv member NAME DATA_DIR NAME1=HOST1,NAME2=HOST2,...``
  runs one member (``launch/slurm/pretrain.sbatch`` starts three on the allocation's first
  three nodes; tests start three on one host with ``HOST:CLIENT_PORT:PEER_PORT``);
  ``... wait H1:P,... SECONDS`` returns once the cluster accepts a write.

docs/fault_tolerance.md, "No single point of failure", says how to run it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import List, Optional, Sequence, Tuple

from megalite.errors import ConfigError

BACKEND = "etcd-v2"
CLIENT_PORT = 2379          # etcd's own defaults
PEER_PORT = 2380
PROBE_TIMEOUT_S = 3.0
# How long a request is retried while the etcd cluster elects a new leader (a member died):
# torch's backend turns the first "etcdserver: request timed out" into the agent's end.
RETRY_S = 30.0


class EtcdError(ConfigError):
    """An etcd rendezvous that cannot be used: no client, no server, no member answers."""


def split_endpoints(endpoint: str) -> List[Tuple[str, int]]:
    """``H1:P,H2,H3:P`` -> [(host, port), ...] (etcd's client port when none is given)."""
    out = []
    for item in filter(None, (e.strip() for e in (endpoint or "").split(","))):
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(CLIENT_PORT)
        if not host or not port.isdigit():
            raise EtcdError(f"--rdzv-endpoint: '{item}' is not HOST[:PORT] (an etcd member's "
                            f"client address, e.g. node1:{CLIENT_PORT})")
        out.append((host, int(port)))
    if not out:
        raise EtcdError(f"--rdzv-backend {BACKEND} needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]"
                        f" (the etcd members' client addresses)")
    return out


def check_client() -> None:
    """torch's etcd backend imports ``etcd`` (PyPI: python-etcd) and otherwise fails only at
    the first rendezvous, with a stub's ImportError."""
    try:
        import etcd  # noqa: F401  # optional dependency: python-etcd, for this backend only
    except ImportError:
        raise EtcdError(f"--rdzv-backend {BACKEND} needs the etcd v2 client: "
                        f"pip install python-etcd") from None


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when the member at host:port serves the v2 API, else why not (one phrase)."""
    base = f"http://{host}:{port}"
    try:
        with urllib.request.urlopen(base + "/version", timeout=timeout) as r:
            version = json.loads(r.read().decode() or "{}").get("etcdserver", "?")
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"no etcd answers ({reason})"
    try:
        urllib.request.urlopen(base + "/v2/keys/", timeout=timeout).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return f"etcd {version} without the v2 API (start it with --enable-v2)"
        return f"etcd {version}: /v2/keys answered {exc.code}"
    except OSError as exc:
        return f"etcd {version}: {getattr(exc, 'reason', exc)}"
    return None


def first_live_endpoint(endpoint: str) -> str:
    """The first member of ``endpoint`` that answers, as HOST:PORT for torch; a one-line
    ``EtcdError`` naming every member tried when none does."""
    check_client()
    tried = []
    for host, port in split_endpoints(endpoint):
        why = probe(host, port)
        if why is None:
            return f"{host}:{port}"
        tried.append(f"{host}:{port}: {why}")
    raise EtcdError(f"--rdzv-endpoint {endpoint}: no etcd member can be used ("
                    + "; ".join(tried) + "); start etcd (Debian: apt-get install etcd-server) "
                    "or give the site's members")


def _transient(exc: BaseException) -> bool:
    """An etcd failure that a retry can outlive: a leader election, a member that stopped
    answering (the client moves to the next member), a timed-out proposal.  Not the
    rendezvous' own outcomes (a key not found, a failed compare-and-swap, a watch that timed
    out: torch handles those)."""
    import etcd  # optional dependency: python-etcd, for this backend only
    import urllib3  # optional dependency: python-etcd's transport
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return type(cause) in (etcd.EtcdException, etcd.EtcdLeaderElectionInProgress,
                           etcd.EtcdConnectionFailed) or \
        isinstance(cause, (urllib3.exceptions.TimeoutError, urllib3.exceptions.ProtocolError))


def _retrying(fn, seconds: float):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        end = time.monotonic() + seconds
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (re-raised unless transient)
                if not _transient(exc) or time.monotonic() > end:
                    raise
                time.sleep(0.2)
    call.megalite_retrying = True
    return call


def install_retries(seconds: float = RETRY_S) -> None:
    """Make torch's etcd rendezvous backend and store retry transient etcd failures for
    ``seconds`` (once per process)."""
    # start-up time: the member command (same module) runs without torch
    from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend, etcd_store
    for cls, names in ((etcd_rendezvous_backend.EtcdRendezvousBackend, ("get_state", "set_state")),
                       (etcd_store.EtcdStore, ("set", "get", "add", "check", "wait"))):
        for name in names:
            fn = getattr(cls, name)
            if not getattr(fn, "megalite_retrying", False):
                setattr(cls, name, _retrying(fn, seconds))


def parse_members(spec: str) -> List[Tuple[str, str, int, int]]:
    """``NAME=HOST[:CLIENT_PORT:PEER_PORT],...`` -> [(name, host, client, peer)]."""
    out = []
    for item in filter(None, spec.split(",")):
        name, _, addr = item.partition("=")
        parts = addr.split(":")
        if not name or not parts[0] or len(parts) not in (1, 3):
            raise EtcdError(f"etcd members: '{item}' is not NAME=HOST[:CLIENT_PORT:PEER_PORT]")
        client, peer = (int(parts[1]), int(parts[2])) if len(parts) == 3 else \
            (CLIENT_PORT, PEER_PORT)
        out.append((name, parts[0], client, peer))
    return out


def member_command(name: str, data_dir: str, members: Sequence[Tuple[str, str, int, int]],
                   etcd: str = "etcd") -> List[str]:
    """The command line of member ``name`` of a new cluster of ``members``: v2 API on,
    listening on its own address only, heartbeats fast enough that a dead leader is
    replaced within about a second."""
    me = [m for m in members if m[0] == name]
    if not me:
        raise EtcdError(f"etcd member {name} is not one of {[m[0] for m in members]}")
    _, host, client, peer = me[0]
    try:
        ip = socket.gethostbyname(host)      # etcd listens on addresses, not names
    except OSError as exc:
        raise EtcdError(f"etcd member {name}: cannot resolve {host}: {exc}") from None
    cluster = ",".join(f"{n}=http://{h}:{p}" for n, h, _, p in members)
    return [etcd, "--name", name, "--data-dir", data_dir, "--enable-v2",
            "--listen-client-urls", f"http://{ip}:{client}",
            "--advertise-client-urls", f"http://{host}:{client}",
            "--listen-peer-urls", f"http://{ip}:{peer}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "megalite-" + hashlib.sha1(cluster.encode()).hexdigest()[:12],
            "--heartbeat-interval", "100", "--election-timeout", "1000"]


def client_endpoints(members: Sequence[Tuple[str, str, int, int]]) -> str:
    return ",".join(f"{h}:{c}" for _, h, c, _ in members)


def wait_healthy(endpoint: str, timeout: float) -> None:
    """Until a write through one of the members succeeds (the cluster has a leader), else a
    one-line ``EtcdError``."""
    end = time.monotonic() + timeout
    why = "not tried"
    while True:
        for host, port in split_endpoints(endpoint):
            try:
                req = urllib.request.Request(f"http://{host}:{port}/v2/keys/megalite-up",
                                             data=b"value=1", method="PUT")
                urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S).close()
                return
            except OSError as exc:
                why = f"{host}:{port}: {getattr(exc, 'reason', exc)}"
        if time.monotonic() > end:
            raise EtcdError(f"the etcd cluster {endpoint} did not accept a write within "
                            f"{timeout:.0f} s (last: {why}); see its members' logs")
        time.sleep(0.3)


USAGE = ("usage: python -m megalite.elastic.etcd_rdzv member NAME DATA_DIR "
         "NAME1=HOST1[:CLIENT:PEER],...  |  wait HOST:PORT[,...] SECONDS")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) == 3 and argv[0] == "wait":
            check_client()                   # the agents need it: say so before they start
            wait_healthy(argv[1], float(argv[2]))
            return 0
        if len(argv) != 4 or argv[0] != "member":
            print(USAGE, file=sys.stderr)
            return 2
        _, name, data_dir, spec = argv
        etcd = shutil.which("etcd")
        if etcd is None:
            raise EtcdError("etcd not found on this node: apt-get install etcd-server (Debian),"
                            " or give the site's members (MEGALITE_RDZV_ENDPOINT)")
        cmd = member_command(name, data_dir, parse_members(spec), etcd)
    except EtcdError as exc:
        print(f"megalite etcd: error: {exc}", file=sys.stderr, flush=True)
        return 2
    os.makedirs(data_dir, exist_ok=True)
    os.execv(etcd, cmd)
    return 0     # not reached


if __name__ == "__main__":
    sys.exit(main())
