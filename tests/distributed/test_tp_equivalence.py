"""Tensor (+ sequence) parallel GPT on real gloo ranks equals the single-process model.

Workers run every layout in one call and send back their shards; the parent builds the
single-process reference (same name-seeded init) and compares logits, loss, parameters
and EVERY gradient after unsharding (fp32, relative error <= 1e-5).
"""
import dataclasses

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from megalite import comm
from megalite.checkpointing.sharding import shard_tensor, unshard_tensors
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.gpt import WORD_EMBEDDING, build_chunk, build_model, single_rank_state
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel import allreduce_sequence_parallel_grads, model_parallel_tracker

WORLD = 4
VOCAB = 70          # padded to 80 / 96 / 128 at TP 1 / 2 / 4 (divisor 16): rank 3 of TP=4 is all padding
SEQ, BATCH = 8, 2
RTOL = 1e-5


def model_cfg(arch: str, groups=None, layers=2, tied=None) -> dict:
    common = dict(num_layers=layers, hidden_size=32, num_attention_heads=16, kv_channels=4,
                  seq_length=SEQ, vocab_size=VOCAB, make_vocab_size_divisible_by=16,
                  hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.05)
    if arch.startswith("llama"):
        common.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                      ffn_hidden_size=48, add_bias_linear=False, norm_epsilon=1e-6,
                      untie_embeddings_and_output_weights=True,
                      group_query_attention=groups is not None, num_query_groups=groups)
    else:  # GPT-2 style
        common.update(normalization="LayerNorm", position_embedding_type="learned_absolute",
                      ffn_hidden_size=64, add_bias_linear=True,
                      untie_embeddings_and_output_weights=False, max_position_embeddings=SEQ)
    if tied is not None:
        common["untie_embeddings_and_output_weights"] = not tied
    if arch == "llama-softcap":      # Gemma 2's caps, small enough to bite at this init
        common.update(attn_logit_softcapping=0.05, final_logit_softcapping=0.2,
                      attention_backend="unfused")
    return common


ARCHS = {"llama-mha": ("llama", None), "llama-g16": ("llama", 16), "llama-g8": ("llama", 8),
         "llama-g4": ("llama", 4), "gpt2": ("gpt2", None), "llama-softcap": ("llama-softcap", 4)}


def make_cfg(mcfg: dict, tp=1, sp=False, pp=1, world=1, seed=1234) -> MegaliteConfig:
    cfg = MegaliteConfig(model=ModelConfig(**mcfg),
                         parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp,
                                                 sequence_parallel=sp),
                         world_size=world)
    cfg.training.seed = seed
    return cfg


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, labels


def run_step(model, ids, labels, state=None):
    """logits (no grad), per-token loss, grads after mean-loss backward (+ SP grad sync)."""
    with torch.no_grad():
        logits = model(ids).detach().clone()
    loss = model(ids, labels=labels)
    loss.mean().backward()
    if state is not None:
        allreduce_sequence_parallel_grads(model, state)
    shards = {n: (p.detach().clone(), p.grad.detach().clone(), spec.to_meta_dict())
              for n, p, spec in model.param_table.named(model)}
    return logits, loss.detach().clone(), shards


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------------------------
def _tp_layouts(cases):
    rank = torch_dist.get_rank()
    out = []
    ids, labels = batch()
    for arch, tp, sp in cases:
        mcfg = model_cfg(*ARCHS[arch])
        state = ParallelState.build(RankGrid(WORLD, tp=tp), rank)
        model = build_model(make_cfg(mcfg, tp, sp, world=WORLD), state)
        out.append(run_step(model, ids, labels, state))
    return out


CASES = [(arch, tp, sp) for arch in ARCHS for tp in (1, 2, 4)
         for sp in ((False, True) if tp > 1 else (False,))]


@pytest.fixture(scope="module")
def layout_results(dist):
    return dist.run(WORLD, _tp_layouts, CASES)


def _reference(arch):
    model = build_model(make_cfg(model_cfg(*ARCHS[arch])), single_rank_state())
    return run_step(model, *batch())


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{a}-tp{t}-{'sp' if s else 'nosp'}" for a, t, s in CASES])
def test_tp_matches_single_process(layout_results, case):
    arch, tp, sp = CASES[case]
    ref_logits, ref_loss, ref_shards = _reference(arch)
    per_rank = [r[case] for r in layout_results[:tp]]  # ranks 0..tp-1 form TP group 0
    logits = torch.cat([r[0] for r in per_rank], dim=-1)
    assert logits.shape[-1] == make_cfg(model_cfg(*ARCHS[arch]), tp).padded_vocab_size
    assert rel(logits[..., :VOCAB], ref_logits[..., :VOCAB]) <= RTOL
    assert (logits[..., VOCAB:] == 0).all()  # padded columns: zero rows, never trained
    for r in per_rank:
        assert rel(r[1], ref_loss) <= RTOL
    assert set(per_rank[0][2]) == set(ref_shards)
    for name, (ref_p, ref_g, ref_meta) in ref_shards.items():
        meta = per_rank[0][2][name][2]
        full_p = unshard_tensors([r[2][name][0] for r in per_rank], meta)
        full_g = unshard_tensors([r[2][name][1] for r in per_rank], meta)
        want_p, want_g = unshard_tensors([ref_p], ref_meta), unshard_tensors([ref_g], ref_meta)
        assert torch.equal(full_p, want_p), f"{name}: init depends on TP"
        assert rel(full_g, want_g) <= RTOL, (name, rel(full_g, want_g))
        if meta["pad_multiple"]:  # padded vocab rows get no gradient
            for tp_rank, r in enumerate(per_rank):
                g = r[2][name][1]
                start = tp_rank * g.shape[0]
                assert (g[max(0, VOCAB - start):] == 0).all()
    # DP replicas computed the same thing
    if tp < WORLD:
        assert rel(layout_results[tp][case][1], ref_loss) <= RTOL


# ---------------------------------------------------------------------------------------------
def _comm_counts(arch, tp, sp):
    """counter snapshots for 1- and 2-layer models, split into forward and backward."""
    state = ParallelState.build(RankGrid(WORLD, tp=tp), torch_dist.get_rank())
    ids, labels = batch()
    out = {}
    for layers in (1, 2):
        model = build_model(make_cfg(model_cfg(*ARCHS[arch], layers=layers), tp, sp, world=WORLD),
                            state)
        comm.counter.reset()
        loss = model(ids, labels=labels)
        fwd = comm.counter.snapshot()
        comm.counter.reset()
        loss.mean().backward()
        bwd = comm.counter.snapshot()
        comm.counter.reset()
        n = allreduce_sequence_parallel_grads(model, state)
        out[layers] = (fwd, bwd, comm.counter.snapshot(), n)
    return out


def _rng_tracker():
    """Dropout masks: equal across TP in replicated regions, different in split ones."""
    state = ParallelState.build(RankGrid(WORLD, tp=2), torch_dist.get_rank())
    torch.manual_seed(7)
    tracker = model_parallel_tracker(7, state.tp.rank)
    x = torch.ones(4096)
    replicated1 = F.dropout(x, 0.5)
    with tracker.fork():
        split1 = F.dropout(x, 0.5)
        with tracker.fork():  # re-entrant
            split2 = F.dropout(x, 0.5)
    replicated2 = F.dropout(x, 0.5)
    torch.manual_seed(7)  # the fork must not have advanced the default stream
    expect = (F.dropout(x, 0.5), F.dropout(x, 0.5))
    assert torch.equal(replicated1, expect[0]) and torch.equal(replicated2, expect[1])
    # The tracker resumes where it stopped.
    with tracker.fork():
        split3 = F.dropout(x, 0.5)
    fresh = model_parallel_tracker(7, state.tp.rank)
    with fresh.fork():
        fresh_seq = [F.dropout(x, 0.5) for _ in range(3)]
    assert torch.equal(split3, fresh_seq[2]) and torch.equal(split2, fresh_seq[1])
    # In a model: hidden dropout (replicated region) must agree across TP, or the residual
    # stream of the two ranks would diverge; attention dropout uses the per-rank state.
    m = dict(model_cfg("gpt2"), hidden_dropout=0.3, attention_dropout=0.3)
    model = build_chunk(make_cfg(m, 2, False, world=WORLD), state, True, False, [0, 1])
    torch.manual_seed(11)
    hidden = model(batch()[0]).detach()
    with torch.no_grad():
        model.eval()
        assert not torch.allclose(hidden, model(batch()[0]))
    return state.tp.rank, replicated1, split1, hidden


def _layer_options():
    """Column(gather_output) -> Row(input_is_parallel=False), and the SP variants, vs nn.Linear."""
    from megalite.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                          gather_from_sp_region, scatter_to_sp_region)

    state = ParallelState.build(RankGrid(WORLD, tp=4), torch_dist.get_rank())
    tp = state.tp
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 2, 12, generator=g)
    w1, b1 = torch.randn(16, 12, generator=g), torch.randn(16, generator=g)
    w2, b2 = torch.randn(12, 16, generator=g), torch.randn(12, generator=g)
    xr = x.clone().requires_grad_()
    ref = F.linear(F.linear(xr, w1, b1), w2, b2)
    ref.square().sum().backward()
    for sp in (False, True):
        col = ColumnParallelLinear(12, 16, tp_group=tp, gather_output=not sp, sequence_parallel=sp)
        row = RowParallelLinear(16, 12, tp_group=tp, input_is_parallel=sp, sequence_parallel=sp)
        with torch.no_grad():
            for layer, w, b in ((col, w1, b1), (row, w2, b2)):
                specs = layer.param_specs
                layer.weight.copy_(shard_tensor(w, specs["weight"], tp.rank, tp.size))
                layer.bias.copy_(shard_tensor(b, specs["bias"], tp.rank, tp.size))
        xi = (x.chunk(tp.size)[tp.rank] if sp else x).clone().requires_grad_()
        y = row(col(xi))
        want = ref.detach().chunk(tp.size)[tp.rank] if sp else ref.detach()
        assert rel(y, want) <= RTOL, rel(y, want)
        y.square().sum().backward()
        want_gx = xr.grad.chunk(tp.size)[tp.rank] if sp else xr.grad
        assert rel(xi.grad, want_gx) <= RTOL, rel(xi.grad, want_gx)
        assert row.param_specs["bias"].sequence_parallel == ("tp" if sp else None)
        if sp:
            allreduce_sequence_parallel_grads([col, row], state)
    # scatter / gather along the sequence are conjugate
    z = x.clone().requires_grad_()
    part = scatter_to_sp_region(z, tp)
    assert torch.equal(part, x.chunk(4)[tp.rank])
    whole = gather_from_sp_region(part * (tp.rank + 1), tp)
    whole.sum().backward()
    # gather bwd = reduce-scatter (sums tp ones), scatter bwd = all-gather of the chunks
    want = torch.cat([torch.full_like(c, float(tp.size * (r + 1)))
                      for r, c in enumerate(x.chunk(tp.size))])
    assert torch.equal(z.grad, want)
    return True


def _sp_column_linear():
    """The SP column-parallel linear saves only its sequence shard, re-gathers it in
    backward, and splits cleanly for zero bubble: B = dX + reduce-scatter (no weight grad,
    no all-gather), W = re-gather + dW, db (no reduce-scatter); B + W == one backward."""
    from megalite.pipeline_parallel.weight_grad import backward_input
    from megalite.tensor_parallel import ColumnParallelLinear
    from megalite.transformer.activation_memory import measure_saved

    state = ParallelState.build(RankGrid(WORLD, tp=4), torch_dist.get_rank())
    tp = state.tp
    g = torch.Generator().manual_seed(9)
    x, gy = torch.randn(8, 2, 12, generator=g), torch.randn(8, 2, 16, generator=g)
    w, b = torch.randn(16, 12, generator=g), torch.randn(16, generator=g)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    F.linear(xr, wr, br).backward(gy)
    my_gy = gy.chunk(tp.size, dim=-1)[tp.rank]

    def build():
        col = ColumnParallelLinear(12, 16, tp_group=tp, sequence_parallel=True)
        with torch.no_grad():
            col.weight.copy_(shard_tensor(w, col.param_specs["weight"], tp.rank, tp.size))
            col.bias.copy_(shard_tensor(b, col.param_specs["bias"], tp.rank, tp.size))
        xi = x.chunk(tp.size)[tp.rank].clone().requires_grad_()
        return col, xi, xi * 1.0          # a non-leaf input, as inside a layer

    def check(col, xi, gx):
        assert rel(gx, xr.grad.chunk(tp.size)[tp.rank]) <= RTOL
        assert rel(col.weight.grad, wr.grad.chunk(tp.size)[tp.rank]) <= RTOL
        assert rel(col.bias.grad, br.grad.chunk(tp.size)[tp.rank]) <= RTOL

    # what autograd keeps: the [s/t, b, h] input shard, not the gathered [s, b, h] input
    col, xi, h = build()
    seen, y = measure_saved(col, h, ignore=list(col.parameters()))
    assert list(seen.values()) == [h.numel() * 4] and y.shape == (8, 2, 4)
    comm.counter.reset()
    y.backward(my_gy)
    assert comm.counter.snapshot() == {
        "tp/all_gather": {"calls": 1, "elements": x.numel(), "bytes": 4 * x.numel()},
        "tp/reduce_scatter": {"calls": 1, "elements": 8 * 2 * 12, "bytes": 4 * 8 * 2 * 12}}
    check(col, xi, xi.grad)
    # zero bubble: B then W
    col, xi, h = build()
    y = col(h)
    comm.counter.reset()
    (gx,), pending = backward_input([y], [my_gy], [xi], list(col.parameters()))
    assert set(comm.counter.snapshot()) == {"tp/reduce_scatter"}
    assert col.weight.grad is None and col.bias.grad is None
    assert len(pending.stash) == 1 and not pending.fallback    # dW, db deferred to W
    comm.counter.reset()
    pending.run()
    assert set(comm.counter.snapshot()) == {"tp/all_gather"}
    check(col, xi, gx)
    # W alone when the input needs no gradient (frozen embedding output): no reduce-scatter
    col, _, _ = build()
    comm.counter.reset()
    col(x.chunk(tp.size)[tp.rank]).backward(my_gy)
    assert set(comm.counter.snapshot()) == {"tp/all_gather"}
    assert rel(col.weight.grad, wr.grad.chunk(tp.size)[tp.rank]) <= RTOL
    return True


def _comm_and_rng(cases):
    return ([_comm_counts(*c) for c in cases], _rng_tracker(),
            _layer_options() and _sp_column_linear())


COMM_CASES = [("llama-g4", 4, False), ("llama-g4", 4, True), ("gpt2", 2, False), ("gpt2", 2, True)]


def test_comm_per_layer_and_rng(dist):
    results = dist.run(WORLD, _comm_and_rng, COMM_CASES)
    sbh = SEQ * BATCH * 32
    sb = SEQ * BATCH
    for (arch, tp, sp), counts in zip(COMM_CASES, results[0][0]):
        (f1, b1, _, _), (f2, b2, s2, n2) = counts[1], counts[2]

        def layer(a, b, key):  # per-layer = 2-layer minus 1-layer model
            return {k: b.get(key, {}).get(k, 0) - a.get(key, {}).get(k, 0)
                    for k in ("calls", "elements")}
        if not sp:
            assert layer(f1, f2, "tp/all_reduce") == {"calls": 2, "elements": 2 * sbh}
            assert layer(b1, b2, "tp/all_reduce") == {"calls": 2, "elements": 2 * sbh}
            assert not any("gather" in k or "scatter" in k for k in {**f2, **b2})
            # embedding all-reduce + loss (max, then [target logit; sum exp]) forward,
            # the output layer's input all-reduce backward
            assert f2["tp/all_reduce"] == {"calls": 2 * 2 + 3, "elements": 2 * 2 * sbh + sbh + 3 * sb,
                                           "bytes": 4 * (2 * 2 * sbh + sbh + 3 * sb)}
            assert b2["tp/all_reduce"]["calls"] == 2 * 2 + 1
            assert n2 == 0 and s2 == {}
        else:
            # forward: all-gather before linear_qkv / linear_fc1, reduce-scatter after
            # linear_proj / linear_fc2; backward: the conjugates (2 + 2) plus each column-
            # parallel linear's re-gather of its saved sequence shard for the weight grad
            for snap_a, snap_b, gathers in ((f1, f2, 2), (b1, b2, 4)):
                assert layer(snap_a, snap_b, "tp/all_gather") == {"calls": gathers,
                                                                  "elements": gathers * sbh}
                assert layer(snap_a, snap_b, "tp/reduce_scatter") == {"calls": 2, "elements": 2 * sbh}
                assert layer(snap_a, snap_b, "tp/all_reduce") == {"calls": 0, "elements": 0}
            # + embedding reduce-scatter and output-layer all-gather (each way; the output
            # layer re-gathers its input in backward too), loss all-reduces
            assert f2["tp/all_gather"]["calls"] == 2 * 2 + 1
            assert b2["tp/all_gather"] == {"calls": 4 * 2 + 1 + 1, "elements": (4 * 2 + 2) * sbh,
                                           "bytes": 4 * (4 * 2 + 2) * sbh}
            for snap in (f2, b2):
                assert snap["tp/reduce_scatter"]["calls"] == 2 * 2 + 1
            assert f2["tp/all_reduce"] == {"calls": 2, "elements": 3 * sb, "bytes": 12 * sb}
            assert "tp/all_reduce" not in b2
            # one coalesced all-reduce of every norm weight (+ row biases, positions for GPT-2)
            h = 32
            expect = (2 * 2 + 1) * h if arch.startswith("llama") else \
                (2 * 2 * 2 + 2) * h + 2 * 2 * h + SEQ * h
            assert s2 == {"tp/all_reduce": {"calls": 1, "elements": expect, "bytes": 4 * expect}}
            assert n2 == expect
    # RNG: ranks (0,1) and (2,3) are TP pairs
    assert all(r[2] for r in results)
    rngs = [r[1] for r in results]
    for a, b in ((0, 1), (2, 3)):
        assert rngs[a][0] != rngs[b][0]
        assert torch.equal(rngs[a][1], rngs[b][1]), "replicated-region dropout differs across TP"
        assert not torch.equal(rngs[a][2], rngs[b][2]), "split-region dropout equal across TP"
    assert torch.equal(rngs[0][2], rngs[2][2])  # same TP rank in another DP replica
    assert torch.equal(rngs[0][3], rngs[1][3]), "residual stream differs across TP with dropout"


# ---------------------------------------------------------------------------------------------
def _checkpoint_and_hf(ckpt_dir, hf_dir):
    from megalite.checkpointing import hf
    from megalite.checkpointing.model_io import (load_full_state_dict, load_model_shards,
                                                 save_model_shards)

    rank = torch_dist.get_rank()
    mcfg = model_cfg("llama", 8, layers=4, tied=True)
    # save at TP=2, PP=2 (layers 0-1 | 2-3), tied embedding copy on the last stage
    state = ParallelState.build(RankGrid(WORLD, tp=2, pp=2), rank)
    first, last = state.is_first_stage(), state.is_last_stage()
    layers = [0, 1] if first else [2, 3]
    chunk = build_chunk(make_cfg(mcfg, 2, False, 2, WORLD, seed=11), state, first, last, layers)
    shared = chunk.shared_embedding_weight()
    saved_shared = shared.detach().clone()
    save_model_shards(ckpt_dir, 7, [chunk], make_cfg(mcfg, 2, False, 2, WORLD), state,
                      extra={"rank": rank})
    out = {"shared": (state.tp.rank, saved_shared,
                      chunk.param_table.specs[WORD_EMBEDDING].to_meta_dict())}
    # reload at TP=4 PP=1 and at TP=1 PP=4 into differently-seeded models
    for tp, pp in ((4, 1), (1, 4)):
        st = ParallelState.build(RankGrid(WORLD, tp=tp, pp=pp), rank)
        lay = list(range(4)) if pp == 1 else [st.pp.rank]
        model = build_chunk(make_cfg(mcfg, tp, False, pp, WORLD, seed=99), st,
                         st.is_first_stage(), st.is_last_stage(), lay)
        it = load_model_shards(ckpt_dir, model, make_cfg(mcfg, tp, False, pp, WORLD), st)
        out[(tp, pp)] = (it, st.tp.rank, st.pp.rank,
                         {n: p.detach().clone() for n, p in model.canonical_named_parameters()})
    # Hugging Face model imported at TP=2 (+SP): logits shards
    hcfg, full = hf.import_hf(hf_dir)
    st = ParallelState.build(RankGrid(WORLD, tp=2), rank)
    model = build_model(make_cfg(hcfg, 2, True, world=WORLD), st).eval()
    load_full_state_dict(model, full, st)
    ids, _ = batch(3)
    with torch.no_grad():
        out["hf_logits"] = model(ids % hcfg["vocab_size"])
    return out


def test_checkpoint_reshard_and_hf_tp2(dist, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megalite.checkpointing.model_io import full_state_dict_from_checkpoint, load_extra

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=90, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
        rope_theta=10000.0)).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    results = dist.run(WORLD, _checkpoint_and_hf, str(tmp_path / "ckpt"), str(tmp_path / "hf"))

    mcfg = model_cfg("llama", 8, layers=4, tied=True)
    ref = build_model(make_cfg(mcfg, seed=11), single_rank_state())
    ref_full = {n: unshard_tensors([p.detach()], spec)
                for n, p, spec in ref.param_table.named(ref)}
    cfg_dict, full = full_state_dict_from_checkpoint(str(tmp_path / "ckpt"))
    assert cfg_dict == dataclasses.asdict(ModelConfig(**mcfg))
    assert set(full) == set(ref_full) and all(torch.equal(full[n], ref_full[n]) for n in full)
    # tied copy on the last stage was initialized identically to the first stage's
    for r in results:
        tp_rank, shared, meta = r["shared"]
        assert torch.equal(shared, shard_tensor(ref_full[WORD_EMBEDDING], meta, tp_rank, 2))
    for (tp, pp) in ((4, 1), (1, 4)):
        by_tp = {}
        for r in results:
            it, tp_rank, pp_rank, params = r[(tp, pp)]
            assert it == 7
            for n, t in params.items():
                by_tp.setdefault(n, {})[tp_rank] = t
        metas = ref.param_table.specs
        for n, shards in by_tp.items():
            got = unshard_tensors([shards[i] for i in range(tp)], metas[n])
            assert torch.equal(got, ref_full[n]), (tp, pp, n)
        assert set(by_tp) == set(ref_full)
    from megalite.parallel_state import ParallelState as PS
    st = PS.build(RankGrid(4, tp=2, pp=2), 3, create_groups=False)
    assert load_extra(str(tmp_path / "ckpt"), st) == {"rank": 3}
    # HF logits at TP=2 with sequence parallelism
    ids, _ = batch(3)
    with torch.no_grad():
        want = hf_model(ids % 90).logits
    got = torch.cat([results[0]["hf_logits"], results[1]["hf_logits"]], dim=-1)[..., :90]
    assert rel(got, want) <= RTOL
