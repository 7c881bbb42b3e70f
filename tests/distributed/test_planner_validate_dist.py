"""``megalite plan --validate-run`` on real gloo ranks: the planner's weights, gradients and
optimizer bytes equal what each rank holds, activations are within 10% of the peak held
for backward, and communication per group/op within 1% of ``megalite.comm.counter``."""
import pytest

from megalite.commands.validate_run import validate

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "2",
         "--global-batch-size", "8"]
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "160",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
FSDP, HYBRID = ["--use-torch-fsdp2"], ["--num-distributed-optimizer-instances", "2"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12",
       "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm"]
UNTIED = [f for f in LLAMA if f not in ("--group-query-attention", "--num-query-groups", "2")]

CASES = {   # name: (world size, flags); GPT-2 style (dropout, LayerNorm, tied) unless LLAMA
    "single_llama_selective": (1, LLAMA + ["--recompute-granularity", "selective"]),
    "tp2": (2, TP2),
    "dp2": (2, []),
    "tp2_sp_llama_bf16": (2, TP2 + LLAMA + ["--sequence-parallel", "--bf16"]),
    "pp2_llama": (2, PP2 + LLAMA),
    "tp2_dp2_sp": (4, TP2 + ["--sequence-parallel"]),
    "tp2_pp2_sp_llama_bf16": (4, TP2 + PP2 + LLAMA + ["--sequence-parallel", "--bf16"]),
    # context parallelism: ring K/V and dK/dV messages, all-to-alls (recompute repeats them)
    "cp2_ring_llama": (2, CP2 + LLAMA),
    "cp2_a2a_llama_selective": (2, CP2 + LLAMA + ["--cp-comm-type", "a2a",
                                                  "--recompute-granularity", "selective"]),
    "tp2_cp2_sp_ring_llama_bf16": (4, TP2 + CP2 + LLAMA + ["--sequence-parallel", "--bf16"]),
    "moe_ep2": (2, MOE + ["--expert-model-parallel-size", "2"]),
    "moe_ep2_tp2_sp_etp1_shared_llama": (4, MOE + LLAMA + TP2 + [
        "--expert-model-parallel-size", "2", "--sequence-parallel",
        "--expert-tensor-parallel-size", "1", "--moe-shared-expert-intermediate-size", "32"]),
    # FSDP2 (issue 26): its all-gathers / reduce-scatters counted per unit; with PP once per
    # step; HSDP's all-reduce across instances; experts over expert-DP
    "fsdp2_pp2_llama": (4, FSDP + PP2 + LLAMA),
    "hsdp_2x2_llama_bf16": (4, FSDP + HYBRID + LLAMA + ["--bf16"]),
    "fsdp2_moe_ep2": (4, FSDP + MOE + ["--expert-model-parallel-size", "2"]),
    # MLA's TP entries are its latents and rope key; each MTP depth adds a layer, the
    # embedding of the shifted tokens, eh_proj and an output layer + loss on the last stage
    "mla_mtp_tp2_sp": (2, UNTIED + MLA + TP2 + ["--sequence-parallel", "--mtp-num-layers", "1"]),
    # ... and with PP: the MTP layer's all-to-alls, the embedding copy's all-reduce, the
    # extra losses and expert loads summed over the pipeline
    "mla_mtp_moe_ep2_pp2": (4, UNTIED + MLA + MOE + PP2 + [
        "--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "32",
        "--expert-model-parallel-size", "2", "--mtp-num-layers", "1"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_predictions_match_a_real_iteration(dist, name):
    world, flags = CASES[name]
    rows, ok = validate(MODEL + flags, world, pool=dist)
    for rank, rank_rows in enumerate(rows):
        by = {r["what"]: r for r in rank_rows}
        for k in ("weights", "grads", "optimizer"):
            assert by[k]["pred"] == by[k]["meas"], (name, rank, by[k])
        act = by["activations"]
        assert abs(act["meas"] / act["pred"] - 1) <= 0.10, (name, rank, act)
        comm = [r for r in rank_rows if "/" in r["what"]]
        assert comm or world == 1
        for r in comm:
            assert abs(r["meas"] - r["pred"]) <= 0.01 * r["pred"], (name, rank, r)
    assert ok
