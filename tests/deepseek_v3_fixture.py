"""A tiny random Hugging Face DeepSeek-V3 with its MTP module, as the released checkpoints
lay it out (``model.layers.{L}.*``), for the import/export and layout tests.

Everything DeepSeek-V3 has is switched on and made to matter: MLA with q and kv latents
and their norms, YaRN (x4 over an 8-token original context), interleaved rope rows, the
first layer dense, MoE layers with a shared expert, a sigmoid router with a non-zero
``e_score_correction_bias``, 2 groups (top-1 group) and ``routed_scaling_factor`` 2.5; norms
drawn away from 1 so that a swapped mapping would show.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 100, 3


def hf_config(**kw):
    d = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
             kv_lora_rank=12, q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=6,
             qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2,
             first_k_dense_replace=1, max_position_embeddings=32, num_nextn_predict_layers=1,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 8, "beta_fast": 32,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    d.update(kw)
    return transformers.DeepseekV3Config(**d)


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "norm" in n:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        for n, b in module.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_((torch.rand(b.shape, generator=g) - 0.5) / 10)


def hf_deepseek_v3(path, seed=0, mtp=True):
    """(DeepseekV3ForCausalLM, transformers' MtpModel or None), saved to ``path`` with the
    MTP module's weights as ``model.layers.{LAYERS}.*`` (DeepSeek's release layout)."""
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    ref = transformers.DeepseekV3ForCausalLM(hf_config()).eval()
    _randomize(ref, seed + 1)
    ref.save_pretrained(path)
    if not mtp:
        return ref, None
    head = MtpModel(ref, 1).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 2)
        for n, p in head.named_parameters():
            if n.startswith("layers.") and "norm" not in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    _randomize(head, seed + 3)
    sd = load_file(f"{path}/model.safetensors")
    for n, t in head.state_dict().items():
        if n.startswith("layers.0."):
            rest = n[len("layers.0."):].replace("mtp_block.", "").replace(
                "post_norm.", "shared_head.norm.")
            sd[f"model.layers.{LAYERS}.{rest}"] = t.clone().contiguous()
    save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    return ref, head


@torch.no_grad()
def hf_mtp_logits(ref, head, ids):
    """transformers' depth-1 MTP logits [b, s, V]: position i sees Emb(t_{i+1}) (the main
    model's inputs shifted by one) and predicts t_{i+2}."""
    h = ref(ids, output_hidden_states=True).hidden_states[-1]
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    out = head.forward_layer(0, h, pos, None, input_ids=torch.roll(ids, -1, dims=-1))
    return head._project_to_logits(out)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()
