"""Multi-Latent Attention and Multi-Token Prediction on real gloo ranks equal one process.

One 4-process launch trains each layout 10 iterations of a tiny MLA model (q and kv latents
with their norms, YaRN-scaled rope part) and compares every iteration's loss -- and the MTP
and MoE losses where the model has them -- with the single-process run of the same flags
(docs/architecture.md#numerical-contract: rel <= 1e-5 at step 1, <= 1e-4 over 10 steps):

  * MLA at TP2 + SP, CP2 with the ring (p2p) and the all-to-all (a2a), PP2 with selective
    and TP2 with full recomputation;
  * MTP at PP2 (a tied output layer: the last stage's embedding copy is both MTP's input and
    the output weight) and with EP2 x PP2 on a DeepSeek-style MoE (sigmoid router with expert
    bias, a shared expert, the first layer dense, aux and z losses).
"""
import pytest
import torch

from cpu_trainer import build_cpu_trainer, train_steps  # noqa: E402  (tests/ is on sys.path)

WORLD = 4
STEPS = 10
MLA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
       "--train-iters", str(STEPS), "--hidden-dropout", "0", "--attention-dropout", "0",
       "--eval-iters", "0", "--global-batch-size", "8", "--micro-batch-size", "2",
       "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type",
       "rope", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
       "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
       "--qk-layernorm", "--rotary-scaling-factor", "4", "--mscale-all-dim", "1",
       "--yarn-original-max-position-embeddings", "8"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "16",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-topk-scaling-factor", "2.5", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3"]
TIED = [f for f in MLA if f != "--untie-embeddings-and-output-weights"]
CASES = {   # name: (model flags, both runs; layout flags, the 4-process run only)
    "mla_tp2_sp": (MLA, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "mla_cp2_p2p": (MLA, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "mla_cp2_a2a": (MLA, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "mla_pp2_recompute_selective": (MLA, ["--pipeline-model-parallel-size", "2",
                                          "--recompute-granularity", "selective"]),
    "mla_tp2_recompute_full": (MLA, ["--tensor-model-parallel-size", "2",
                                     "--recompute-granularity", "full"]),
    "mtp_pp2_tied": ([*TIED, "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"],
                     ["--pipeline-model-parallel-size", "2"]),
    "mtp_ep2_pp2_recompute_full": ([*MLA, *MOE, "--mtp-num-layers", "1"],
                                   ["--pipeline-model-parallel-size", "2",
                                    "--expert-model-parallel-size", "2",
                                    "--recompute-granularity", "full"]),
}
KEYS = ("lm_loss", "mtp_1_loss", "mtp_2_loss", "moe_aux_loss", "moe_z_loss")


def _history(trainer):
    it = trainer.data_iterator(trainer.train_ds, trainer.consumed_samples)
    out = []
    for _ in range(STEPS):
        rec = trainer.train_step(it)
        out.append({k: rec[k] for k in KEYS if k in rec})
    return out


def _run_layouts(names):
    return {name: _history(build_cpu_trainer([*CASES[name][0], *CASES[name][1]], WORLD))
            for name in names}


@pytest.fixture(scope="module")
def results(dist):
    names = list(CASES)
    dist_runs = dist.run(WORLD, _run_layouts, names)
    # each rank returns the loop's logged values; the writer (last stage) has them all
    last = dist_runs[-1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # as the workers: tiny ops, a loaded 2-core machine
    try:
        single = {name: _history(build_cpu_trainer(CASES[name][0], 1)) for name in names}
    finally:
        torch.set_num_threads(threads)
    return last, single


@pytest.mark.parametrize("name", list(CASES))
def test_layout_equals_one_process(results, name):
    got, ref = results[0][name], results[1][name]
    keys = [k for k in KEYS if k in ref[0]]
    assert "lm_loss" in keys
    if name.startswith("mtp"):
        assert "mtp_1_loss" in keys
    if "ep2" in name:
        assert {"moe_aux_loss", "moe_z_loss"} <= set(keys)
    worst = {}
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        for key in keys:
            rel = abs(a[key] - b[key]) / abs(b[key])
            assert rel <= (1e-5 if step == 1 else 1e-4), (name, step, key, a[key], b[key])
            worst[key] = max(worst.get(key, 0.0), rel)
    print(f"{name}: max rel over {STEPS} steps " +
          ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))      # shown with -s
