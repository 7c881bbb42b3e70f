"""Activation memory on real ranks.

1. The executor's stage i of 1F1B never holds more than p - i micro-batches: counted as
   stashed micro-batches AND as live bytes of autograd-saved storages (a micro-batch's
   worth measured after the first forward); combined 1F1B (--overlap-moe-expert-parallel-
   comm) holds the one more the planner's memory model counts (``memory.in_flight``).
2. TP=2 (with and without SP): per-layer saved bytes on each rank equal the exact
   expectation of ``activation_memory.layer_terms``; with SP they are exactly the
   single-process layer's / 2 (the column-parallel linears keep only sequence shards).
"""
import pytest
import torch
import torch.distributed as torch_dist
from torch.multiprocessing.reductions import StorageWeakRef

from megalite.models.gpt import build_chunk, single_rank_state
from megalite.parallel_state import ParallelState, RankGrid
from megalite.config import pipeline_schedules
from megalite.pipeline_parallel.schedules import PipelineExecutor
from megalite.models.stages import build_model_chunks
from megalite.planner import memory as planner_memory
from megalite.planner.layout import Layout
from megalite.transformer.activation_memory import layer_terms, measure_saved

from pipeline_cases import global_batches, make_cfg, make_forward_step

WORLD = 4
SCHEDULES = [("1f1b", dict(pp=4, m=8)), ("zero-bubble", dict(pp=4, m=8)),
             ("interleaved", dict(pp=2, vpp=2, m=4, layers=4)),
             ("1f1b", dict(pp=4, m=8, overlap=True))]      # combined 1F1B


def _key(name, case):
    return name + ("+overlap" if case.get("overlap") else "")


def _in_flight(schedule, case):
    rank = torch_dist.get_rank()
    cfg = make_cfg(case, WORLD)
    p = cfg.parallel
    state = ParallelState.build(RankGrid(WORLD, pp=p.pp,
                                         vpp=p.virtual_stages(cfg.model.num_layers)), rank)
    chunks = build_model_chunks(cfg, state)
    m = cfg.num_micro_batches
    batches = global_batches(m * state.dp.size)[state.dp.rank * m:(state.dp.rank + 1) * m]
    denom = sum(b["loss_mask"].sum() for b in batches)
    overlap = case.get("overlap", False)
    ex = PipelineExecutor(make_forward_step(denom), batches, chunks, state, cfg, False,
                          split_backward=schedule == "zero-bubble", overlap=overlap)
    params = {q.untyped_storage().data_ptr() for c in chunks for q in c.parameters()}
    live = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return t.detach()   # returning t itself would tie saved outputs in a ref cycle

    per_mb, peak_bytes, peak_count = None, 0, 0
    # op by op, a pair's F before its BW: the pair's peak (run side by side it is reached
    # mid-pair, which the executor's own max_in_flight, taken after each pair, misses)
    program = pipeline_schedules.plan(schedule, state.pp.size, m, len(chunks),
                                      overlap=overlap)[state.pp.rank]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for op in program:
            getattr(ex, "_" + op.kind)(op)
            alive = sum(n for ref, n in live.values() if not ref.expired())
            if op.kind == "F" and per_mb is None:
                per_mb = alive
            peak_bytes = max(peak_bytes, alive)
            peak_count = max(peak_count, len(ex.stash) + len(ex.pending_w))
    return dict(pp=state.pp.rank, p=state.pp.size, m=m, count=peak_count,
                mbs=peak_bytes / per_mb)


def _tp_layer_bytes(sp, tp=2):
    rank = torch_dist.get_rank()
    case = dict(tp=tp, sp=sp, layers=1)
    cfg = make_cfg(case, WORLD if tp > 1 else 1)
    cfg.model.attention_backend = "flash"     # layer_terms: no s x s probabilities kept
    state = ParallelState.build(RankGrid(WORLD, tp=2), rank) if tp > 1 else \
        single_rank_state()
    model = build_chunk(cfg, state, pre_process=False, post_process=False, layer_numbers=[0])
    m = cfg.model
    s = m.seq_length * 4          # longer sequence: make every term visible
    m.seq_length = s
    b, h = 2, m.hidden_size
    x = torch.randn(s // tp if sp else s, b, h, requires_grad=True)
    seen, _ = measure_saved(lambda t: model.decoder(t, None), x, ignore=list(model.parameters()))
    measured = sum(seen.values())
    expected = 4 * sum(layer_terms(m, s, b, t=tp, sp=sp).values())
    return measured, expected


def _all():
    out = {_key(name, case): _in_flight(name, case) for name, case in SCHEDULES}
    out["tp-sp"] = _tp_layer_bytes(True)
    out["tp"] = _tp_layer_bytes(False)
    out["tp1"] = _tp_layer_bytes(False, tp=1)
    return out


@pytest.fixture(scope="module")
def results(dist):
    return dist.run(WORLD, _all)


def test_1f1b_stage_i_holds_at_most_p_minus_i(results):
    for r in results:
        row = r["1f1b"]
        assert row["count"] == row["p"] - row["pp"], row
        assert abs(row["mbs"] - (row["p"] - row["pp"])) < 0.05, row   # live saved bytes


def test_zero_bubble_and_interleaved_bounds(results):
    for r in results:
        zb = r["zero-bubble"]
        assert zb["count"] <= zb["p"] and zb["mbs"] <= zb["p"] + 0.05, zb
        il = r["interleaved"]   # Megatron: warm-up (p-r-1)*2 + (v-1)*p chunks, + 1
        p, v = il["p"], 2
        assert il["count"] <= (p - il["pp"] - 1) * 2 + (v - 1) * p + 1, il


@pytest.mark.parametrize("key", ["tp-sp", "tp"])
def test_tp_per_layer_saved_bytes(results, key):
    for r in results:
        measured, expected = r[key]
        assert abs(measured / expected - 1) <= 0.05, (key, measured, expected)


def test_sp_divides_every_term_by_t(results):
    """GPT-2 style (no RoPE tables): TP 2 + SP keeps exactly half of one rank's layer."""
    for r in results:
        assert r["tp-sp"][0] == r["tp-sp"][1]       # == layer_terms, exactly
        assert 2 * r["tp-sp"][0] == r["tp1"][0] == r["tp1"][1], (r["tp-sp"], r["tp1"])


def test_combined_1f1b_holds_what_the_planner_counts(results):
    """Combined 1F1B's one more warm-up forward: stage i holds min(p - i + 1, m), stashed
    and in live saved bytes, as the planner prices a megalite run with the overlap."""
    for r in results:
        row = r["1f1b+overlap"]
        want = planner_memory.in_flight(Layout(world=row["p"], pp=row["p"],
                                               global_batch=row["m"]), row["pp"], paired=True)
        assert want == min(row["p"] - row["pp"] + 1, row["m"]), row
        assert row["count"] == want, row
        assert abs(row["mbs"] - want) < 0.05, row
