"""FSDP2's ``fully_shard`` replaces every parameter with a fresh DTensor parameter that
carries no attribute of the old one, but keeps the parameter names.  A TP2 x DP2 model with
sequence parallelism and tied embeddings, fully sharded over the DP ranks (a CPU gloo
DeviceMesh), still initializes, syncs its sequence-parallel grads, counts its grad norm and
describes its checkpoint metadata and sharded-state chunks right, because all of those read
the ``ParamTable`` by name.  Built with --use-torch-fsdp2 through the model builder, the
chunk starts on the meta device and only this rank's shards are ever allocated, holding the
single-process init's values.
"""
import torch
import torch.distributed as torch_dist

from megalite.checkpointing.model_io import local_shards
from megalite.state_format.sharded_state import assemble, model_sharded_state_dict
from megalite.checkpointing.sharding import unshard_tensors
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig, TrainingConfig
from megalite.distributed.grad_sync import counts_toward_norm
from megalite.models.gpt import WORD_EMBEDDING, build_model, single_rank_state
from megalite.param_spec import group_coords
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel import allreduce_sequence_parallel_grads

WORLD, TP, DP, SEQ, BATCH, VOCAB = 4, 2, 2, 8, 4, 90


def _cfg(tp):
    m = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=SEQ,
                    vocab_size=VOCAB, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
                    attention_dropout=0.0)   # GPT-2 style: LayerNorm + biases, learned pos., tied
    return MegaliteConfig(model=m, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                           sequence_parallel=tp > 1),
                          training=TrainingConfig(seed=7), world_size=WORLD if tp > 1 else 1)


def _batch():
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _reference():
    """Single-process full model: init params, full grads and the global grad norm."""
    model = build_model(_cfg(1), single_rank_state())
    init = {f"model.{n}": unshard_tensors([p.detach()], spec)      # vocabulary unpadded
            for n, p, spec in model.param_table.named(model)}
    ids, labels = _batch()
    (model(ids, labels=labels).sum() / labels.numel()).backward()
    grads = {n: p.grad for n, p in model.canonical_named_parameters()}
    return init, grads, torch.sqrt(sum(g.pow(2).sum() for g in grads.values())).item()


def _fsdp_rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    rank = torch_dist.get_rank()
    state = ParallelState.build(RankGrid(WORLD, tp=TP), rank)
    coords = group_coords(state)
    model = build_model(_cfg(TP), state)
    before = {n: (p.detach().clone(), model.param_table.spec(n))
              for n, p in model.named_parameters()}
    _, metas_before = local_shards(model)
    # megalite's rank order (tp stride 1, dp stride tp) is the mesh's row-major (dp, tp)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    assert mesh["dp"].mesh.tolist() == state.dp.ranks
    for layer in model.decoder.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for m in model.modules():    # megalite sums over DP (the loss is / global tokens);
        if isinstance(m, FSDPModule):  # gloo has no PREMUL_SUM: plain SUM, divide by 1
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    out = {}
    params = dict(model.named_parameters())
    out["replaced"] = all(isinstance(p, DTensor) for p in params.values())
    out["attributes_lost"] = not any(hasattr(p, "shard_meta") for p in params.values())
    # the table is found by name, so every reader sees the same specs as before
    out["same_specs"] = set(params) == set(before) and all(
        model.param_table.spec(n) is before[n][1] for n in params)
    out["sp_params"] = sorted(n for n in params if model.param_table.spec(n).sequence_parallel)
    out["tied"] = model.param_table.spec(WORD_EMBEDDING).tied
    # init: zero everything, re-initialize through the table: the TP-local tensors are back
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    model.initialize(7)
    out["init_bitwise"] = all(torch.equal(params[n].full_tensor(), before[n][0])
                              for n in params)
    # sharded state dict: the spec's chunks cut down to this rank's FSDP piece
    out["model_sd"] = {k: (v.global_shape, [(o, t.clone()) for o, t in v.chunks], v.writer)
                       for k, v in model_sharded_state_dict(model, state).items()}
    # forward/backward on this DP rank's half of the batch; FSDP reduce-scatters over DP
    ids, labels = _batch()
    half = slice(state.dp.rank * BATCH // DP, (state.dp.rank + 1) * BATCH // DP)
    (model(ids[half], labels=labels[half]).sum() / labels.numel()).backward()
    local_grad = {n: p.grad.to_local() for n, p in params.items()}
    partial = {n: local_grad[n].clone() for n in out["sp_params"]}
    out["sp_reduced"] = allreduce_sequence_parallel_grads(
        model, state, grad_of=lambda p: p.grad.to_local() if p.grad is not None else None)
    out["sp_changed"] = any(not torch.equal(partial[n], local_grad[n]) for n in partial)
    out["grads"] = {n: (params[n].grad.full_tensor(), model.param_table.canonical(n))
                    for n in params}
    # grad norm: each element once over DP (FSDP shards) x TP (the table's rule)
    sq = torch.zeros(1)
    for n, p in params.items():
        if counts_toward_norm(model.param_table.spec(n), coords):
            sq += local_grad[n].pow(2).sum()
    torch_dist.all_reduce(sq, group=state["tp-dp-cp"].handle)
    out["norm"] = sq.sqrt().item()
    # checkpoint metadata and chunks
    _, metas_after = local_shards(model)
    out["metas_same"] = metas_after == metas_before
    out["chunks"] = {n: model.param_table.spec(n).chunks(coords) for n in params}
    out["tp_rank"] = state.tp.rank
    return out


def _meta_build_rank():
    """--use-torch-fsdp2 through the one builder: the chunk is built on meta, sharded, and
    only this rank's shards are allocated and initialised; against a chunk built whole on
    CPU, initialised, then sharded (the order before), under the tensor-memory meter."""
    import dataclasses

    from megalite.models.gpt import GPTModel
    from megalite.models.parallelize import parallelize_chunk, spec_choices
    from megalite.training.tensor_memory_meter import TensorMemoryMeter

    state = ParallelState.build(RankGrid(WORLD, tp=TP), torch_dist.get_rank())
    cfg = _cfg(TP)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                use_torch_fsdp2=True))
    meter = TensorMemoryMeter().start()
    try:
        with meter.window("meta"):
            model = build_model(cfg, state)
        with meter.window("whole"):
            whole = GPTModel(cfg, state, spec=spec_choices(cfg, state))
            parallelize_chunk(whole, cfg, state, device="cpu")
    finally:
        peaks = meter.stop().windows
    tp_local = sum(p.full_tensor().numel() * 4 for p in whole.parameters())
    mine = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {"model_sd": {k: (v.global_shape, [(o, t.clone()) for o, t in v.chunks], v.writer)
                         for k, v in model_sharded_state_dict(model, state).items()},
            "same_as_whole": all(torch.equal(a.to_local(), b.to_local()) for a, b in
                                 zip(model.parameters(), whole.parameters())),
            "peak_meta": peaks["meta"].peak_bytes, "peak_whole": peaks["whole"].peak_bytes,
            "tp_local_bytes": tp_local, "shard_bytes": mine}


def test_fully_shard_keeps_specs_init_sp_sync_norm_and_metadata(dist):
    from megalite.state_format.sharded_state import ShardedTensor

    results = dist.run(WORLD, _fsdp_rank)
    built = dist.run(WORLD, _meta_build_rank)
    ref_init, ref_grads, ref_norm = _reference()
    # built on meta, only the shards materialised: the values of the reference's init
    full = assemble([{k: ShardedTensor(*v) for k, v in r["model_sd"].items()} for r in built])
    assert set(full) == set(ref_init) and all(torch.equal(full[k], ref_init[k]) for k in full)
    for r in built:
        assert r["same_as_whole"], r
        # the whole TP-local model is never live: building on meta saves at least the part
        # of it this rank does not hold
        assert r["peak_meta"] >= r["shard_bytes"] and r["peak_whole"] >= r["tp_local_bytes"]
        saved = r["peak_whole"] - r["peak_meta"]
        assert saved >= r["tp_local_bytes"] - r["shard_bytes"], (saved, r["tp_local_bytes"])
    # every element of the model written once, by one of the DP x TP ranks, = the init
    full = assemble([{k: ShardedTensor(*v) for k, v in r["model_sd"].items()} for r in results])
    assert set(full) == set(ref_init) and all(torch.equal(full[k], ref_init[k]) for k in full)
    # a TP-split weight: all 4 ranks write a distinct FSDP piece of their TP chunk; a
    # replicated norm: the two DP pieces of TP rank 0
    fc1 = [r["model_sd"]["model.decoder.layers.0.mlp.linear_fc1.weight"] for r in results]
    assert all(v[2] and v[1] for v in fc1)
    norm = [r["model_sd"]["model.decoder.final_layernorm.weight"] for r in results]
    assert [v[2] for v in norm] == [r["tp_rank"] == 0 for r in results]
    assert [t.numel() for v in norm if v[2] for _, t in v[1]] == [8, 8]
    coords_ref = None
    for r in results:
        assert r["replaced"] and r["attributes_lost"] and r["same_specs"]
        assert r["tied"] == "owner" and r["init_bitwise"] and r["metas_same"]
        assert r["sp_params"] == sorted(
            [f"decoder.layers.{i}.{m}.{w}" for i in (0, 1)
             for m in ("input_layernorm", "pre_mlp_layernorm") for w in ("weight", "bias")] +
            [f"decoder.layers.{i}.{m}.bias" for i in (0, 1)
             for m in ("self_attention.linear_proj", "mlp.linear_fc2")] +
            ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
             "embedding.position_embeddings.weight"])
        assert r["sp_reduced"] > 0 and r["sp_changed"]
        assert abs(r["norm"] - ref_norm) <= 1e-5 * ref_norm, (r["norm"], ref_norm)
        for n, (grad, canonical) in r["grads"].items():
            want = torch.zeros_like(grad)        # padded vocabulary rows: zero grad
            for c in r["chunks"][n]:
                want[c.local_slices()] = ref_grads[canonical][c.global_slices()]
            err = (grad - want).abs().max() / want.abs().max().clamp_min(1e-12)
            assert err <= 1e-5, (n, err)
        coords_ref = coords_ref or r["chunks"]
    # the two TP ranks hold different vocabulary rows of the tied embedding (clipped at 90)
    rows = {r["tp_rank"]: [(c.offsets[0], c.sizes[0]) for c in r["chunks"][WORD_EMBEDDING]]
            for r in results}
    assert rows == {0: [(0, 48)], 1: [(48, 42)]}
