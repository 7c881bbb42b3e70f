"""DualPipeV as data: the V-shaped split, its programs (complete, FIFO, deadlock-free, what
the executor walks), and its simulated bubble and peak in-flight memory against the
formulas of the registry (the planner's) for p in {2, 4, 8} and several micro-batch counts."""
from fractions import Fraction

import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.parallel_state import ParallelState, RankGrid
from megalite.config import pipeline_program as P
from megalite.config import pipeline_schedules as S
from megalite.config.pipeline_program import stage_index, stage_place
from megalite.pipeline_parallel.split import split_layers

UNIT = {k: Fraction(1) for k in "FBW"}
CASES = [(p, m) for p in (2, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 3)]


def test_v_shape_split_puts_the_first_and_last_layers_on_rank_0():
    split = split_layers(8, 4, 2, vshape=True)
    assert [split.layers(r, 0) for r in range(4)] == [[0], [1], [2], [3]]
    assert [split.layers(r, 1) for r in range(4)] == [[7], [6], [5], [4]]
    assert split.embedding_stage == (0, 0) and split.output_stage == (0, 1)
    for s in range(8):
        assert stage_index(*stage_place(s, 4, True), 4, True) == s
    # the embedding and the loss counted as layers balance rank 0 (6 + 2 slots, 2 a chunk)
    acc = split_layers(6, 2, 2, account_for_embedding=True, account_for_loss=True, vshape=True)
    assert acc.chunks == (((0,), (5,)), ((1, 2), (3, 4)))
    with pytest.raises(ValueError):
        split_layers(8, 2, 4, vshape=True)


@pytest.mark.parametrize("p,m", CASES)
def test_programs_are_complete_fifo_and_deadlock_free(p, m):
    for forward_only in (False, True):
        program = S.plan("dualpipev", p, m, 2, forward_only)
        P.check_fifo(program, p)
        P.simulate(program)
        for r, prog in enumerate(program):
            done = {}
            for op in prog:
                if op.kind != "comm":
                    done.setdefault((op.mb, op.chunk), []).append(op.kind)
            want = ["F"] if forward_only else None
            for key in ((mb, c) for mb in range(m) for c in (0, 1)):
                kinds = done.pop(key)
                assert kinds == want if forward_only else kinds in (["F", "BW"],
                                                                    ["F", "B", "W"]), (r, key)
            assert not done
        # the last rank hands the bottom of the V over locally: no message to itself
        assert all(dst != p - 1 for op in program[p - 1] for _, dst in op.sends)


@pytest.mark.parametrize("p,m", CASES)
def test_bubble_and_peak_in_flight_match_the_formulas(p, m):
    spec = S.get_schedule("dualpipev")
    res = P.simulate(S.plan("dualpipev", p, m, 2), UNIT)
    # DeepSeek: (S/2 - 1)(F&B + B - 3W) per rank over S = 2p stages, B the full backward
    f, b, w = UNIT["F"], UNIT["B"] + UNIT["W"], UNIT["W"]
    idle = (p - 1) * ((f + b) + b - 3 * w)
    assert {res.makespan - busy for busy in res.busy} == {idle}
    assert Fraction(res.bubble_fraction).limit_denominator(10 ** 6) == Fraction(p - 1, 3 * m)
    # the planner's bubble time, in units of one rank's work (2 chunks x (F + B + W))
    assert spec.bubble_time(p, 2, 6, 0, 2) == idle
    for r, prog in enumerate(S.plan("dualpipev", p, m, 2)):
        held = peak = 0
        for op in prog:
            held += {"F": 1, "BW": -1, "W": -1}.get(op.kind, 0)
            peak = max(peak, held)
        assert peak / 2 == spec.in_flight(p, m, 2, r) == (2 * p + 1) / 2


def test_dualpipev_needs_2p_micro_batches():
    with pytest.raises(ValueError, match="at least 2 x pipeline size"):
        S.plan("dualpipev", 4, 7, 2)


_FLAGS = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "16", "--vocab-size", "64", "--mock-data", "--train-iters", "1",
          "--lr", "1e-3", "--micro-batch-size", "1", "--world-size", "4", "--pp", "4",
          "--pipeline-schedule", "dualpipev", "--untie-embeddings-and-output-weights"]


def test_the_flag_implies_two_chunks_and_rank_0_holds_the_loss():
    cfg = parse_args(_FLAGS + ["--global-batch-size", "8"])
    assert cfg.parallel.virtual_stages(8) == 2 and cfg.parallel.pipeline_vshape
    grid = RankGrid.from_config(cfg)
    assert grid.groups("embedding") == [[0]]
    states = [ParallelState.build(grid, r, create_groups=False) for r in range(4)]
    assert [s.is_last_stage(ignore_virtual=True) for s in states] == [True, False, False, False]
    states[0].virtual_pipeline_rank = 1
    assert states[0].is_last_stage() and not states[0].is_first_stage()


def test_too_few_micro_batches_is_one_line_naming_the_flag():
    with pytest.raises(ConfigError, match="needs at least 8 micro-batches.*--global-batch-size"):
        parse_args(_FLAGS + ["--global-batch-size", "4"])


@pytest.mark.parametrize("p,m", CASES)
def test_f_and_b_pairs_and_the_unpaired_forwards_the_planner_reads(p, m):
    """Every F&B pair is a forward of one micro-batch next to the backward of another (two
    chunks), and the forwards outside a pair are the registry's ``unpaired_forwards``."""
    spec = S.get_schedule("dualpipev")
    for r, prog in enumerate(S.plan("dualpipev", p, m, 2)):
        ops = [op for op in prog if op.kind != "comm"]
        pairs = [(a, b) for a, b in zip(ops, ops[1:]) if a.paired and a.kind == "F"]
        assert pairs and all(b.paired and b.kind == "BW" and b.chunk != a.chunk
                             for a, b in pairs)
        assert sum(op.paired for op in ops) == 2 * len(pairs)
        alone = sum(op.kind == "F" and not op.paired for op in ops)
        assert alone == spec.unpaired_forwards(p, m, 2, r)


def test_the_planner_searches_dualpipev_only_with_2p_micro_batches():
    from megalite.cli.validation import validate_layout
    from megalite.planner import model_spec as ms
    from megalite.planner.hardware import make_cluster
    from megalite.planner.search import SearchSpace, search

    m = ms.recipe("llama3-8b")
    res = search(m, 4096, 64, make_cluster(32), SearchSpace(pp=[4], schedules=("dualpipev",)))
    ranked = [e.layout for e in res.ranked if e.layout.schedule == "dualpipev"]
    assert ranked and all(L.vpp == 2 for L in ranked)       # (other VPPs: auto's schedule)
    assert {L.num_micro_batches for L in ranked} == {8, 16, 32, 64}     # never below 2p
    validate_layout(ranked[0].to_config(m, 4096))
