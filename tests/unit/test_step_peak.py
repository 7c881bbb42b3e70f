"""planner.step_peak: the phases' terms for each ZeRO stage (states live at the peak plus
the largest phase), gloo's collective copies charged only on gloo, and its bucket size equal
to the one megalite's buckets use."""
from megalite.cli.arguments import parse_args
from megalite.distributed.grad_buckets import bucket_size
from megalite.planner.step_peak import ddp_bucket_elements, predict_step_peak

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "256", "--mock-data", "--micro-batch-size", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "4",
         "--train-iters", "10", "--lr", "1e-3"]
FLAGS = {0: [], 1: ["--use-distributed-optimizer"],
         2: ["--use-distributed-optimizer", "--overlap-grad-reduce"], 3: ["--use-torch-fsdp2"]}


def _cfg(zero, world=4, extra=()):
    return parse_args(["--world-size", str(world), *MODEL, *FLAGS[zero], *extra])


def test_total_is_states_plus_the_largest_phase():
    for zero in FLAGS:
        p = predict_step_peak(_cfg(zero), 0, gloo=True)
        phase = p["phases"][p["peak_phase"]]
        assert p["peak_phase"] == max(p["phases"], key=p["phases"].get)
        assert p["total"] == p["weights"] + p["grads"] + p["optimizer"] + phase
        extra = p["activations"] if p["peak_phase"] == "backward" else 0
        assert p["transient"] == phase - extra


def test_sharding_lowers_the_peak_and_gloo_adds_copies():
    small = ("--ddp-bucket-size", "20000")       # ZeRO-2 saves only if it has several buckets
    peaks = [predict_step_peak(_cfg(z, extra=small), 0, gloo=True)["total"] for z in FLAGS]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    one_bucket = predict_step_peak(_cfg(2), 0, gloo=True)      # default 40M: one bucket
    assert one_bucket["total"] > predict_step_peak(_cfg(1), 0, gloo=True)["total"]
    z1 = predict_step_peak(_cfg(1), 0, gloo=True)
    z1_nccl = predict_step_peak(_cfg(1), 0, gloo=False)
    psi = z1["weights"] // 4                                   # fp32 weights, 4 B each
    assert z1["phases"]["grad_sync"] - z1_nccl["phases"]["grad_sync"] == 4 * psi
    assert z1["grads"] == 4 * psi and z1["optimizer"] == 8 * psi // 4
    assert predict_step_peak(_cfg(3), 0, gloo=True)["grads"] == 0   # freed at zero_grad
    dp1 = predict_step_peak(_cfg(1, world=1), 0, gloo=True)
    assert dp1["phases"]["grad_sync"] == dp1["phases"]["optimizer_step"] == 0


def test_bucket_size_is_megalites():
    for world, extra in ((1, ()), (4, ()), (4, ("--ddp-bucket-size", "1234"))):
        cfg = _cfg(2, world, extra)
        assert ddp_bucket_elements(cfg, world) == bucket_size(cfg, world)
