"""Every MLP activation of the registry (megalite/config/activations.py), through the
dense MLP the model builds, against its closed form and against transformers' function for
its Hugging Face ``hidden_act`` name (a gated entry as HF's gated MLPs: act(gate) * up)."""
import math

import pytest
import torch
import torch.nn.functional as F

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_chunk, single_rank_state
from megalite.config.activations import ACTIVATIONS, activation_for_hf

# The formula of each entry on fc1's output y (a gated entry's y is [gate; up]).
CLOSED_FORM = {
    "gelu": lambda y: 0.5 * y * (1 + torch.erf(y / math.sqrt(2))),
    "swiglu": lambda y: (lambda g, u: g / (1 + torch.exp(-g)) * u)(*y.chunk(2, dim=-1)),
    "squared-relu": lambda y: torch.where(y > 0, y * y, torch.zeros_like(y)),
    "geglu": lambda y: (lambda g, u: 0.5 * g * (1 + torch.tanh(
        math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u)(*y.chunk(2, dim=-1)),
    # gpt-oss (knobs at their defaults: no offset, no clamp)
    "quick-geglu": lambda y: (lambda g, u: g / (1 + torch.exp(-1.702 * g)) * u)(
        *y.chunk(2, dim=-1)),
}


def _mlp(name):
    m = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=64, make_vocab_size_divisible_by=16, ffn_hidden_size=48,
                    activation=name, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    chunk = build_chunk(MegaliteConfig(model=m), single_rank_state(), pre_process=False,
                        post_process=False, layer_numbers=[0])
    return chunk.get_submodule("decoder.layers.0.mlp")


def test_every_entry_has_a_closed_form():
    assert set(CLOSED_FORM) == set(ACTIVATIONS)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_mlp_is_the_closed_form(name):
    mlp = _mlp(name)
    x = torch.randn(8, 2, 32, dtype=torch.float32)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    assert fc1.weight.shape[0] == ACTIVATIONS[name].fc1_blocks * 48
    y = F.linear(x, fc1.weight, fc1.bias)
    ref = F.linear(CLOSED_FORM[name](y), fc2.weight, fc2.bias)
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_entry_is_transformers_activation(name):
    ACT2FN = pytest.importorskip("transformers.activations").ACT2FN
    a = ACTIVATIONS[name]
    hf = a.hf_names[0]
    assert activation_for_hf(hf) is a
    y = torch.randn(4, 2 * 48, dtype=torch.float64) * 3
    if a.gated:
        gate, up = y.chunk(2, dim=-1)
        ref = ACT2FN[hf](gate) * up
    else:
        ref = ACT2FN[hf](y)
    torch.testing.assert_close(a.fn(y), ref, rtol=1e-12, atol=1e-12)
