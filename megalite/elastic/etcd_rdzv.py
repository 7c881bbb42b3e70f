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
  three nodes; tests start three on one host with ``HOST:CLIENT_PORT:PEER_PORT``).

docs/fault_tolerance.md, "No single point of failure", says how to run it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from typing import List, Optional, Sequence, Tuple

from megalite.errors import ConfigError

BACKEND = "etcd-v2"
CLIENT_PORT = 2379          # etcd's own defaults
PEER_PORT = 2380
PROBE_TIMEOUT_S = 3.0


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
        import etcd  # noqa: F401  (optional dependency: only the etcd rendezvous needs it)
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
    cluster = ",".join(f"{n}=http://{h}:{p}" for n, h, _, p in members)
    return [etcd, "--name", name, "--data-dir", data_dir, "--enable-v2",
            "--listen-client-urls", f"http://{host}:{client}",
            "--advertise-client-urls", f"http://{host}:{client}",
            "--listen-peer-urls", f"http://{host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{host}:{peer}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", "megalite-" + hashlib.sha1(cluster.encode()).hexdigest()[:12],
            "--heartbeat-interval", "100", "--election-timeout", "1000"]


def client_endpoints(members: Sequence[Tuple[str, str, int, int]]) -> str:
    return ",".join(f"{h}:{c}" for _, h, c, _ in members)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 4 or argv[0] != "member":
        print("usage: python -m megalite.elastic.etcd_rdzv member NAME DATA_DIR "
              "NAME1=HOST1[:CLIENT:PEER],...", file=sys.stderr)
        return 2
    _, name, data_dir, spec = argv
    etcd = shutil.which("etcd")
    try:
        if etcd is None:
            raise EtcdError("etcd not found on this node: apt-get install etcd-server (Debian),"
                            " or give the site's members with --rdzv-endpoint")
        cmd = member_command(name, data_dir, parse_members(spec), etcd)
    except EtcdError as exc:
        print(f"megalite etcd: error: {exc}", file=sys.stderr, flush=True)
        return 2
    os.makedirs(data_dir, exist_ok=True)
    os.execv(etcd, cmd)
    return 0     # not reached


if __name__ == "__main__":
    sys.exit(main())
