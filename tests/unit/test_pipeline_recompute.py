"""Activation recomputation: Megatron's methods, same grads, dropout masks reproduced."""
import copy

import pytest
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.transformer.recompute import probe_checkpoint_inputs, selective_targets

RECOMPUTES = [("full", "uniform", 1, None), ("full", "uniform", 3, None),
              ("full", "block", 2, None), ("selective", None, 1, ["core_attn"]),
              ("selective", None, 1, ["mlp"]), ("selective", None, 1, ["layernorm"]),
              ("selective", None, 1, ["core_attn", "mlp", "layernorm"])]


def _cfg(rc=None, dropout=0.0, arch="gpt2"):
    m = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=50,
             make_vocab_size_divisible_by=16, hidden_dropout=dropout, attention_dropout=dropout)
    if arch == "llama":
        m.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False)
    cfg = MegaliteConfig(model=ModelConfig(**m))
    if rc:
        t = cfg.training
        t.recompute_granularity, t.recompute_method, t.recompute_num_layers = rc[:3]
        if rc[3]:
            t.recompute_modules = rc[3]
    return cfg


def _grads(cfg, seed=7):
    torch.manual_seed(1)
    model = build_model(cfg, single_rank_state())
    model.train()
    ids, labels = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    torch.manual_seed(seed)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("rc", RECOMPUTES, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}-{r[3]}")
def test_recompute_same_loss_and_grads(arch, dropout, rc):
    """With dropout on this only holds if recomputation redraws the very same masks
    (default generator for hidden dropout, the TP tracker for attention dropout)."""
    loss0, g0 = _grads(_cfg(None, dropout, arch))
    loss1, g1 = _grads(_cfg(rc, dropout, arch))
    assert torch.equal(loss0, loss1)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)


def _checkpoint_regions(cfg):
    model = build_model(cfg, single_rank_state())
    regions = []
    with probe_checkpoint_inputs(lambda ts: regions.append([tuple(t.shape) for t in ts])):
        model(torch.randint(0, 50, (2, 8)), labels=torch.randint(0, 50, (2, 8))).sum()
    return regions


def test_methods_follow_megatron():
    assert len(_checkpoint_regions(_cfg(("full", "uniform", 1, None)))) == 4
    assert len(_checkpoint_regions(_cfg(("full", "uniform", 3, None)))) == 2   # 3 + 1
    assert len(_checkpoint_regions(_cfg(("full", "block", 2, None)))) == 2     # first two
    assert len(_checkpoint_regions(_cfg(("selective", None, 1, ["layernorm"])))) == 8
    assert len(_checkpoint_regions(_cfg(("selective", None, 1, ["core_attn"])))) == 4
    with torch.no_grad():  # evaluation never checkpoints
        model = build_model(_cfg(("full", "uniform", 1, None)), single_rank_state())
        regions = []
        with probe_checkpoint_inputs(regions.append):
            model(torch.randint(0, 50, (2, 8)))
        assert regions == []


def test_bad_module_and_deepcopy():
    model = build_model(_cfg(("selective", None, 1, ["mlp"])), single_rank_state())
    layer = next(iter(model.decoder.layers.values()))
    with pytest.raises(ValueError, match="unknown"):
        selective_targets(layer, ["attention"])
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    ids = torch.randint(0, 50, (2, 8))
    assert not torch.equal(clone(ids), model(ids))   # the copy runs its own weights
