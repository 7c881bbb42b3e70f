"""Qwen-style attention on real gloo ranks equals the single-process run: --qk-layernorm
(q/k norm weights replicated over TP, their grads summed over it), --add-qkv-bias (split
with the heads), a head dim independent of hidden / heads and YaRN RoPE, under TP2, TP2+SP,
CP2 (p2p and a2a) and PP2 -- step 1 within 1e-5, 10 steps within 1e-4 (docs/architecture.md#numerical-contract)."""
import torch.distributed as torch_dist

from megalite.distributed.replicas import check_replicas

from cpu_trainer import build_cpu_trainer, train_steps  # noqa: E402  (tests/ is on sys.path)

STEPS = 10
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
         "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
         "--train-iters", str(STEPS), "--hidden-dropout", "0", "--attention-dropout", "0",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--add-qkv-bias", "--qk-layernorm", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
         "--yarn-original-max-position-embeddings", "8", "--init-method-std", "0.05",
         "--eval-iters", "0", "--global-batch-size", "4", "--micro-batch-size", "2"]
CASES = [("tp2", ["--tensor-model-parallel-size", "2"]),
         ("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
         ("cp2_p2p", ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
         ("cp2_a2a", ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
         ("pp2", ["--pipeline-model-parallel-size", "2"])]


def _runs():
    out = {}
    if torch_dist.get_rank() == 0:      # the single-process reference, on rank 0 alone
        out["ref"] = train_steps(build_cpu_trainer(MODEL, 1), STEPS)
    torch_dist.barrier()
    for name, argv in CASES:
        trainer = build_cpu_trainer(MODEL + argv, 2)
        out[name] = train_steps(trainer, STEPS)
        try:
            check_replicas(trainer.model_chunks, trainer.state)
            out[name + "_replicas"] = None
        except RuntimeError as exc:
            out[name + "_replicas"] = str(exc)
    return out


def _rel(a, b):
    return abs(a - b) / abs(b)


def test_qk_layernorm_and_qkv_bias_match_single_process(dist):
    results = dist.run(2, _runs)
    ref = results[0]["ref"]
    assert len(set(ref)) == STEPS                              # the weights move
    for name, _ in CASES:
        losses = results[-1][name]                             # the last rank holds the loss
        step1, worst = _rel(losses[0], ref[0]), max(_rel(a, b) for a, b in zip(losses, ref))
        print(f"{name}: step 1 rel {step1:.1e}, {STEPS} steps max rel {worst:.1e}")
        assert step1 <= 1e-5 and worst <= 1e-4, (name, losses, ref)
        for r in results:            # the q/k norm weights stay identical on TP ranks
            assert r[name + "_replicas"] is None, (name, r[name + "_replicas"])
