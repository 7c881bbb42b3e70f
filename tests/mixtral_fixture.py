"""A tiny random Hugging Face Mixtral shared by the single-process and EP=2 interop tests."""
import pytest
import torch

transformers = pytest.importorskip("transformers")


def hf_mixtral(path, seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():   # non-trivial norms and a peaky router, so a bad mapping shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            if n.endswith("gate.weight"):
                p.mul_(20)
    model.save_pretrained(path)
    return model


IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()
