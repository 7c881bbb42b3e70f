"""Layout search: legality comes from megalite.cli.validation, memory filters, ranking rules."""
import time

import pytest

from megalite.cli.arguments import ConfigError
from megalite.planner import model_spec as ms
from megalite.planner import report
from megalite.planner.estimate import ModelOptions
from megalite.planner.hardware import make_cluster
from megalite.planner.layout import Layout
from megalite.planner.search import SearchSpace, evaluate, search
from megalite.cli.validation import validate_layout


@pytest.fixture(scope="module")
def llama8b_64():
    m = ms.recipe("llama3-8b")
    c = make_cluster(64, 8, "h100-80gb")
    return m, c, search(m, 8192, 512, c)


def test_every_ranked_layout_passes_validation_and_fits(llama8b_64):
    m, c, res = llama8b_64
    assert res.ranked
    for e in res.ranked:
        validate_layout(e.layout.to_config(m, 8192))
        assert e.memory["total"] <= e.capacity
        assert e.layout.tp * e.layout.cp * e.layout.pp * e.layout.dp == 64


def test_ranked_by_step_time(llama8b_64):
    _, c, res = llama8b_64
    steps = [e.step for e in res.ranked]
    assert all(b >= a * 0.995 for a, b in zip(steps, steps[1:]))   # 0.5% tie bins
    best = res.ranked[0]
    assert best.layout.tp <= 8 and best.layout.cp == 1                # TP in a node, no CP at 8K
    assert 0.3 < best.mfu(c) < 0.7


def test_cp_only_for_long_sequences():
    m = ms.recipe("llama3-8b")
    c = make_cluster(64)
    # one schedule and micro-batch: CP's rule is the same, the search 8x smaller
    space = SearchSpace(schedules=("1f1b",), micro_batch=[1])
    short = search(m, 8192, 64, c, space)
    assert short.ranked and all(e.layout.cp == 1 for e in short.ranked)
    long = search(m, 65536, 16, c, space)
    assert any(e.layout.cp > 1 for e in long.ranked)


def test_16k_gpu_search_is_fast():
    m = ms.recipe("llama3-405b")
    c = make_cluster(16384, 8, "h100-80gb")
    t = time.perf_counter()
    res = search(m, 8192, 2048, c)
    assert time.perf_counter() - t < 5.0
    assert res.ranked


def test_pins_restrict_the_search():
    m = ms.recipe("llama3-8b")
    res = search(m, 4096, 256, make_cluster(32), SearchSpace(tp=[4], pp=[2], recompute=("full",)))
    assert res.ranked and all(e.layout.tp == 4 and e.layout.pp == 2 for e in res.ranked)
    assert all(e.layout.recompute == "full" for e in res.ranked)


def test_moe_search_uses_expert_parallelism():
    m = ms.recipe("mixtral-8x7b")
    res = search(m, 4096, 256, make_cluster(64), SearchSpace(pp=[1, 2], micro_batch=[1]))
    assert res.ranked
    assert res.ranked[0].layout.ep > 1
    for e in res.ranked[:20]:
        validate_layout(e.layout.to_config(m, 4096))


def test_nothing_fits_explains_the_smallest():
    m = ms.recipe("llama3-405b")
    res = search(m, 8192, 64, make_cluster(8))
    assert not res.ranked
    msg = report.no_fit(res)
    assert "no layout fits" in msg and "GiB" in msg


def test_recompute_tried_only_when_needed():
    m = ms.recipe("llama3-8b")
    res = search(m, 8192, 512, make_cluster(64))
    kinds = {(e.layout.short(), e.layout.micro_batch, e.layout.zero, e.layout.sp,
              e.layout.schedule): e.layout.recompute for e in res.ranked}
    assert "none" in kinds.values()


def test_evaluate_rejects_illegal_layout():
    m = ms.recipe("llama3-8b")
    with pytest.raises(ConfigError):
        evaluate(m, 8192, Layout(world=64, tp=3, global_batch=512), make_cluster(64))


def test_zero_2_and_3_layouts_emit_their_flags():
    m = ms.recipe("llama3-70b")
    res = search(m, 4096, 1024, make_cluster(1024), SearchSpace(zero=(3,), tp=[1], pp=[1]),
                 ModelOptions())
    assert res.ranked
    flags = res.ranked[0].layout.parallel_flags()
    assert "--use-torch-fsdp2" in flags and "--use-distributed-optimizer" not in flags
    z2 = Layout(world=64, zero=2)
    assert {"--use-distributed-optimizer", "--overlap-grad-reduce"} <= set(z2.parallel_flags())
    from megalite.planner.layout import layout_from_config
    assert layout_from_config(z2.to_config(m, 4096)).zero == 2


def test_fsdp2_with_pp_cp_ep_and_hsdp_layouts_are_searched_and_emitted():
    """Issue 26: stage 3 composes with PP (every schedule), CP and EP, and hybrid sharding
    is searched ("node": instances that keep each shard group inside a node); the layouts
    pass validation (also the data-parallel rules) and round-trip through their config."""
    from megalite.planner.layout import layout_from_config
    from megalite.cli import features

    m = ms.recipe("llama3-70b")
    # one micro-batch size and recompute level: the same compositions, a search 10x smaller
    res = search(m, 8192, 512, make_cluster(256), SearchSpace(
        zero=(3,), instances=(1, "node"), schedules=("1f1b", "interleaved", "zero-bubble"),
        micro_batch=[1], recompute=("full",)))
    got = {(e.layout.pp > 1, e.layout.instances > 1, e.layout.schedule) for e in res.ranked}
    assert (True, False, "1f1b") in got and (True, True, "interleaved") in got
    assert (True, False, "zero-bubble") in got and (True, True, "1f1b") in got
    hsdp = next(e.layout for e in res.ranked if e.layout.instances > 1)
    assert hsdp.tp * hsdp.dense_shards == 8          # an instance is one node
    assert ["--num-distributed-optimizer-instances", str(hsdp.instances)] == \
        hsdp.parallel_flags()[hsdp.parallel_flags().index(
            "--num-distributed-optimizer-instances"):][:2]
    for L in [res.ranked[0].layout, hsdp]:
        assert "--use-torch-fsdp2" in L.parallel_flags()
        cfg = L.to_config(m, 8192)
        validate_layout(cfg)
        assert features.refusal(cfg, dry_run=True) is None   # HSDP's sizes too
        assert layout_from_config(cfg) == L
    cp = search(m, 65536, 64, make_cluster(256), SearchSpace(zero=(3,), cp=[2], tp=[8]))
    assert cp.ranked and all(e.layout.cp == 2 for e in cp.ranked)
    moe = ms.recipe("mixtral-8x7b")
    ep = search(moe, 4096, 256, make_cluster(64), SearchSpace(zero=(3,), ep=[2, 4],
                                                              micro_batch=[1]))
    assert ep.ranked and any(e.layout.ep > 1 and e.layout.zero == 3 for e in ep.ranked)


def test_account_for_split_offered_with_interleaving_and_round_trips():
    from megalite.planner.layout import layout_from_config
    from megalite.planner.search import pipeline_splits

    m = ms.recipe("llama3-405b")                     # 126 layers: 126 % 16 != 0
    splits = list(pipeline_splits(m, 16, SearchSpace()))
    assert (7, 7, 1, (False, False), None) in splits      # --decoder-first/last, no interleaving
    both = [v for f, l, v, acc, _ in splits if acc == (True, True)]
    assert both == [2, 4, 8]                         # 128 slots / 16 = 8 per rank
    assert not [s for s in pipeline_splits(m, 16, SearchSpace(schedules=("1f1b",)))
                if any(s[3])]
    L = Layout(world=16384, tp=8, pp=16, vpp=8, global_batch=2048, sp=True,
               schedule="interleaved", account_embedding=True, account_loss=True)
    cfg = L.to_config(m, 8192)
    validate_layout(cfg)
    flags = L.parallel_flags()
    assert "--account-for-embedding-in-pipeline-split" in flags
    assert "--account-for-loss-in-pipeline-split" in flags
    assert layout_from_config(cfg) == L
    # The first and last rank hold 7 layers (one chunk is only the embedding / the loss),
    # the others 8; the planner's memory and time models see that.
    kinds = [ms.stage_layer_kinds(m, 16, r, 8, *L.stage_split) for r in range(16)]
    assert kinds[0] == kinds[-1] == (7, 0) and all(k == (8, 0) for k in kinds[1:-1])
    one = ms.kind_params(m, False, tp=8).total
    mid = ms.stage_params(m, 1, tp=8, pp=16, vpp=8, accounts=L.accounts).total
    first = ms.stage_params(m, 0, tp=8, pp=16, vpp=8, accounts=L.accounts).total
    assert mid - first == one - ms.embedding_params(m, 8)
    e = evaluate(m, 8192, L, make_cluster(16384))
    even = evaluate(m, 8192, Layout(world=16384, tp=8, pp=16, global_batch=2048, sp=True,
                                    first_layers=7, last_layers=7), make_cluster(16384))
    assert e.times["bubble"] < even.times["bubble"] / 4   # (p-1)/(v m) with v = 8


def test_search_proposes_dualpipev_for_moe_and_its_v_places_the_output_on_rank_0():
    """DualPipeV is tried for MoE models (its paired F&B steps hide the expert all-to-all):
    with the EP overlap on, priced as megalite runs it (``megalite plan``'s rule: F&B pairs,
    not interleaving), it is the best Qwen3-235B layout at TP2 PP16 EP8, without it
    interleaving wins; a dense model never gets it, and --schedules given pins the list."""
    import dataclasses
    m = dataclasses.replace(ms.recipe("qwen3-235b-a22b"), seq_length=4096)
    c = make_cluster(256, 8, "h100-80gb")
    pin = SearchSpace(pp=(16,), tp=(2,), ep=(8,))
    on = search(m, 4096, 2048, c, pin, ModelOptions(fp8="tensorwise", ep_overlap=True,
                                                    ep_overlap_rule="megalite"))
    off = search(m, 4096, 2048, c, pin, ModelOptions(fp8="tensorwise"))
    best = on.ranked[0].layout
    assert best.schedule == "dualpipev" and best.vpp == 2 and best.output_rank == 0
    assert off.ranked[0].layout.schedule == "interleaved"
    assert any(e.layout.schedule == "dualpipev" for e in off.ranked)
    validate_layout(best.to_config(m, 4096))
    assert "--pipeline-schedule" in best.parallel_flags()
    only = search(m, 4096, 2048, c, SearchSpace(pp=(16,), tp=(2,), ep=(8,),
                                                schedules=("interleaved",), moe_schedules=()),
                  ModelOptions(fp8="tensorwise", ep_overlap=True))
    assert "dualpipev" not in {e.layout.schedule for e in only.ranked}
    dense = search(ms.recipe("llama3-8b"), 4096, 64, make_cluster(16, 8, "h100-80gb"),
                   SearchSpace(pp=(2,)))
    assert "dualpipev" not in {e.layout.schedule for e in dense.ranked}
