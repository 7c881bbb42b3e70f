"""Tiny random Hugging Face Qwen2-MoE / Qwen3-MoE models for the interop tests, and the loss
``transformers`` gives on the validation samples a megalite ``--mock-data`` run evaluates.

Three layers, layer 1 dense (``mlp_only_layers``), 4 experts top-2, peaky routers and
non-trivial norms and a wide init, so a wrong mapping or routing rule moves the loss."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, SEED = 100, 16, 1234      # SEED: pretrain_gpt.py's default --seed


def _randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif p.dim() > 1:
                p.normal_(0, 0.15)
            if n.endswith("mlp.gate.weight"):
                p.mul_(10)
    return model


def hf_qwen_moe(path, family="qwen2_moe", seed=0, **over):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                  max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**{**common, "shared_expert_intermediate_size": 24,
                                             "norm_topk_prob": False, "qkv_bias": False,
                                             **over})
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**{**common, "head_dim": 16, "norm_topk_prob": True,
                                             **over})
        model = transformers.Qwen3MoeForCausalLM(cfg)
    model = _randomize(model.eval(), seed)
    model.save_pretrained(path)
    return model


def valid_samples(n):
    """The first ``n`` validation samples of a ``--mock-data`` run (seed ``SEED``)."""
    from megalite.data.gpt_dataset import MockGPTDataset

    ds = MockGPTDataset(n, SEQ, VOCAB, SEED + 1000)     # valid split: seed + 1000
    samples = [ds[i] for i in range(n)]
    return (torch.stack([torch.as_tensor(s["tokens"]) for s in samples]),
            torch.stack([torch.as_tensor(s["labels"]) for s in samples]))


def hf_loss(model, n):
    """Mean token cross entropy of ``model`` over those samples (megalite's eval loss)."""
    tokens, labels = valid_samples(n)
    with torch.no_grad():
        logits = model(tokens).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(),
                                             labels.reshape(-1)).item()


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()
