"""The loss-reduction policy (``transformer/loss_reduction.py``, docs/architecture.md#loss-reduction)
against closed forms, at sizes where the formula is not trivial, on one process:

* several micro-batches with uneven masks: the micro-batch losses add up to the global
  token mean (not the mean of the micro-batch means), and the fp16 loss scale multiplies
  what backward starts from but not what is reported;
* MTP at depths 2 and 3 (where factor / D is not the factor): every depth's term is the
  cross entropy of its own target k + 1 ahead, enters with weight factor / D, and the
  gradients through the family's step are those of the written-out objective, with the
  fp16 scale divided back out;
* the per-sequence MoE aux loss over several sequences against its formula;
* the extra-term share 1 / (M x dp-cp) at M = 3, dp-cp = 4.
The reductions over real groups (DP x CP, PP, TP with SP) are in
tests/distributed/test_loss_reduction_dist.py.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.family import StepContext
from megalite.models.gpt import build_model, single_rank_state
from megalite.models.gpt_step import extra_loss_names, forward_step, loss_func
from megalite.moe.router import AUX_LOSS, TopKRouter
from megalite.optimizer.grad_scaler import unscale_and_find_inf
from megalite.param_spec import ParamTable, group_coords
from megalite.parallel_state import ModelCommGroups
from megalite.tensor_parallel.random import init_parameters
from megalite.transformer import loss_reduction as policy
from megalite.transformer.extra_losses import collect_extra_losses
from megalite.transformer.mtp import mtp_loss_names

VOCAB, SEQ, BATCH, FACTOR = 40, 10, 2, 0.3


def _uneven_masks(gen, count):
    masks = [torch.ones(BATCH, SEQ)]
    for _ in range(count - 1):
        m = (torch.rand(BATCH, SEQ, generator=gen) > 0.6).float()
        m[0, 0] = 1.0
        masks.append(m)
    return masks


def test_micro_batch_losses_add_up_to_the_global_token_mean_and_the_scale_multiplies():
    gen = torch.Generator().manual_seed(0)
    per_token = [torch.rand(BATCH, SEQ, generator=gen) for _ in range(3)]
    masks = _uneven_masks(gen, 3)
    n = policy.global_loss_tokens([{"loss_mask": m} for m in masks], single_rank_state(),
                                  "cpu")
    assert n.item() == sum(m.sum().item() for m in masks)
    sums = [(t * m).sum().item() for t, m in zip(per_token, masks)]
    token_mean = sum(sums) / n.item()
    got = sum(loss_func(m, n, t)[0].item() for t, m in zip(per_token, masks))
    assert got == pytest.approx(token_mean, rel=1e-6)
    mean_of_means = sum(s / m.sum().item() for s, m in zip(sums, masks)) / 3
    assert abs(token_mean - mean_of_means) > 1e-2 * token_mean   # the divisor matters here
    scale = 2.0 ** 12
    loss, report = loss_func(masks[1], n, per_token[1], grad_scale=scale)
    assert loss.item() == pytest.approx(scale * sums[1] / n.item(), rel=1e-6)
    assert report["loss_sum"].item() == pytest.approx(sums[1], rel=1e-6)  # unscaled
    assert policy.reduce_lm_loss([torch.tensor(s) for s in sums], n, single_rank_state(),
                                 "cpu") == pytest.approx(token_mean, rel=1e-12)


def test_extra_term_share_is_one_over_micro_batches_times_dp_cp():
    state = {"dp-cp": SimpleNamespace(size=4)}
    assert policy.extra_term_scale(3, state) == pytest.approx(1 / 12)
    assert policy.extra_term_backward_scale(1 / 12, 256.0) == pytest.approx(256 / 12)


def _mtp_model(depths):
    m = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=SEQ,
                    vocab_size=VOCAB, mtp_num_layers=depths, mtp_loss_scaling_factor=FACTOR,
                    hidden_dropout=0.0, attention_dropout=0.0)
    cfg = MegaliteConfig(model=m)
    torch.manual_seed(0)
    return cfg, build_model(cfg, single_rank_state()).train()


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("depths", [2, 3])
def test_mtp_depths_are_their_own_targets_weighted_factor_over_depths(depths):
    cfg, model = _mtp_model(depths)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.roll(tokens, -1, -1)
    mask = _uneven_masks(gen, 2)[1]
    mask[:, -1] = 0.0
    n = torch.tensor([mask.sum().item() + 7.0], dtype=torch.float64)   # other micro-batches
    batch = dict(tokens=tokens, labels=labels, loss_mask=mask)
    names = extra_loss_names(cfg)
    assert names == mtp_loss_names(cfg.model) and len(names) == depths

    # the written-out objective: lm token sum / N + share * sum_k (factor / D) * mtp_k
    hidden = []
    hook = model.mtp.register_forward_hook(lambda _m, _a, out: hidden.extend(out))
    with collect_extra_losses(names) as extra:
        per_token = model(tokens, labels=labels, loss_mask=mask)
    hook.remove()
    assert extra.weights == [pytest.approx(FACTOR / depths)] * depths
    weight = model.shared_embedding_weight()
    if weight is None:
        weight = model.output_layer.weight
    target, tmask = labels, mask
    for k, ((name, term), h) in enumerate(zip(extra.terms, hidden), start=1):
        target, tmask = torch.roll(target, -1, -1), torch.roll(tmask, -1, -1)
        tmask[:, -1] = 0.0          # depth k: the last k positions have no target
        logits = (h.transpose(0, 1) @ weight[:VOCAB].t()).float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
        expected = (ce * tmask.reshape(-1)).sum() / tmask.sum()
        assert name == f"mtp_{k}_loss"
        assert term.item() == pytest.approx(expected.item(), rel=1e-5)
    share = 1.0 / 3                                  # e.g. 3 micro-batches, one dp-cp rank
    objective = (per_token * mask).sum() / n.item() + share * sum(
        FACTOR / depths * term for _, term in extra.terms)
    model.zero_grad()
    objective.backward()
    reference = _grads(model)

    # the family's step with the fp16 loss scale: the same gradients once it is divided out
    scale = 64.0
    model.zero_grad()
    ctx = StepContext(num_loss_tokens=n, extra_loss_names=names, extra_loss_scale=share,
                      grad_scale=scale)
    output, lf = forward_step(batch, model, ctx)
    loss, _ = lf(output)
    loss.backward()
    got = _grads(model)
    assert not unscale_and_find_inf(got, 1.0 / scale).item()
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)
    logged = [ctx.extra_loss_sums[i].item() for i in range(depths)]   # unweighted terms
    assert logged == pytest.approx([t.item() for _, t in extra.terms], rel=1e-6)


def test_per_sequence_aux_loss_is_the_mean_over_sequences_of_their_switch_terms():
    E, K, H, S, B, coeff = 4, 2, 8, 5, 3, 2e-2
    m = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=S,
                    vocab_size=50, num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=6,
                    moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="seq_aux_loss")
    state = single_rank_state()
    router = TopKRouter(m, ModelCommGroups.from_parallel_state(state), sequence_parallel=False,
                        layer_number=0)
    init_parameters(ParamTable.from_module(router).named(router), 7, group_coords(state))
    x = torch.randn(S * B, H, generator=torch.Generator().manual_seed(2))   # [s, b] flattened
    with collect_extra_losses((AUX_LOSS,)) as extra:
        _, idx, _ = router(x, B)
    probs = torch.softmax(x @ router.weight.t(), -1)
    expected = 0.0
    for j in range(B):                      # sequence j: tokens j, j + B, j + 2B, ...
        counts = torch.bincount(idx[j::B].reshape(-1), minlength=E).float()
        expected += (probs[j::B].sum(0) * counts).sum() * E * coeff / (K * S * S)
    (name, aux), = extra.terms
    assert name == AUX_LOSS
    assert aux.item() == pytest.approx(expected.item() / B, rel=1e-5)
