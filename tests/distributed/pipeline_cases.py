"""Shared helpers for the pipeline tests: tiny configs, batches, a loop-like forward step,
one pipelined step on a rank, and the single-process reference."""
import torch

from megalite import comm
from megalite.checkpointing.sharding import unshard_tensors
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.distributed.grad_sync import finalize_gradients
from megalite.models.gpt import build_model, single_rank_state
from megalite.param_spec import named_specs
from megalite.parallel_state import ParallelState, RankGrid
from megalite.pipeline_parallel.schedules import get_forward_backward_func, run_schedule
from megalite.models.stages import build_model_chunks

VOCAB, SEQ, MBS = 70, 8, 2


def model_kwargs(arch="gpt2", layers=4):
    common = dict(num_layers=layers, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                  vocab_size=VOCAB, make_vocab_size_divisible_by=16, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.05)
    if arch == "llama":
        common.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                      ffn_hidden_size=48, add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, group_query_attention=True,
                      num_query_groups=2)
    else:
        common.update(ffn_hidden_size=64, max_position_embeddings=SEQ)
    return common


def make_cfg(case: dict, world: int = 1) -> MegaliteConfig:
    """case: arch, layers, tp, pp, vpp, sp, schedule, m (micro-batches per DP rank),
    recompute (granularity, method, num_layers, modules), first/last (uneven split),
    emb/loss (--account-for-embedding/loss-in-pipeline-split), layout
    (--pipeline-model-parallel-layout)."""
    par = ParallelConfig(tensor_model_parallel_size=case.get("tp", 1),
                         pipeline_model_parallel_size=case.get("pp", 1),
                         sequence_parallel=case.get("sp", False),
                         pipeline_schedule=case.get("schedule", "auto"),
                         num_virtual_stages_per_pipeline_rank=case.get("vpp"),
                         pipeline_model_parallel_layout=case.get("layout"),
                         decoder_first_pipeline_num_layers=case.get("first"),
                         decoder_last_pipeline_num_layers=case.get("last"),
                         account_for_embedding_in_pipeline_split=case.get("emb", False),
                         account_for_loss_in_pipeline_split=case.get("loss", False))
    cfg = MegaliteConfig(model=ModelConfig(**model_kwargs(case.get("arch", "gpt2"),
                                                          case.get("layers", 4))),
                         parallel=par, world_size=world)
    dp = par.data_parallel_size(world) if world > 1 else 1
    cfg.training.micro_batch_size = MBS
    cfg.training.global_batch_size = MBS * case.get("m", 4) * dp
    rc = case.get("recompute")
    if rc:
        t = cfg.training
        t.recompute_granularity, t.recompute_method = rc[0], rc[1]
        t.recompute_num_layers = rc[2]
        if rc[3]:
            t.recompute_modules = list(rc[3])
    return cfg


def global_batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        mask = (torch.rand(MBS, SEQ, generator=g) > 0.2).float()
        out.append({"tokens": tokens, "labels": labels, "loss_mask": mask})
    return out


def make_forward_step(denom):
    """The training loop's forward step: masked per-token loss over the global tokens."""
    def forward_step(batch, model):
        output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"])

        def loss_func(per_token):
            total = (per_token.float() * batch["loss_mask"]).sum()
            return total / denom, {"loss_sum": total.detach()}
        return output, loss_func
    return forward_step


def grad_of(p):
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def grads_by_name(chunks):
    out = {}
    for chunk in chunks:
        for name, p, spec in chunk.param_table.named(chunk):
            key = name + ("#copy" if spec.tied == "copy" else "")
            out[key] = (p.detach().clone(), grad_of(p).detach().clone(), spec.to_meta_dict())
    return out


def run_case_on_rank(case: dict, rank: int, world: int, stats: bool = False):
    """One pipelined forward/backward on this rank; returns loss (last stage), grads."""
    cfg = make_cfg(case, world)
    p = cfg.parallel
    grid = RankGrid(world, tp=p.tp, pp=p.pp, vpp=p.virtual_stages(cfg.model.num_layers))
    state = ParallelState.build(grid, rank)
    torch.manual_seed(cfg.training.seed)
    chunks = build_model_chunks(cfg, state)
    m = cfg.num_micro_batches
    batches = global_batches(m * state.dp.size)
    denom = sum(b["loss_mask"].sum() for b in batches)
    mine = batches[state.dp.rank * m:(state.dp.rank + 1) * m]
    fwd = make_forward_step(denom)
    if stats:
        from megalite.pipeline_parallel.schedules import pipeline_schedule_name

        ex = run_schedule(pipeline_schedule_name(cfg, state), fwd, mine, chunks, state, cfg)
        reports, peak = ex.reports, ex.max_in_flight
    else:
        reports = get_forward_backward_func(cfg, state)(fwd, mine, chunks, state, cfg)
        peak = None
    triples = named_specs(chunks)
    finalize_gradients([q for _, q, _ in triples], grad_of, state,
                       specs=[spec for _, _, spec in triples])
    loss = torch.zeros(1, dtype=torch.float64)
    for r in reports:
        loss += r["loss_sum"].double()
    comm.all_reduce(loss, state["dp-cp"])
    return {"loss": (loss / denom).item(), "grads": grads_by_name(chunks),
            "last": state.is_last_stage(ignore_virtual=True), "pp": state.pp.rank,
            "tp": state.tp.rank, "dp": state.dp.rank, "reports": len(reports), "peak": peak}


def reference(case: dict):
    """Single process, same seed, the whole global batch: loss and grads by name."""
    cfg = make_cfg({k: v for k, v in case.items() if k != "recompute"})
    dp = case.get("world", 1) // (case.get("tp", 1) * case.get("pp", 1))
    m = case.get("m", 4) * dp
    torch.manual_seed(cfg.training.seed)
    model = build_model(cfg, single_rank_state())
    batches = global_batches(m)
    denom = sum(b["loss_mask"].sum() for b in batches)
    total = 0.0
    for b in batches:
        out = model(b["tokens"], labels=b["labels"])
        loss = (out.float() * b["loss_mask"]).sum()
        (loss / denom).backward()
        total += loss.item()
    return total / denom.item(), grads_by_name([model])


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def compare(results, case, rtol=1e-5):
    """Unshard TP, check every parameter's grad against the reference; returns max rel."""
    ref_loss, ref = reference(case)
    worst = 0.0
    for r in results:
        if r["last"]:
            assert abs(r["loss"] - ref_loss) <= rtol * abs(ref_loss), (case, r["loss"], ref_loss)
        else:
            assert r["reports"] == 0, "only the last stage returns reports"
    seen = set()
    tp = case.get("tp", 1)
    by_stage = {}
    for r in results:
        if r["dp"] == 0:
            by_stage.setdefault(r["pp"], {})[r["tp"]] = r["grads"]
    for stage in by_stage.values():
        shards = [stage[t] for t in range(tp)]
        for name in shards[0]:
            base = name.split("#")[0]
            meta = shards[0][name][2]
            full_p = unshard_tensors([s[name][0] for s in shards], meta)
            full_g = unshard_tensors([s[name][1] for s in shards], meta)
            want_p = unshard_tensors([ref[base][0]], ref[base][2])
            want_g = unshard_tensors([ref[base][1]], ref[base][2])
            assert torch.equal(full_p, want_p), f"{case}: {name} init differs"
            err = rel(full_g, want_g)
            worst = max(worst, err)
            assert err <= rtol, (case, name, err)
            seen.add(base)
    assert seen == set(ref), (case, set(ref) - seen)
    return worst
