"""Issue 12 on real gloo ranks: --overlap-grad-reduce (DDP, and the distributed optimizer
with ZeRO-2 shards, also with --overlap-param-gather), --use-torch-fsdp2 (ZeRO-3, alone and with TP2 + SP), against DP = 1.

Per run, 10 iterations: every iteration's loss within 1e-5 (relative, fp32) of the DP = 1
run of the same model; final parameters, assembled from every rank's sharded state dict,
within rtol 1e-4 / atol 1e-5 of DP = 1 (weights ~0.1; 10 AdamW steps at lr 3e-3 amplify
last-bit differences of the reduction order: measured max |diff| 3e-6 at TP2, the same with
and without FSDP2, ~1e-7 without TP).  Communication of the last
step against theory for Psi = this rank's parameters: DDP all-reduce Psi (+2 elements:
the step's token count and loss); ZeRO-2
reduce-scatter + all-gather Psi each (padded per bucket); FSDP2 (its collectives counted by
megalite.comm under the mesh group's name) all-gather 2 Psi - root + reduce-scatter Psi per
micro-batch.  Bytes
of weights / grads / optimizer states each rank keeps, measured on the tensors, equal the
planner's state bytes for the layout (ZeRO-1: optimizer / DP, ZeRO-2: grads too, FSDP2:
weights too).  Replicas stay bit-identical.  An FSDP2 checkpoint loads into a DDP run and
back; stand-in expert parameters in buckets reduce over expert-DP (same grads and norm as
without buckets); FSDP2 and --overlap-param-gather runs resume from a training checkpoint exactly; bf16 FSDP2 (fp32 reduce) tracks bf16 DDP.  One ``dist.run`` per world size.
"""
import pytest
import torch

from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)
from megalite import comm
from megalite.cli.arguments import parse_args
from megalite.checkpointing.model_io import load_model_shards, save_model_shards
from megalite.state_format.sharded_state import ShardedTensor, assemble, \
    model_sharded_state_dict
from megalite.config import ConfigError
from megalite.distributed.replicas import check_replicas
from megalite.models.parallelize import fsdp_units
from megalite.cli.validation import validate
from state_bytes import state_bytes  # noqa: E402

LLAMA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "100", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
GPT2 = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",  # biases,
        "--seq-length", "16", "--vocab-size", "100"]       # LayerNorm, learned pos., tied
COMMON = ["--mock-data", "--lr", "3e-3", "--train-iters", "10", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-iters", "0", "--weight-decay", "0.1",
          "--clip-grad", "1.0", "--global-batch-size", "8", "--micro-batch-size", "2"]
ITERS = 10
OV = ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]     # several buckets
DO, FSDP = ["--use-distributed-optimizer"], ["--use-torch-fsdp2"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
CASES = {   # name: (model, flags)
    2: {"ddp": (LLAMA, []), "ddp_ov": (LLAMA, OV), "do": (LLAMA, DO),
        "do_ov": (LLAMA, DO + OV), "do_ov_pg": (LLAMA, DO + OV + ["--overlap-param-gather"]),
        "fsdp2": (LLAMA, FSDP)},
    4: {"ddp": (LLAMA, []), "ddp_ov": (LLAMA, OV), "do": (LLAMA, DO), "do_ov": (LLAMA, DO + OV),
        "fsdp2": (LLAMA, FSDP),
        "fsdp2_tp2": (LLAMA, FSDP + TP2 + ["--sequence-parallel"]),
        "do_ov_tp2_pp2": (GPT2, DO + OV + TP2 + PP2)},
}


def _trainer(flags, world):
    validate(parse_args(["--world-size", str(world), *COMMON, *flags]))
    return build_cpu_trainer([*COMMON, *flags], world)


def _train(flags, world):
    trainer = _trainer(flags, world)
    it = trainer.data_iterator(trainer.train_ds, 0)
    losses = []
    for _ in range(ITERS):
        comm.counter.reset()
        losses.append(trainer.train_step(it)["lm_loss"])
    s = trainer.strategy
    s.wait_param_gathers()      # --overlap-param-gather: the last step's gathers are in flight
    try:                # replicas bit-identical (FSDP2: over TP only, DP holds shards)
        check_replicas(trainer.model_chunks, trainer.state)
        replicas = None
    except RuntimeError as e:
        replicas = str(e)
    out = {"losses": losses, "replicas": replicas, "comm": comm.counter.snapshot(),
           "sd": model_sharded_state_dict(trainer.model_chunks, trainer.state),
           "psi": sum(p.numel() for p in s.params),          # TP-local, unsharded
           "micro": trainer.cfg.num_micro_batches, "last_stage": trainer.is_writer or
           trainer.state.is_last_stage(ignore_virtual=True)}
    if s.scheduler is not None:
        out["buckets"] = len(s.scheduler.buckets)
        out["launched_in_backward"] = sum(
            1 for b in s.scheduler.buckets if not b.deferred and
            b.t_launch is not None and s.scheduler.t_backward_end is not None and
            b.t_launch < s.scheduler.t_backward_end)
    out["gathers_in_forward"] = s.gathers_waited_in_forward
    if s.sharded_buffers:
        out["padded"] = sum(b.padded for b in s.sharded_buffers)
        out["full_grad_bytes"] = sum(b.grad_data.untyped_storage().nbytes()
                                     for b in s.sharded_buffers)
    out["state_bytes"] = state_bytes(trainer)
    out["planned_bytes"] = _planned_bytes(trainer.cfg, trainer.state.rank)
    if trainer.cfg.parallel.use_torch_fsdp2:
        dp, root = trainer.state["dp"].size, trainer.model_chunks[0]
        in_units = {id(q) for u in fsdp_units(root) for q in u.parameters()}
        out["padded"] = sum(_fsdp_padded(p, dp) for p in s.params)
        out["root_padded"] = sum(_fsdp_padded(p, dp) for p in s.params if id(p) not in in_units)
    return out, trainer


def _planned_bytes(cfg, rank) -> dict:
    """The planner's state bytes for this layout and rank (its ZeRO stage from the flags)."""
    from megalite.planner import model_spec as ms
    from megalite.planner.layout import layout_from_config
    from megalite.planner.memory import Precision
    from megalite.planner.memory import state_bytes as planned_state_bytes

    L = layout_from_config(cfg)
    pp_rank = rank // (cfg.world_size // L.pp)
    params = ms.stage_params(cfg.model, pp_rank, L.tp, L.pp, L.vpp, L.etp, L.ep, *L.stage_split)
    return planned_state_bytes(params, L.dp * L.cp, L.edp, L.zero, Precision.fp32())


def _fsdp_padded(p, dp) -> int:
    """FSDP2 pads dim 0 of each parameter to a multiple of DP in its collectives."""
    rows = -(-p.shape[0] // dp) * dp
    return rows * (p.numel() // p.shape[0])


def _checkpoint_round_trip(world, path):
    """FSDP2 -> DDP -> FSDP2 through the model checkpoint: each load reproduces the saved
    weights exactly (both as sharded state dicts)."""
    fsdp = _trainer(LLAMA + FSDP, world)
    with torch.no_grad():
        for p in fsdp.strategy.params:       # make the weights differ from the init
            p.add_(0.01 * torch.ones_like(p))
    saved = model_sharded_state_dict(fsdp.model_chunks, fsdp.state)
    save_model_shards(f"{path}/a", 1, fsdp.model_chunks, fsdp.cfg, fsdp.state)
    ddp = _trainer(LLAMA, world)
    load_model_shards(f"{path}/a", ddp.model_chunks, ddp.cfg, ddp.state)
    in_ddp = model_sharded_state_dict(ddp.model_chunks, ddp.state)
    save_model_shards(f"{path}/b", 1, ddp.model_chunks, ddp.cfg, ddp.state)
    back = _trainer(LLAMA + FSDP, world)
    load_model_shards(f"{path}/b", back.model_chunks, back.cfg, back.state)
    return saved, in_ddp, model_sharded_state_dict(back.model_chunks, back.state)


def _experts(world):
    """Stand-in experts (test_data_parallel_dist: layer 0's MLP marked expert, EP2): with
    buckets their gradients reduce over expert-DP only, as without."""
    from test_data_parallel_dist import LAYOUTS, _one_step

    flags = LAYOUTS["ep2_dp4"]
    return _one_step(flags, world), _one_step(flags + OV, world)


def _batch(world, path=None):
    out = {name: _train(model + flags, world)[0] for name, (model, flags) in CASES[world].items()}
    if world == 4:
        out["experts"] = _experts(world)
    if path:
        out["ckpt"] = _checkpoint_round_trip(world, path)
        from test_training_dist import resumed_losses   # save after 2, load, 2 more

        out["resumed"] = {name: resumed_losses(lambda a: _trainer(a, world), LLAMA + flags,
                                               f"{path}/{name}")
                          for name, flags in (("fsdp2", FSDP), ("do_ov_pg", CASES[2]["do_ov_pg"][1]))}
        out["bf16"] = [_train(LLAMA + ["--bf16"] + f, world)[0]["losses"] for f in ([], FSDP)]
    return out


def _full(rank_sds):
    return assemble([{k: ShardedTensor(*v) if not isinstance(v, ShardedTensor) else v
                      for k, v in sd.items()} for sd in rank_sds])


@pytest.fixture(scope="module")
def reference():
    out = {}
    for name, model in (("llama", LLAMA), ("gpt2", GPT2)):
        run, _ = _train(model, 1)
        out[name] = (run["losses"], _full([run["sd"]]))
    return out


def _check(results, world, reference):
    for name, (model, flags) in CASES[world].items():
        ref_losses, ref_params = reference["gpt2" if model is GPT2 else "llama"]
        runs = [r[name] for r in results]
        writer = [r for r in runs if r["last_stage"]][0]
        for i, (got, want) in enumerate(zip(writer["losses"], ref_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), (name, i, got, want)
        params = _full([r["sd"] for r in runs])
        assert set(params) == set(ref_params)
        # AdamW normalises each element's step, so an element whose gradient is near zero
        # turns a rounding-level gradient difference into up to a fraction of lr (3e-3)
        # after 10 steps: measured <= 3e-6 natively, 1.5e-5 with ATEN_CPU_CAPABILITY=default
        for k, want in ref_params.items():
            torch.testing.assert_close(params[k], want, rtol=1e-4, atol=5e-5, msg=name + k)
        for r in runs:
            assert r["replicas"] is None, (name, r["replicas"])
            # memory per rank: what the tensors hold = the planner's state bytes for the
            # layout (DDP, ZeRO-1 optimizer/DP, ZeRO-2 grads/DP too, FSDP2 weights/DP too)
            for k in ("weights", "grads", "optimizer"):
                assert r["state_bytes"][k] == r["planned_bytes"][k], (name, k, r)
            c, psi = r["comm"], r["psi"]
            if "fsdp2" in name:
                # gathered: every unit twice (forward, backward), the root once (kept for
                # backward); reduce-scattered: everything once; per micro-batch
                ag, rs, padded = c["dp-cp/all_gather"], c["dp-cp/reduce_scatter"], r["padded"]
                assert 0 <= padded - psi < 0.05 * psi            # dim 0 padded to DP
                assert rs["elements"] == r["micro"] * padded, (name, rs, padded)
                assert ag["elements"] == r["micro"] * (2 * padded - r["root_padded"]), \
                    (name, ag, padded, r["root_padded"])
            elif name.startswith("ddp_ov"):
                # + the step's token count and loss (1 element each)
                assert c["dp-cp/all_reduce"]["elements"] == psi + 2, (name, c)
                assert c["dp-cp/all_reduce"]["calls"] == r["buckets"] + 2 > 3
            elif name.startswith("do_ov") and world // _mp(name) > 1:
                assert c["dp-cp/reduce_scatter"]["elements"] == r["padded"], c
                assert c["dp-cp/all_gather"]["elements"] == r["padded"], c
                assert r["padded"] - psi < r["buckets"] * (world // _mp(name))
            if "_ov" in name and "pp2" not in name:   # (PP2 stages: 1 bucket + the tied one)
                # buckets launched while backward was still running
                assert r["launched_in_backward"] >= 1, (name, r)
            if name.endswith("_pg"):        # each bucket's gather waited by a forward hook
                assert r["gathers_in_forward"] == (ITERS - 1) * r["buckets"], r
            if name.startswith("do_ov"):    # ZeRO-2: the full gradient is freed
                assert r["full_grad_bytes"] == 0
    if world == 4:
        for r in results:
            plain, ov = r["experts"]
            assert abs(ov["norm"] - plain["norm"]) <= 1e-6 * plain["norm"]
            assert {c for c, _ in ov["grads"].values()} == {"dense", "expert"}
            for n, (cls, g) in plain["grads"].items():
                torch.testing.assert_close(ov["grads"][n][1], g, rtol=1e-6, atol=1e-9)
            assert ov["comm"]["expert-dp/all_reduce"]["calls"] >= 1
    if world == 2:
        # bf16: FSDP2's bf16 compute copies of fp32 shards vs DDP's bf16 weights + fp32
        # masters: the same rounding of the same masters, different reduction dtypes
        ddp16, fsdp16 = results[-1]["bf16"]
        assert all(abs(a - b) <= 2e-3 * b for a, b in zip(fsdp16, ddp16)), (fsdp16, ddp16)
        for name in ("fsdp2", "do_ov_pg"):     # resume (optimizer state too) is exact
            straight = results[-1][name]["losses"][:4]
            got = results[-1]["resumed"][name]
            assert all(abs(a - b) <= 1e-6 * b for a, b in zip(got, straight)), (name, got)
        saved, in_ddp, back = zip(*[r["ckpt"] for r in results])
        a, b, c = _full(saved), _full(in_ddp), _full(back)
        for k in a:
            assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


def _mp(name):
    return (2 if "tp2" in name else 1) * (2 if "pp2" in name else 1)


def test_overlap_zero2_fsdp2_world2(dist, reference, tmp_path):
    _check(dist.run(2, _batch, 2, str(tmp_path)), 2, reference)


def test_overlap_zero2_fsdp2_world4(dist, reference):
    _check(dist.run(4, _batch, 4), 4, reference)


@pytest.mark.parametrize("flags,match", [
    (FSDP + DO, "pick one"),
    (["--overlap-param-gather"], "needs --use-distributed-optimizer"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size")])
def test_refused_combinations(flags, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["--world-size", "4", *LLAMA, *COMMON, *flags])
