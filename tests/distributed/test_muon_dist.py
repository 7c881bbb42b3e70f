"""--optimizer muon at every layout gives the single process's losses (issue 37).

One launch of 4 gloo processes runs, for 10 iterations each: TP2 (x DDP2), PP2 (x DDP2),
the distributed optimizer at DP4, FSDP2 at DP4, EP2 (x expert-DP2) and TP2 x DP2 with the
distributed optimizer, and with QK-clip TP2 x DP2 (distributed optimizer), PP2 x FSDP2 and
CP2 x DP2 (ring and all-to-all) --
each against one process on the same flags (rel <= 1e-5 at step 1,
<= 1e-4 after, docs/architecture.md).  The model has GQA (Q, K, V orthogonalised apart) and
SwiGLU (fc1's [gate; up] cut in two blocks by TP): a layout that orthogonalised shards, or
another "one matrix", would drift at once.  Per step, the whole-matrix exchange of the
sharded layouts is counted: over each DP group the all-to-alls' inputs add up to twice
(there and back) the Muon elements of the TP-local model, every rank sending its pieces
only (``optimizer/muon_layout.py``)."""
import math

import pytest

from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)
from megalite import comm
from megalite.optimizer.muon import is_muon_param

DENSE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
         "--vocab-size", "100", "--normalization", "RMSNorm", "--position-embedding-type",
         "rope", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--vocab-size", "100", "--num-experts", "4",
       "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--swiglu",
       "--moe-ffn-hidden-size", "24"]
COMMON = ["--mock-data", "--optimizer", "muon", "--lr", "1e-2", "--train-iters", "10",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
          "--weight-decay", "0.1", "--clip-grad", "1.0", "--global-batch-size", "8",
          "--micro-batch-size", "2", "--muon-nesterov"]
ITERS = 10
TP2, DO = ["--tensor-model-parallel-size", "2", "--sequence-parallel"], \
    ["--use-distributed-optimizer"]
# QK-clip at a cap the logits pass from the first step on (unclipped: 0.06 -> 0.17 over the
# 10 steps); random tokens barely feel attention, so the logits, not the losses, show it
QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "0.05"]
CASES = {   # name: (model flags, the layout's flags) on 4 ranks
    "tp2": (DENSE, TP2),
    "pp2": (DENSE, ["--pipeline-model-parallel-size", "2"]),
    "dp4_distopt": (DENSE, DO),
    "dp4_fsdp2": (DENSE, ["--use-torch-fsdp2"]),
    "ep2": (MOE, ["--expert-model-parallel-size", "2"]),
    "tp2_dp2_distopt": (DENSE, TP2 + DO),
    "tp2_dp2_distopt_qkclip": (DENSE + QK_CLIP, TP2 + DO),
    "pp2_dp2_fsdp2_qkclip": (DENSE + QK_CLIP, ["--pipeline-model-parallel-size", "2",
                                               "--use-torch-fsdp2"]),
    # under CP each rank sees part of the (query, key) pairs: ring, its queries against the
    # gathered keys; all-to-all, its block of heads over the whole sequence
    "cp2_dp2_ring_qkclip": (DENSE + QK_CLIP, ["--context-parallel-size", "2"]),
    "cp2_dp2_a2a_qkclip": (DENSE + QK_CLIP, ["--context-parallel-size", "2",
                                             "--cp-comm-type", "a2a"]),
}


def _train(flags, world):
    trainer = build_cpu_trainer([*COMMON, *flags], world)
    it = trainer.data_iterator(trainer.train_ds, 0)
    losses, logits = [], []
    for _ in range(ITERS):
        comm.counter.reset()
        out = trainer.train_step(it)
        losses.append(out["lm_loss"])
        logits.append(out.get("max_attention_logit"))
    muon = sum(math.prod(p.shape) for c in trainer.model_chunks
               for n, p in c.named_parameters() if is_muon_param(n, p.dim()))
    return {"losses": losses, "logits": logits, "comm": comm.counter.snapshot(), "muon_numel": muon,
            "last_stage": trainer.state.is_last_stage(ignore_virtual=True),
            "dp_rank": trainer.state["dp-cp"].rank, "tp_rank": trainer.state["tp"].rank}


def _batch():
    return {name: _train(model + flags, 4) for name, (model, flags) in CASES.items()}


@pytest.fixture(scope="module")
def reference():
    models = {tuple(model) for model, _ in CASES.values()}
    return {m: _train(list(m), 1) for m in models}


def test_muon_matches_single_process_at_every_layout(dist, reference):
    results = dist.run(4, _batch)
    clipped = reference[tuple(DENSE + QK_CLIP)]["logits"]
    assert clipped[0] > 0.05 and max(clipped[1:]) < 0.08, clipped      # capped near tau
    for name, (model, flags) in CASES.items():
        ref = reference[tuple(model)]
        runs = [r[name] for r in results]
        writer = [r for r in runs if r["last_stage"]][0]
        rel = [abs(a - b) / abs(b) for a, b in zip(writer["losses"], ref["losses"])]
        assert rel[0] <= 1e-5 and max(rel) <= 1e-4, (name, rel, writer["losses"], ref)
        if "--qk-clip" in model:    # the same logits step by step: the same clipped weights
            for r in runs:
                rel = [abs(a - b) / b for a, b in zip(r["logits"], ref["logits"])]
                assert max(rel) <= 1e-4, (name, rel, r["logits"], ref["logits"])
        print(f"muon {name}: max rel loss diff over {ITERS} steps {max(rel):.2e}")
        if name.endswith(("distopt", "fsdp2")):
            # per step and DP group: every Muon element goes to its owner and back once
            for tp in {r["tp_rank"] for r in runs}:
                mine = [r for r in runs if r["tp_rank"] == tp]
                sent = sum(r["comm"]["dp-cp/all_to_all"]["elements"] for r in mine)
                assert sent == 2 * mine[0]["muon_numel"], (name, sent, mine[0]["muon_numel"])
                for r in mine:   # fp32, one all-to-all there and one back per step
                    c = r["comm"]["dp-cp/all_to_all"]
                    assert c["bytes"] == 4 * c["elements"] and c["calls"] == 2, (name, c)
                per_rank = [r["comm"]["dp-cp/all_to_all"]["elements"] for r in mine]
                print(f"muon {name}: all-to-all elements per step {per_rank} (sum {sent} "
                      f"= 2 x {mine[0]['muon_numel']} Muon elements)")
