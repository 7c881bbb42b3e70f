"""``--warm-spares N`` keeps N spares waiting while the workers run: a worker's client claims
its spare after ``_start_workers`` returned (it is a process of its own), so a spare the
top-up there still counted as idle can be gone a moment later; the agent tops the pool up
on every health check too (megalite/elastic/launch.py).  The launch e2e tests run it."""
import types

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from megalite.elastic import launch, warm


class _Proc:
    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        return None            # alive


def test_a_spare_claimed_after_the_start_is_replaced_at_the_next_health_check(monkeypatch):
    agent_cls = launch._agent_class()
    agent = object.__new__(agent_cls)
    agent.warm_spares, agent.warm_pool = 2, "/nonexistent-pool"
    agent._warm_args = ("train.py",)
    claimed, waiting = _Proc(1), _Proc(2)
    agent._warm_procs = [claimed, waiting]
    spawned = []
    monkeypatch.setattr(warm, "idle", lambda pool, p: p is waiting)
    monkeypatch.setattr(warm, "spawn", lambda pool, script: spawned.append(script) or _Proc(3))
    state = {"now": WorkerState.HEALTHY}
    monkeypatch.setattr(launch.LocalElasticAgent, "_monitor_workers",
                        lambda self, group: RunResult(state=state["now"]))
    group = types.SimpleNamespace(spec=None)
    assert agent._monitor_workers(group).state == WorkerState.HEALTHY
    assert len(spawned) == 1 and len(agent._warm_procs) == 3      # two waiting again
    state["now"] = WorkerState.SUCCEEDED                           # the end: no new spares
    monkeypatch.setattr(warm, "idle", lambda pool, p: False)
    agent._monitor_workers(group)
    assert len(spawned) == 1
