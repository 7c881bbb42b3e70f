"""gpt-oss's MoE layer (--moe-expert-bias): a trained router bias and per-expert fc1 / fc2
biases, each row taking its expert's bias (transformers' GptOssExperts formula, with the
clamped quick-GeGLU of --glu-linear-offset 1 --activation-func-clamp-value); the biases are
AdamW's under Muon and have no weight decay.  The layouts (TP2+SP, EP2, PP2) are held to
the single process in tests/distributed/test_attention_sinks_dist.py."""
import torch

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_chunk, single_rank_state
from megalite.optimizer.muon import is_muon_param
from megalite.optimizer.optimizer import uses_weight_decay


def _layer():
    m = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                    vocab_size=64, make_vocab_size_divisible_by=16, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=8, moe_expert_bias=True,
                    quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5,
                    hidden_dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=0.0)
    torch.manual_seed(0)
    chunk = build_chunk(MegaliteConfig(model=m), single_rank_state(), pre_process=False,
                        post_process=False, layer_numbers=[0])
    mlp = chunk.get_submodule("decoder.layers.0.mlp")
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.5)
    return mlp


def test_biased_experts_are_gpt_oss_formula():
    mlp = _layer()
    x = torch.randn(6, 1, 16)
    out = mlp(x)
    out = out[0] if isinstance(out, tuple) else out
    tokens = x.reshape(-1, 16)
    logits = tokens @ mlp.router.weight.t() + mlp.router.bias
    top, idx = logits.topk(2, dim=-1)
    weights = torch.softmax(top, dim=-1)
    fc1, b1 = mlp.experts.linear_fc1.weight, mlp.experts.linear_fc1.bias
    fc2, b2 = mlp.experts.linear_fc2.weight, mlp.experts.linear_fc2.bias
    ref = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(2):
            e = idx[t, j]
            gate, up = (tokens[t] @ fc1[e].t() + b1[e]).chunk(2)
            gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
            h = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
            ref[t] += weights[t, j] * (h @ fc2[e].t() + b2[e])
    torch.testing.assert_close(out.reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    for p in (mlp.router.bias, b1, b2):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_biases_are_adamws_without_decay():
    mlp = _layer()
    for name, p in mlp.named_parameters():
        if name.endswith("bias"):
            assert not is_muon_param("decoder.layers.0.mlp." + name, p.dim()), name
            assert not uses_weight_decay(name, p), name
    assert mlp.experts.linear_fc1.bias.shape == (4, 16)
    assert mlp.experts.linear_fc2.bias.shape == (4, 16)
    assert mlp.router.bias.shape == (4,)
