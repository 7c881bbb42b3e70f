"""The loss-reduction policy over real groups (4 gloo ranks, one launch), each against a
closed form computed on every rank from the whole global batch:

* DP2 x CP2, 3 micro-batches with uneven masks, CP slicing by ``get_batch``: the global
  token count, the logged loss (the global token mean), and the gradients of a replicated
  parameter after the data-parallel sum -- with and without the fp16 loss scale -- equal
  the single-process ones; the extra-term share is 1 / (M x DP x CP);
* PP2 x DP2: the extra terms are summed over dp-cp and pp, times 1 / (M x DP);
* the MoE router with its tokens split over TP (sequence parallel) or CP: aux and z
  losses equal the formula over the whole tokens, and the router's gradient after the
  strategy's reductions equals the whole-token gradient; the logged per-layer statistics
  are the global batch's (the counts not CP times too large).
"""
import pytest
import torch
import torch.distributed as torch_dist

from megalite.config import ModelConfig
from megalite.distributed.grad_sync import finalize_gradients
from megalite.models.gpt_step import get_batch, loss_func
from megalite.moe.router import AUX_LOSS, Z_LOSS, TopKRouter
from megalite.param_spec import ParamSpec, ParamTable, group_coords
from megalite.parallel_state import ModelCommGroups, ParallelState, RankGrid
from megalite.tensor_parallel.random import init_parameters
from megalite.transformer import loss_reduction as policy
from megalite.transformer.extra_losses import collect_extra_losses

WORLD, VOCAB, SEQ, MB, M = 4, 11, 8, 2, 3
E, K, H, COEFF, ZCOEFF = 4, 2, 8, 1e-2, 1e-3


def _state(**dims):
    grid = RankGrid(WORLD, **dims)
    return ParallelState.build(grid, torch_dist.get_rank(), create_groups=True)


def _global_batch(dp):
    """dp x M micro-batches [MB, SEQ], the same on every rank; uneven masks."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(dp * M):
        tokens = torch.randint(0, VOCAB, (MB, SEQ), generator=gen)
        mask = (torch.rand(MB, SEQ, generator=gen) > 0.5).float()
        mask[0, 0] = 1.0
        out.append(dict(tokens=tokens, labels=torch.roll(tokens, -1, -1), loss_mask=mask))
    return out


def _per_token(w, b):
    return (w[b["tokens"]] - 0.5 * w[b["labels"]]) ** 2


def _token_mean_checks():
    state = _state(cp=2)
    dp, cp = state.dp.size, state.cp.size
    raw = _global_batch(dp)
    w0 = torch.linspace(-1.0, 2.0, VOCAB, dtype=torch.float32)
    ref_w = w0.clone().requires_grad_(True)
    n_all = sum(b["loss_mask"].sum() for b in raw)
    ref = sum((_per_token(ref_w, b) * b["loss_mask"]).sum() for b in raw) / n_all
    ref.backward()
    mine = [get_batch(b, state, "cpu") for b in raw[state.dp.rank * M:(state.dp.rank + 1) * M]]
    n = policy.global_loss_tokens(mine, state, "cpu")
    out = dict(n=(n.item(), n_all.item()), share=(policy.extra_term_scale(M, state),
                                                  1.0 / (M * dp * cp)))
    for scale in (1.0, 16.0):
        w = torch.nn.Parameter(w0.clone())
        sums = []
        for b in mine:
            loss, report = loss_func(b["loss_mask"], n, _per_token(w, b), grad_scale=scale)
            loss.backward()
            sums.append(report["loss_sum"])
        finalize_gradients([w], lambda p: p.grad, state, specs=[ParamSpec((VOCAB,))])
        out[f"loss@{scale}"] = (policy.reduce_lm_loss(sums, n, state, "cpu"), ref.item())
        out[f"grad@{scale}"] = ((w.grad / scale).tolist(), ref_w.grad.tolist())
    r = torch_dist.get_rank()
    terms = policy.reduce_extra_terms(torch.tensor([r + 1.0, 10.0 * (r + 1)], dtype=torch.float64),
                                      ("a", "b"), policy.extra_term_scale(M, state), state)
    out["extra_dp_cp"] = ([terms["a"], terms["b"]], [10.0 / (M * 4), 100.0 / (M * 4)])
    return out


def _pp_checks():
    state = _state(pp=2)
    r = torch_dist.get_rank()
    terms = policy.reduce_extra_terms(torch.tensor([r + 1.0], dtype=torch.float64), ("a",),
                                      policy.extra_term_scale(M, state), state)
    return {"extra_pp": ([terms["a"]], [10.0 / (M * state.dp.size)])}


def _router_cfg():
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=SEQ,
                       vocab_size=50, num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=6,
                       moe_aux_loss_coeff=COEFF, moe_z_loss_coeff=ZCOEFF)


def _router(state, sp):
    router = TopKRouter(_router_cfg(), ModelCommGroups.from_parallel_state(state),
                        sequence_parallel=sp, layer_number=0)
    init_parameters(ParamTable.from_module(router).named(router), 5, group_coords(state))
    return router


def _router_checks(name, dims, sp):
    """Tokens [SEQ, MB] of one micro-batch, the same on every DP replica; each rank of the
    split group (TP with SP, or CP) routes its part of the sequence."""
    state = _state(**dims)
    x = torch.randn(SEQ, MB, H, generator=torch.Generator().manual_seed(4))
    split = state.tp if sp else state.cp
    part = SEQ // split.size
    local = x[split.rank * part:(split.rank + 1) * part].reshape(-1, H)
    router = _router(state, sp)
    with collect_extra_losses((AUX_LOSS, Z_LOSS)) as extra:
        router(local, MB)
    terms = dict(extra.terms)
    share = policy.extra_term_scale(1, state)
    (share * (terms[AUX_LOSS] + terms[Z_LOSS])).backward()
    table = ParamTable.from_module(router)
    params = [p for _, p, _ in table.named(router)]
    specs = [s for _, _, s in table.named(router)]
    finalize_gradients(params, lambda p: p.grad, state, specs=specs)
    # the closed form over the whole tokens, on one process
    full = x.reshape(-1, H)
    w = router.weight.detach().clone().requires_grad_(True)
    logits = full @ w.t()
    idx = torch.topk(logits, K).indices
    counts = torch.bincount(idx.reshape(-1), minlength=E).float()
    n = full.shape[0]
    aux = (torch.softmax(logits, -1).sum(0) * counts).sum() * E * COEFF / (K * n * n)
    z = torch.logsumexp(logits, -1).square().mean() * ZCOEFF
    (aux + z).backward()
    stats = router.last_stats
    table_row = torch.zeros(1, E + 3, dtype=torch.float64)
    table_row[0, :E] = stats["counts"]
    table_row[0, E:] = torch.tensor([float(stats["aux_loss"]), float(stats["z_loss"]), 1.0])
    policy.reduce_moe_step_table(table_row, E, state)
    dp_cp = state["dp-cp"].size
    return {f"{name}_aux": ([terms[AUX_LOSS].item()], [aux.item()]),
            f"{name}_z": ([terms[Z_LOSS].item()], [z.item()]),
            f"{name}_grad": (router.weight.grad.reshape(-1).tolist(), w.grad.reshape(-1).tolist()),
            f"{name}_counts": (table_row[0, :E].tolist(), (counts * dp_cp / state.cp.size).tolist()),
            f"{name}_aux_sum": ([table_row[0, E].item()], [aux.item() * dp_cp]),
            f"{name}_mbs": ([table_row[0, E + 2].item()], [float(dp_cp)])}


def _run():
    out = _token_mean_checks()
    out.update(_pp_checks())
    out.update(_router_checks("tp2_sp", dict(tp=2), sp=True))
    out.update(_router_checks("cp2", dict(cp=2), sp=False))
    return out


@pytest.fixture(scope="module")
def runs(dist):
    return dist.run(WORLD, _run)


def _close(got, want, rel):
    got, want = list(got), list(want)
    return len(got) == len(want) and all(
        abs(g - w) <= rel * max(abs(w), 1e-6) for g, w in zip(got, want))


def test_global_token_count_and_extra_share_at_dp2_cp2(runs):
    for r in runs:
        assert r["n"][0] == r["n"][1]
        assert r["share"][0] == pytest.approx(r["share"][1]) == pytest.approx(1 / 12)


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_logged_loss_and_gradients_are_the_global_token_means_at_dp2_cp2(runs, scale):
    for r in runs:
        got, want = r[f"loss@{scale}"]
        assert got == pytest.approx(want, rel=1e-6)
        assert _close(*r[f"grad@{scale}"], 1e-5), r[f"grad@{scale}"]


@pytest.mark.parametrize("key", ["extra_dp_cp", "extra_pp"])
def test_extra_terms_are_summed_over_dp_cp_and_pp_times_their_share(runs, key):
    for r in runs:
        assert _close(*r[key], 1e-12), r[key]


@pytest.mark.parametrize("split", ["tp2_sp", "cp2"])
@pytest.mark.parametrize("what", ["aux", "z", "grad", "counts", "aux_sum", "mbs"])
def test_router_terms_over_the_tokens_ranks_equal_the_whole_tokens_formula(runs, split, what):
    for r in runs:
        assert _close(*r[f"{split}_{what}"], 1e-5), r[f"{split}_{what}"]
