"""The etcd rendezvous' own rules (megalite/elastic/etcd_rdzv.py), without an etcd server:
endpoint lists, member command lines, which failures are retried."""
import pytest

from megalite.elastic import etcd_rdzv


def test_endpoints_and_members_parse_or_are_one_line_errors():
    assert etcd_rdzv.split_endpoints("node1:23,node2, node3:5") == \
        [("node1", 23), ("node2", 2379), ("node3", 5)]
    for bad in ("", "node1:x", ":5"):
        with pytest.raises(etcd_rdzv.EtcdError, match="--rdzv-endpoint"):
            etcd_rdzv.split_endpoints(bad)
    assert etcd_rdzv.parse_members("a=localhost:1:2,b=localhost") == \
        [("a", "localhost", 1, 2), ("b", "localhost", 2379, 2380)]
    with pytest.raises(etcd_rdzv.EtcdError, match="NAME=HOST"):
        etcd_rdzv.parse_members("a=h:1")


def test_member_command_listens_on_its_address_and_shares_one_cluster_token():
    members = etcd_rdzv.parse_members("a=localhost:11:12,b=127.0.0.1:21:22")
    a = etcd_rdzv.member_command("a", "/tmp/x/a", members)
    b = etcd_rdzv.member_command("b", "/tmp/x/b", members)
    arg = lambda cmd, flag: cmd[cmd.index(flag) + 1]    # noqa: E731
    assert arg(a, "--listen-client-urls") == "http://127.0.0.1:11"     # an address, not a name
    assert arg(a, "--advertise-client-urls") == "http://localhost:11"
    assert arg(a, "--initial-cluster") == arg(b, "--initial-cluster") == \
        "a=http://localhost:12,b=http://127.0.0.1:22"
    assert arg(a, "--initial-cluster-token") == arg(b, "--initial-cluster-token")
    assert "--enable-v2" in a
    with pytest.raises(etcd_rdzv.EtcdError, match="not one of"):
        etcd_rdzv.member_command("c", "/tmp/x/c", members)
    assert etcd_rdzv.client_endpoints(members) == "localhost:11,127.0.0.1:21"


def test_only_transient_etcd_failures_are_retried():
    etcd = pytest.importorskip("etcd", reason="python-etcd not installed")
    calls = []

    def flaky(exc_type, times):
        def fn():
            calls.append(1)
            if len(calls) <= times:
                raise exc_type("x")
            return "ok"
        return etcd_rdzv._retrying(fn, seconds=5)
    assert flaky(etcd.EtcdException, 2)() == "ok" and len(calls) == 3   # a leader election
    calls.clear()
    with pytest.raises(etcd.EtcdKeyNotFound):                  # the rendezvous' own outcome
        flaky(etcd.EtcdKeyNotFound, 1)()
    assert len(calls) == 1
