"""Gated DeltaNet under context parallelism on real gloo ranks equals the single process:
the recurrent state walks the CP ranks in sequence order (context_parallel/delta_state.py)
at CP2 and CP4 (where middle ranks both receive and send each way), with TP2+SP, with PP2
and full recomputation (the chain re-runs inside the backward), and PP2 x VPP2 without CP
(virtual chunks of alternating layer kinds), packed documents
(--reset-attention-mask: about six documents per 96-token sample, NullTokenizer's EOD is
vocab - 1 = 15) and without -- one launch of four ranks, three iterations each, losses and
gradient norms.  (tests/distributed/test_hf_families_dist.py holds the converted
Qwen3-Next to transformers' loss at CP2.)"""
import pytest

WORLD, ITERS = 4, 3
RUN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
       "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
       "--seq-length", "96", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "16", "--lr", "3e-3", "--train-iters", str(ITERS),
       "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
       "--apply-layernorm-1p", "--position-embedding-type", "rope", "--rotary-percent", "0.5",
       "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--attention-output-gate",
       "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
       "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
       "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
       "--untie-embeddings-and-output-weights", "--global-batch-size", "4",
       "--micro-batch-size", "2", "--eval-iters", "0", "--lr-warmup-iters", "1"]
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
CASES = {
    "cp4": ["--context-parallel-size", "4"],
    "cp4-docs": DOCS + ["--context-parallel-size", "4"],
    "cp2-tp2-sp-docs": DOCS + ["--context-parallel-size", "2", "--tensor-model-parallel-size",
                               "2", "--sequence-parallel"],
    "cp2-pp2-recompute-docs": DOCS + ["--context-parallel-size", "2",
                                      "--pipeline-model-parallel-size", "2",
                                      "--recompute-granularity", "full",
                                      "--recompute-method", "uniform"],
    # no CP: interleaved stages of alternating layer kinds (1 layer per virtual chunk)
    "pp2-vpp2-docs": DOCS + ["--pipeline-model-parallel-size", "2",
                             "--num-virtual-stages-per-pipeline-rank", "2",
                             "--micro-batch-size", "1"],
}


def _train(cases):
    from cpu_trainer import train_cases

    return train_cases(RUN, cases, ITERS)


@pytest.fixture(scope="module")
def results(dist):
    cases = {"ref": (1, []), "ref-docs": (1, DOCS)}
    cases.update({name: (WORLD, argv) for name, argv in CASES.items()})
    return dist.run(WORLD, _train, cases)


def test_documents_change_the_loss(results):
    plain, docs = results[0]["ref"], results[0]["ref-docs"]
    assert abs(plain["loss"][0] - docs["loss"][0]) > 1e-4 * plain["loss"][0]
    assert len(set(docs["loss"])) == ITERS


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_gated_delta_net_gives_the_single_process_losses(results, name):
    ref = results[0]["ref-docs" if "docs" in name else "ref"]
    (got,) = [r[name] for r in results if r[name]["writer"]]
    print(f"{name}: step 1 rel {abs(got['loss'][0] - ref['loss'][0]) / ref['loss'][0]:.1e}")
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * ref["loss"][0], (name, got, ref)
    for a, b in zip(got["loss"] + got["norm"], ref["loss"] + ref["norm"]):
        assert abs(a - b) <= 1e-4 * b, (name, got, ref)


@pytest.mark.parametrize("name", [n for n in CASES if "cp" in n])
def test_planner_counts_the_cp_bytes_of_the_state_walk(results, name):
    """The planner's CP sends (planner/linear_attention_cost.py: the DeltaNet layers' state
    and convolution tail per hop, forward, backward and a full recomputation's re-run; ring
    attention's K/V for the attention layers) against the bytes comm.counter saw, on the
    busiest rank (the planner counts a middle rank's two neighbours)."""
    sent = max(r[name]["cp_sent"] for r in results)
    planned = max(r[name]["cp_planned"] for r in results)
    print(f"{name}: CP bytes sent per step {sent:.0f}, planner {planned:.0f}")
    assert sent == planned, (name, [(r[name]["cp_sent"], r[name]["cp_planned"])
                                    for r in results])
