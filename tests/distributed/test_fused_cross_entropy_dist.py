"""The fused output layer + loss under TP2, TP2+SP and TP4+SP equals the single process.

Workers build the Llama-style and the tied GPT-2-style model with
``--cross-entropy-loss-fusion`` (chunks of 5 tokens, which do not divide the 16 tokens), run
a masked-mean loss step (the path that forms the gradients in forward) and a plain
``mean`` step (no mask given, also the forward path) and send back the per-token loss and
their gradient shards.  The parent compares them, unsharded, with the UNFUSED single-process
model: fp32, relative error <= 1e-5.  Vocabulary 70 pads to 96 at TP2 and 128 at TP4,
where rank 3 holds only padding (no valid column: its local log-sum-exp is -inf).
"""
import pytest
import torch
import torch.distributed as torch_dist

from megalite.checkpointing.sharding import unshard_tensors
from megalite.models.gpt import build_model, single_rank_state
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel import allreduce_sequence_parallel_grads
from tests.distributed.test_tp_equivalence import (ARCHS, BATCH, SEQ, VOCAB, WORLD, batch,
                                                   make_cfg, model_cfg, rel)

RTOL = 1e-5
CASES = [(arch, tp, sp) for arch in ("llama-g4", "gpt2")
         for tp, sp in ((2, False), (2, True), (4, True))]


def loss_mask():
    mask = torch.ones(BATCH, SEQ)
    mask[0, -3:] = 0
    mask[1, :2] = 0
    return mask


def step(model, ids, labels, mask, state=None):
    """Per-token loss and the parameters' gradient shards after one backward."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels, loss_mask=mask)
    total = loss.mean() if mask is None else (loss * mask).sum() / mask.sum()
    total.backward()
    if state is not None:
        allreduce_sequence_parallel_grads(model, state)
    grads = {n: (p.grad.detach().clone(), spec.to_meta_dict())
             for n, p, spec in model.param_table.named(model)}
    return loss.detach().clone(), grads


def fusion_cfg(arch, tp=1, sp=False, world=1, fused=True):
    mcfg = dict(model_cfg(*ARCHS[arch]), cross_entropy_loss_fusion=fused,
                cross_entropy_chunk_tokens=5)
    return make_cfg(mcfg, tp, sp, world=world)


def _fused_layouts(cases):
    rank = torch_dist.get_rank()
    ids, labels = batch()
    out = []
    for arch, tp, sp in cases:
        state = ParallelState.build(RankGrid(WORLD, tp=tp), rank)
        model = build_model(fusion_cfg(arch, tp, sp, world=WORLD), state)
        assert model.fused_loss
        out.append((step(model, ids, labels, loss_mask(), state),
                    step(model, ids, labels, None, state)))
    return out


@pytest.fixture(scope="module")
def fused_results(dist):
    return dist.run(WORLD, _fused_layouts, CASES)


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{a}-tp{t}-{'sp' if s else 'nosp'}" for a, t, s in CASES])
def test_fused_tp_matches_unfused_single_process(fused_results, case):
    arch, tp, sp = CASES[case]
    ids, labels = batch()
    ref_model = build_model(fusion_cfg(arch, fused=False), single_rank_state())
    assert not ref_model.fused_loss
    refs = (step(ref_model, ids, labels, loss_mask()), step(ref_model, ids, labels, None))
    per_rank = [r[case] for r in fused_results[:tp]]
    for which, (ref_loss, ref_grads) in enumerate(refs):
        for r in per_rank:
            assert rel(r[which][0], ref_loss) <= RTOL
        for name, (ref_g, ref_meta) in ref_grads.items():
            meta = per_rank[0][which][1][name][1]
            full = unshard_tensors([r[which][1][name][0] for r in per_rank], meta)
            want = unshard_tensors([ref_g], ref_meta)
            assert rel(full, want) <= RTOL, (which, name, rel(full, want))
            if meta["pad_multiple"]:
                for tp_rank, r in enumerate(per_rank):
                    g = r[which][1][name][0]
                    assert (g[max(0, VOCAB - tp_rank * g.shape[0]):] == 0).all()
