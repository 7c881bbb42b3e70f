"""gpt-oss's layer trained from scratch on real gloo ranks equals the single-process run:
learned attention sinks (--softmax-type learnable) with a 7-token window on every other
layer, the clamped quick-GeGLU (--glu-linear-offset 1 --activation-func-clamp-value 1)
and MoE layers with router and expert biases (--moe-expert-bias), at TP2 with sequence
parallelism (the sinks split with the heads), CP2 ring (the sinks folded into the final
log-sum-exp), CP2 all-to-all with TP2 (each rank its block of the heads' sinks), EP2 and
PP2 -- one launch, three iterations each: step-1 loss within 1e-5, every loss and
gradient norm within 1e-4 (docs/architecture.md#numerical-contract).
"""
import pytest

WORLD = 4
ITERS = 3
RUN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8",
       "--group-query-attention", "--num-query-groups", "4", "--seq-length", "32",
       "--mock-data", "--vocab-size", "64", "--lr", "3e-3", "--train-iters", str(ITERS),
       "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
       "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
       "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-iters", "0",
       "--lr-warmup-iters", "1", "--init-method-std", "0.1",
       "--softmax-type", "learnable", "--window-size", "7,0", "--window-attn-skip-freq", "2",
       "--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "1",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-expert-bias", "--expert-tensor-parallel-size", "1"]
CASES = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2-p2p": ["--context-parallel-size", "2"],
    "cp2-a2a-tp2": ["--context-parallel-size", "2", "--cp-comm-type", "a2a",
                    "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2": ["--expert-model-parallel-size", "2", "--micro-batch-size", "1"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
}


def _train(cases):
    from cpu_trainer import train_cases

    return train_cases(RUN, cases, ITERS)


@pytest.fixture(scope="module")
def results(dist):
    cases = {"ref": (1, []), "ref-vanilla": (1, ["--softmax-type", "vanilla"])}
    cases.update({name: (WORLD, argv) for name, argv in CASES.items()})
    return dist.run(WORLD, _train, cases)


def test_the_sinks_change_the_loss_and_train(results):
    ref, vanilla = results[0]["ref"], results[0]["ref-vanilla"]
    assert abs(ref["loss"][0] - vanilla["loss"][0]) > 1e-4 * vanilla["loss"][0]
    assert len(set(ref["loss"])) == ITERS


@pytest.mark.parametrize("name", list(CASES))
def test_every_layout_gives_the_single_process_losses_and_norms(results, name):
    ref = results[0]["ref"]
    (got,) = [r[name] for r in results if r[name]["writer"]]
    step1 = abs(got["loss"][0] - ref["loss"][0]) / ref["loss"][0]
    print(f"gpt-oss layer {name}: step 1 rel {step1:.1e}, losses {got['loss']} vs "
          f"{ref['loss']}, grad norms {got['norm']} vs {ref['norm']}")
    assert step1 <= 1e-5, (name, got, ref)
    for a, b in zip(got["loss"] + got["norm"], ref["loss"] + ref["norm"]):
        assert abs(a - b) <= 1e-4 * b, (name, got, ref)
