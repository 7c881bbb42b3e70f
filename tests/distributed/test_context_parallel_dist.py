"""Context parallelism on real gloo ranks equals the single-process model.

Three levels, each batched into one launch per world size:
  * core attention alone (ring and all-to-all, CP 2 and 4, causal and unmasked, GQA, seq
    64 and 512): output and q/k/v gradients vs full-sequence SDPA, the attention work per
    rank, and the messages per attention from ``comm.counter``;
  * the GPT model at step 1 (CP alone and with TP+SP; Llama-style and GPT-2-style): loss and
    every gradient after the dp-cp reduction vs one process;
  * the training loop over 10 iterations (CP with DP, TP+SP, PP under all three schedules,
    the distributed optimizer, recomputation): per-iteration losses vs one process.
"""
import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from megalite import comm
from megalite.config import ModelConfig
from megalite.context_parallel.a2a import UlyssesAttention
from megalite.context_parallel.load_balance import causal_pairs, token_indices
from megalite.context_parallel.ring import RingAttention, work
from megalite.parallel_state import ParallelState, RankGrid
from megalite.parallel_state import ModelCommGroups
from megalite.transformer.spec import AttnMaskType

WORLD = 4


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# ---- core attention --------------------------------------------------------------------
def qkv(seq, heads=8, groups=4, d=8, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, seq, d, generator=g), torch.randn(b, groups, seq, d, generator=g),
            torch.randn(b, groups, seq, d, generator=g), torch.randn(b, heads, seq, d, generator=g))


def reference_attention(seq, causal, groups):
    q, k, v, dout = (t.requires_grad_(True) if i < 3 else t
                     for i, t in enumerate(qkv(seq, groups=groups)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


ATTN_CASES = [(kind, cp, seq, causal, groups)
              for kind in ("p2p", "a2a") for cp in (2, 4) for seq in (64, 512)
              for causal in (True, False) for groups in (8, 4) if seq == 64 or causal]


def _attention_cases(cases):
    rank = torch_dist.get_rank()
    out = []
    for kind, cp, seq, causal, groups in cases:
        state = ParallelState.build(RankGrid(WORLD, cp=cp), rank)
        m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, kv_channels=8,
                        group_query_attention=groups != 8, num_query_groups=groups,
                        attention_dropout=0.0, seq_length=seq)
        cls = RingAttention if kind == "p2p" else UlyssesAttention
        mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
        attn = cls(m, ModelCommGroups.from_parallel_state(state), attn_mask_type=mask)
        idx = token_indices(seq, cp, state.cp.rank)
        q, k, v, dout = (t.index_select(2, idx).contiguous() for t in qkv(seq, groups=groups))
        q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
        comm.counter.reset()
        work.reset()
        o = attn(q, k, v)
        fwd = comm.counter.snapshot()
        comm.counter.reset()
        o.backward(dout)
        bwd = comm.counter.snapshot()
        out.append(dict(idx=idx, out=o.detach(), dq=q.grad, dk=k.grad, dv=v.grad, fwd=fwd,
                        bwd=bwd, computed=work.computed, useful=work.useful,
                        kv_numel=k.numel() * 2, qkv_numel=q.numel() + 2 * k.numel()))
    return out


@pytest.fixture(scope="module")
def attention_results(dist):
    return dist.run(WORLD, _attention_cases, ATTN_CASES)


@pytest.mark.parametrize("case", range(len(ATTN_CASES)),
                         ids=[f"{k}-cp{c}-s{s}-{'causal' if m else 'full'}-g{g}"
                              for k, c, s, m, g in ATTN_CASES])
def test_core_attention_matches_full_sequence(attention_results, case):
    kind, cp, seq, causal, groups = ATTN_CASES[case]
    ref = reference_attention(seq, causal, groups)
    full = [torch.zeros_like(t) for t in ref]
    for r in attention_results[:cp]:                      # ranks 0..cp-1: CP group 0
        res = r[case]
        for buf, key in zip(full, ("out", "dq", "dk", "dv")):
            buf[:, :, res["idx"]] = res[key]
    for name, got, want in zip(("out", "dq", "dk", "dv"), full, ref):
        assert rel(got, want) <= 1e-5, (name, rel(got, want))

    # attention work balanced over CP ranks (the useful, unmasked part too)
    for key in ("computed", "useful"):
        vals = [r[case][key] for r in attention_results[:cp]]
        assert max(vals) <= 1.01 * min(vals), (key, vals)

    # messages per attention, from comm.counter
    res = attention_results[0][case]
    fwd, bwd = res["fwd"], res["bwd"]
    if kind == "p2p":   # K/V heads only: CP-1 transfers forward; K/V CP-1 + dK/dV CP back
        assert fwd == {"cp/send": dict(calls=cp - 1, elements=(cp - 1) * res["kv_numel"],
                                       bytes=4 * (cp - 1) * res["kv_numel"]),
                       "cp/recv": dict(calls=cp - 1, elements=(cp - 1) * res["kv_numel"],
                                       bytes=4 * (cp - 1) * res["kv_numel"])}, fwd
        n = 2 * cp - 1
        assert bwd["cp/send"] == dict(calls=n, elements=n * res["kv_numel"],
                                      bytes=4 * n * res["kv_numel"]), bwd
        assert set(bwd) == {"cp/send", "cp/recv"} and bwd["cp/recv"] == bwd["cp/send"]
    else:               # 2 all-to-alls each way: q|k|v in, output out (and their grads)
        o_numel = res["out"].numel()
        want = dict(calls=2, elements=res["qkv_numel"] + o_numel,
                    bytes=4 * (res["qkv_numel"] + o_numel))
        assert fwd == {"cp/all_to_all": want} and bwd == {"cp/all_to_all": want}, (fwd, bwd)


def test_load_balance_evens_causal_work():
    """The 2CP-chunk layout gives every rank the same causal work; a contiguous split
    gives the last rank ~2CP-1 times the first rank's (what load balancing fixes)."""
    for cp in (2, 4, 8):
        balanced = [causal_pairs(512, cp, r) for r in range(cp)]
        plain = [causal_pairs(512, cp, r, balanced=False) for r in range(cp)]
        assert len(set(balanced)) == 1 and sum(balanced) == sum(plain) == 512 * 513 // 2
        assert plain[-1] / plain[0] > 2 * cp - 2
        assert sorted(torch.cat([token_indices(512, cp, r) for r in range(cp)]).tolist()) \
            == list(range(512))


# ---- the GPT model at step 1 -------------------------------------------------------------
VOCAB, BATCH = 70, 2


def model_kwargs(arch: str, seq: int) -> dict:
    common = dict(num_layers=2, hidden_size=32, num_attention_heads=8, seq_length=seq,
                  vocab_size=VOCAB, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.05)
    if arch == "llama":
        common.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                      ffn_hidden_size=48, add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, group_query_attention=True,
                      num_query_groups=4)
    else:  # GPT-2 style: learned absolute positions, tied embeddings, biases
        common.update(ffn_hidden_size=64, max_position_embeddings=seq)
    return common


def make_model_cfg(arch, seq, kind="p2p", cp=1, tp=1, sp=False, world=1):
    from megalite.config import MegaliteConfig, ParallelConfig

    par = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                         cp_comm_type=kind, sequence_parallel=sp)
    cfg = MegaliteConfig(model=ModelConfig(**model_kwargs(arch, seq)), parallel=par,
                         world_size=world)
    cfg.training.seed = 1234
    return cfg


def raw_batch(seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (BATCH, seq), generator=g),
            "labels": torch.randint(0, VOCAB, (BATCH, seq), generator=g),
            "loss_mask": (torch.rand(BATCH, seq, generator=g) > 0.2).float(),
            "position_ids": torch.arange(seq).expand(BATCH, seq)}


def model_step(model, batch, denom):
    """Masked loss over the global token count, backward; (loss sum, {name: (param, grad,
    shard meta)})."""
    per_token = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
    total = (per_token * batch["loss_mask"]).sum()
    (total / denom).backward()
    return total.detach(), {n: (p.detach().clone(), p.grad.detach().clone(), spec.to_meta_dict())
                            for n, p, spec in model.param_table.named(model)}


MODEL_CASES = [("llama", "p2p", 2, 1, False, 64), ("llama", "p2p", 4, 1, False, 64),
               ("llama", "a2a", 2, 1, False, 64), ("llama", "a2a", 4, 1, False, 64),
               ("gpt2", "p2p", 4, 1, False, 64), ("gpt2", "a2a", 2, 1, False, 64),
               ("llama", "p2p", 2, 2, True, 64), ("llama", "a2a", 2, 2, True, 64),
               ("gpt2", "p2p", 2, 2, True, 64),
               ("llama", "p2p", 2, 1, False, 512), ("llama", "a2a", 4, 1, False, 512)]


def _model_cases(cases):
    from megalite.models.gpt import build_model
    from megalite.models.gpt_step import get_batch
    from megalite.tensor_parallel import allreduce_sequence_parallel_grads

    rank = torch_dist.get_rank()
    out = []
    for arch, kind, cp, tp, sp, seq in cases:
        state = ParallelState.build(RankGrid(WORLD, tp=tp, cp=cp), rank)
        model = build_model(make_model_cfg(arch, seq, kind, cp, tp, sp, WORLD), state)
        raw = raw_batch(seq)
        total, shards = model_step(model, get_batch(raw, state, "cpu"), raw["loss_mask"].sum())
        allreduce_sequence_parallel_grads(model, state)
        # the CP part of the dp-cp gradient reduction (DP replicas computed the same)
        comm.all_reduce_coalesced([p.grad for p in model.parameters()], state.cp)
        shards = {n: (p.detach().clone(), p.grad.detach().clone(), shards[n][2])
                  for n, p in model.canonical_named_parameters()}
        out.append((comm.all_reduce(total, state.cp), shards))
    return out


@pytest.fixture(scope="module")
def model_results(dist):
    return dist.run(WORLD, _model_cases, MODEL_CASES)


@pytest.mark.parametrize("case", range(len(MODEL_CASES)),
                         ids=["-".join(map(str, c)) for c in MODEL_CASES])
def test_model_step_matches_single_process(model_results, case):
    from megalite.checkpointing.sharding import unshard_tensors
    from megalite.models.gpt import build_model, single_rank_state

    arch, kind, cp, tp, sp, seq = MODEL_CASES[case]
    raw = raw_batch(seq)
    ref_total, ref = model_step(build_model(make_model_cfg(arch, seq), single_rank_state()),
                                raw, raw["loss_mask"].sum())
    tp_group = [r[case] for r in model_results[:tp]]     # ranks 0..tp-1: CP rank 0
    assert rel(tp_group[0][0], ref_total) <= 1e-5
    assert set(tp_group[0][1]) == set(ref)
    for name, (ref_p, ref_g, ref_meta) in ref.items():
        meta = tp_group[0][1][name][2]
        full_p = unshard_tensors([r[1][name][0] for r in tp_group], meta)
        full_g = unshard_tensors([r[1][name][1] for r in tp_group], meta)
        assert torch.equal(full_p, unshard_tensors([ref_p], ref_meta)), name
        want = unshard_tensors([ref_g], ref_meta)
        assert rel(full_g, want) <= 1e-5, (name, rel(full_g, want))


# ---- the training loop over 10 iterations -------------------------------------------------
LOOP = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8",
        "--group-query-attention", "--num-query-groups", "4", "--seq-length", "64",
        "--mock-data", "--vocab-size", "100", "--lr", "3e-3", "--train-iters", "10",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--eval-iters", "1", "--lr-warmup-iters", "1"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
A2A = ["--cp-comm-type", "a2a"]
LOOP_CASES = {
    "cp4-p2p": CP4,
    "cp4-a2a": CP4 + A2A,
    "cp2-dp2-p2p-distopt": CP2 + ["--use-distributed-optimizer"],
    "cp2-dp2-a2a-full-recompute": CP2 + A2A + [
        "--recompute-granularity", "full", "--recompute-method", "uniform"],
    "cp2-tp2-sp-p2p-core-attn-recompute": CP2 + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    "cp2-tp2-sp-a2a": CP2 + A2A + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "cp2-pp2-1f1b-p2p": CP2 + ["--pipeline-model-parallel-size", "2"],
    "cp2-pp2-interleaved-a2a": CP2 + A2A + ["--pipeline-model-parallel-size", "2",
                                           "--num-virtual-stages-per-pipeline-rank", "2"],
    "cp2-pp2-zero-bubble-p2p": CP2 + ["--pipeline-model-parallel-size", "2",
                                      "--pipeline-schedule", "zero-bubble"],
}


def _train(cases, iters=10):
    from cpu_trainer import build_cpu_trainer

    out = {}
    for name, (world, argv) in cases.items():
        trainer = build_cpu_trainer([*LOOP, *argv], world)
        it = trainer.data_iterator(trainer.train_ds, 0)
        rows = [trainer.train_step(it) for _ in range(iters)]
        out[name] = dict(writer=trainer.is_writer or world == 1,
                         loss=[r["lm_loss"] for r in rows], norm=[r["grad_norm"] for r in rows],
                         valid=trainer.evaluate(trainer.valid_ds, 1))
    return out


@pytest.fixture(scope="module")
def loop_results(dist):
    cases = {"ref": (1, [])}
    cases.update({name: (WORLD, argv) for name, argv in LOOP_CASES.items()})
    return dist.run(WORLD, _train, cases)


@pytest.mark.parametrize("name", list(LOOP_CASES))
def test_training_loop_matches_single_process(loop_results, name):
    ref = loop_results[0]["ref"]
    (got,) = [r[name] for r in loop_results if r[name]["writer"]]
    assert len(set(ref["loss"])) == len(ref["loss"])         # the weights move
    assert abs(got["loss"][0] - ref["loss"][0]) <= 1e-5 * ref["loss"][0]
    for a, b in zip(got["loss"], ref["loss"]):
        assert abs(a - b) <= 1e-4 * b, (name, got["loss"], ref["loss"])
    for a, b in zip(got["norm"], ref["norm"]):
        assert abs(a - b) <= 1e-4 * b, (name, got["norm"], ref["norm"])
    assert abs(got["valid"] - ref["valid"]) <= 1e-4 * ref["valid"]


def _saved_bytes(kinds, seq=512):
    """Bytes one forward leaves for backward on this rank (``activation_memory``'s count),
    at CP = 1, 2, 4 for each comm type."""
    from megalite.models.gpt import build_model
    from megalite.models.gpt_step import get_batch
    from megalite.transformer.activation_memory import measure_saved

    rank = torch_dist.get_rank()
    out = {}
    for kind in kinds:
        for cp in (1, 2, 4):
            state = ParallelState.build(RankGrid(WORLD, cp=cp), rank)
            model = build_model(make_model_cfg("llama", seq, kind, cp, world=WORLD), state)
            b = get_batch(raw_batch(seq), state, "cpu")
            seen, _ = measure_saved(lambda: model(b["tokens"], b["position_ids"],
                                                  labels=b["labels"]),
                                    ignore=list(model.parameters()))
            out[kind, cp] = sum(seen.values())
    return out


def test_saved_activations_fall_as_one_over_cp(dist):
    """Ring attention keeps what local attention keeps, for s/CP tokens: exactly 1/CP.
    All-to-all keeps a little less (its attention inputs are fresh buffers of the heads it
    owns, not views of the whole fused qkv output)."""
    results = dist.run(WORLD, _saved_bytes, ("p2p", "a2a"))
    for rank_result in results:
        for cp in (2, 4):
            p2p = rank_result["p2p", cp] / rank_result["p2p", 1]
            a2a = rank_result["a2a", cp] / rank_result["a2a", 1]
            assert abs(p2p * cp - 1) <= 0.01, (cp, p2p)
            assert 0.9 <= a2a * cp <= 1.0, (cp, a2a)


def _straight_and_resumed(argv, path):
    """Four iterations straight, and two + save + load + two (CP ranks hold the same
    weights; the distributed optimizer's shards span dp-cp)."""
    from test_training_dist import resumed_losses

    def make(extra):
        from megalite.cli.arguments import parse_args
        from megalite.training.loop import Trainer

        cfg = parse_args(["--world-size", str(WORLD), *LOOP, *argv, *extra])
        state = ParallelState.build(RankGrid.from_config(cfg), torch_dist.get_rank())
        trainer = Trainer(cfg, state, "cpu")
        trainer.setup()
        return trainer

    trainer = make([])
    it = trainer.data_iterator(trainer.train_ds, 0)
    straight = [trainer.train_step(it)["lm_loss"] for _ in range(4)]
    return straight, resumed_losses(make, [], path)


def test_checkpoint_resume_is_exact_under_cp(dist, tmp_path):
    out = dist.run(WORLD, _straight_and_resumed, CP2 + ["--use-distributed-optimizer"],
                   str(tmp_path / "cp2"))
    for straight, resumed in out:
        assert straight == resumed, (straight, resumed)


# ---- a Hugging Face Llama imported and run under CP -----------------------------------------
def _hf_llama_under_cp(path, layouts, ids):
    """Per-token loss of the imported model at each (CP, comm type), scattered back into
    sequence order and summed over CP: each position comes from the rank that holds it."""
    from megalite.checkpointing import hf
    from megalite.checkpointing.model_io import load_full_state_dict
    from megalite.config import MegaliteConfig, ParallelConfig
    from megalite.models.gpt import build_model
    from megalite.models.gpt_step import get_batch

    model_cfg, full = hf.import_hf(path)
    rank, out = torch_dist.get_rank(), []
    for cp, kind in layouts:
        cfg = MegaliteConfig(model=ModelConfig(**model_cfg), world_size=WORLD,
                             parallel=ParallelConfig(context_parallel_size=cp, cp_comm_type=kind))
        cfg.model.seq_length, cfg.model.attention_dropout = ids.shape[1], 0.0
        state = ParallelState.build(RankGrid(WORLD, cp=cp), rank)
        model = build_model(cfg, state).eval()
        load_full_state_dict(model, full, state)
        b = get_batch({"tokens": ids, "labels": ids.roll(-1, 1),
                       "loss_mask": torch.ones(ids.shape)}, state, "cpu")
        with torch.no_grad():
            local = model(b["tokens"], b["position_ids"], labels=b["labels"])
        loss = torch.zeros(ids.shape)
        loss[:, token_indices(ids.shape[1], cp, state.cp.rank)] = local
        out.append(comm.all_reduce(loss, state.cp))
    return out


def test_hf_llama_positions_right_under_cp(dist, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ref(ids).logits
    want = F.cross_entropy(logits.reshape(-1, 100), ids.roll(-1, 1).reshape(-1),
                           reduction="none").view(ids.shape)
    layouts = [(2, "p2p"), (4, "p2p"), (4, "a2a")]
    for got in dist.run(WORLD, _hf_llama_under_cp, str(tmp_path / "hf"), layouts, ids)[0]:
        assert rel(got, want) <= 1e-5, rel(got, want)
