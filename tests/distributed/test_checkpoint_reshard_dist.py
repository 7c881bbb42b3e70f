"""Resharding on resume: a run saved at one layout continues at another with optimizer
state (Adam moments, step, fp32 masters) intact, so its losses match the uninterrupted
run to fp32 tolerance.  Without the optimizer state (``--no-load-optim``) they do not,
which shows the check can tell.

Rows on 4 processes (one launch): TP2xPP2 -> TP1xPP4 / TP4xPP1, VPP2 -> VPP1, DP2 with the
distributed optimizer <-> DP1 plain, DP2 -> DP4; MoE EP2 (distributed optimizer: expert
states sharded over expert-DP) -> EP1 and EP1 -> EP2 x expert-TP2; CP2xDP2 (distributed
optimizer over dp-cp) -> CP1 at DP1 and TP2xDP2 -> CP2xDP2, and CP2xDP2 with hidden dropout
on resumes bit for bit (each CP rank's generators come back).  Rows on 2 processes (one
launch): FSDP2 DP2 -> DDP DP2 and -> DP1, DDP DP2 -> FSDP2 DP2 (FSDP2's optimizer states
are DTensor pieces at their offsets, loaded into whole tensors and back).  Issue 26's
compositions on 4 processes: FSDP2 x PP2 -> distributed optimizer PP2, the distributed
optimizer with 2 instances -> HSDP 2 x 2 (FSDP2) -> DDP DP4 (an HSDP piece is written by
its first instance only), MoE EP2 under FSDP2 (experts sharded over expert-DP) -> EP1.
"""
import torch.distributed as torch_dist

from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
        "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--eval-iters", "0", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
        "--global-batch-size", "8", "--micro-batch-size", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-aux-loss-coeff", "1e-2"]
DO = ["--use-distributed-optimizer"]

LAYOUTS = {   # name: (world size, flags)
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp1pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "tp4pp1": (4, ["--tensor-model-parallel-size", "4"]),
    "vpp2": (4, ["--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1"]),
    "vpp1": (4, ["--pipeline-model-parallel-size", "2"]),
    "pp2dp2_distopt": (4, ["--pipeline-model-parallel-size", "2", *DO]),
    "tp2dp2_distopt": (4, ["--tensor-model-parallel-size", "2", *DO]),
    "dp1": (1, []),
    "tp2dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "dp4": (4, []),
    "moe_ep2_distopt": (4, [*MOE, "--expert-model-parallel-size", "2", *DO]),
    "moe_ep1": (1, MOE),
    "moe_ep2_etp2": (4, [*MOE, "--expert-model-parallel-size", "2",
                         "--expert-tensor-parallel-size", "2"]),
    "cp2dp2_distopt": (4, ["--context-parallel-size", "2", *DO]),
    "cp2dp2": (4, ["--context-parallel-size", "2"]),
    "cp2dp2_dropout": (4, ["--context-parallel-size", "2", "--hidden-dropout", "0.1"]),
    "fsdp2_pp2": (4, ["--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"]),
    "distopt_2x2": (4, [*DO, "--num-distributed-optimizer-instances", "2"]),
    "hsdp_2x2": (4, ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "2"]),
    "moe_ep2_fsdp2": (4, [*MOE, "--expert-model-parallel-size", "2", "--use-torch-fsdp2"]),
    "fsdp2_dp2": (2, ["--use-torch-fsdp2"]),
    "ddp_dp2": (2, []),
}
ROWS = {   # launch world size: [(saved at, resumed at)]
    4: [("tp2pp2", "tp1pp4"), ("tp2pp2", "tp4pp1"), ("vpp2", "vpp1"),
        ("pp2dp2_distopt", "dp1"), ("dp1", "tp2dp2_distopt"), ("tp2dp2", "dp4"),
        ("moe_ep2_distopt", "moe_ep1"), ("moe_ep1", "moe_ep2_etp2"),
        ("cp2dp2_distopt", "dp1"), ("tp2dp2", "cp2dp2"),
        ("cp2dp2_dropout", "cp2dp2_dropout"),
        ("fsdp2_pp2", "pp2dp2_distopt"), ("distopt_2x2", "hsdp_2x2"), ("hsdp_2x2", "dp4"),
        ("moe_ep2_fsdp2", "moe_ep1")],
    2: [("fsdp2_dp2", "ddp_dp2"), ("fsdp2_dp2", "dp1"), ("ddp_dp2", "fsdp2_dp2")],
}
NO_OPTIM = {4: ("tp2pp2", "tp1pp4"), 2: ("fsdp2_dp2", "ddp_dp2")}   # the control rows


def _trainer(name, extra):
    world, flags = LAYOUTS[name]
    return build_cpu_trainer([*BASE, *flags, *extra], world)


def _on_my_ranks(name) -> bool:
    """A layout runs on every process of the launch, or (one rank) on rank 0 alone."""
    return LAYOUTS[name][0] == torch_dist.get_world_size() or torch_dist.get_rank() == 0


def _straight_saving(name, path):
    """Four iterations, saving after the second: (losses, checkpoint dir)."""
    losses = None
    if _on_my_ranks(name):
        trainer = _trainer(name, ["--save", path])
        it = trainer.data_iterator(trainer.train_ds, 0)
        losses = []
        for i in range(4):
            losses.append(trainer.train_step(it)["lm_loss"])
            if i == 1:
                trainer.save()
    torch_dist.barrier()
    return losses


def _continued(name, path, extra=()):
    losses = None
    if _on_my_ranks(name):
        trainer = _trainer(name, ["--load", path, *extra])
        assert trainer.iteration == 2 and trainer.consumed_samples == 16
        it = trainer.data_iterator(trainer.train_ds, trainer.consumed_samples)
        losses = [trainer.train_step(it)["lm_loss"] for _ in range(2)]
    torch_dist.barrier()
    return losses


def _matrix(root):
    world = torch_dist.get_world_size()
    out, straight = {}, {}
    for src, dst in ROWS[world]:
        if src not in straight:
            straight[src] = _straight_saving(src, f"{root}/{src}")
        out[f"{src}->{dst}"] = (straight[src], _continued(dst, f"{root}/{src}"))
    src, dst = NO_OPTIM[world]
    out["no_optim"] = (straight[src], _continued(dst, f"{root}/{src}", ["--no-load-optim"]))
    return out


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _loss_rank(out, row, i):
    """The losses as a last pipeline stage saw them (others hold zeros)."""
    return next(r[row][i] for r in reversed(out) if r[row][i] and all(r[row][i]))


def _check(out):
    for row in out[0]:
        straight, resumed = _loss_rank(out, row, 0), _loss_rank(out, row, 1)
        src, _, dst = row.partition("->")
        if row == "no_optim":
            assert _rel(resumed, straight[2:]) > 1e-5, (straight, resumed)
        elif src == dst:        # same layout: every generator continues, bit for bit
            assert resumed == straight[2:], (row, straight, resumed)
        else:
            assert _rel(resumed, straight[2:]) <= 1e-5, (row, straight, resumed)


def test_reshard_matrix_continues_with_optimizer_state(dist, tmp_path):
    _check(dist.run(4, _matrix, str(tmp_path)))


def test_fsdp2_reshards_to_and_from_plain_data_parallel(dist, tmp_path):
    _check(dist.run(2, _matrix, str(tmp_path)))
