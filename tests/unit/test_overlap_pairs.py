"""The overlapped F&B pieces that need no process group: the cooperative halves' order of
collectives (the same on every rank), errors, per-half extra-loss collection, and the
combined 1F1B / --delay-wgrad-compute programs (pairs adjacent, deadlock free, FIFO)."""
import pytest
import torch

from megalite.comm import overlap
from megalite.config import pipeline_program as pp
from megalite.config import pipeline_schedules as ps
from megalite.transformer import extra_losses


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"wait {self.name}")


def _half(log, tag, n):
    def run():
        for i in range(n):
            log.append(f"issue {tag}{i}")
            overlap.switch_while(_Work(log, f"{tag}{i}"))
            log.append(f"compute {tag}{i}")
    return run


def test_halves_hand_over_at_each_collective_in_a_fixed_order():
    log = []
    record = overlap.run_pair(_half(log, "F", 2), _half(log, "B", 3))
    issued = [x for x in log if x.startswith("issue")]
    # F's first, then B's, alternating while both run; B's last alone
    assert issued == ["issue F0", "issue B0", "issue F1", "issue B1", "issue B2"]
    # a half waits for its collective only after the other half ran
    assert log.index("issue B0") < log.index("wait F0")
    assert record.switches >= 4
    assert overlap.current() is None


def test_an_error_in_one_half_is_raised_after_both_ended():
    log = []

    def bad():
        overlap.switch_while(_Work(log, "x"))
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        overlap.run_pair(bad, _half(log, "B", 2))
    assert "compute B1" in log          # the other half ran to its end


def test_the_backward_half_does_not_see_the_forward_halfs_collection():
    seen = {}

    def forward():
        with extra_losses.collect_extra_losses(["aux"]):
            seen["f"] = extra_losses.is_collecting()
            overlap.switch_while(_Work([], "f"))

    def backward():
        seen["b"] = extra_losses.is_collecting()

    overlap.run_pair(forward, backward)
    assert seen == {"f": True, "b": False}


def test_grad_mode_of_the_caller_reaches_both_halves():
    seen = []
    with torch.no_grad():
        overlap.run_pair(lambda: seen.append(torch.is_grad_enabled()),
                         lambda: seen.append(torch.is_grad_enabled()))
    assert seen == [False, False]


@pytest.mark.parametrize("p,m", [(2, 4), (2, 3), (4, 8), (4, 5), (3, 7)])
@pytest.mark.parametrize("delay", [False, True])
def test_combined_1f1b_pairs_a_forward_with_another_micro_batchs_backward(p, m, delay):
    program = ps.plan("1f1b", p, m, 1, False, True, delay)
    pp.check_fifo(program, p)
    pp.simulate(program)                    # no deadlock
    for rank, prog in enumerate(program):
        computed = [op for op in prog if op.kind != "comm"]
        assert sorted(o.mb for o in computed if o.kind == "F") == list(range(m))
        warmup = min(p - rank, m)
        pairs = 0
        for i, op in enumerate(prog):
            if op.paired and op.kind == "F":
                back = prog[i + 1]
                assert back.paired and back.kind == ("B" if delay else "BW")
                assert back.mb == op.mb - warmup != op.mb
                if delay:
                    assert prog[i + 2].kind == "W" and prog[i + 2].mb == back.mb
                pairs += 1
        assert pairs == m - warmup
        if delay:   # every weight gradient done
            assert sorted(o.mb for o in computed if o.kind in ("W", "BW")) == list(range(m))


def test_dualpipev_overlap_keeps_its_program_and_delay_splits_its_pairs():
    plain = ps.plan("dualpipev", 2, 8, 2)
    assert ps.plan("dualpipev", 2, 8, 2, False, True) == plain
    delayed = ps.plan("dualpipev", 2, 8, 2, False, True, True)
    paired_bw = sum(op.paired and op.kind == "BW" for prog in plain for op in prog)
    assert paired_bw > 0
    assert sum(op.paired and op.kind == "W" for prog in delayed for op in prog) == paired_bw
