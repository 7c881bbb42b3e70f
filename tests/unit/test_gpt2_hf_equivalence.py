"""The GPT-2-style model (LayerNorm, learned positions, GeLU, biases, tied embeddings) gives
the same logits and loss as transformers' GPT2LMHeadModel with the same weights."""
import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.models.gpt import build_model, single_rank_state

transformers = pytest.importorskip("transformers")


def _copy_gpt2_into_megalite(hf, model, heads):
    sd = {n: p for n, p in model.canonical_named_parameters()}
    h = hf.config.n_embd
    d = h // heads
    t = hf.transformer
    with torch.no_grad():
        sd["embedding.word_embeddings.weight"][: hf.config.vocab_size].copy_(t.wte.weight)
        sd["embedding.position_embeddings.weight"].copy_(t.wpe.weight)
        for i, block in enumerate(t.h):
            p = f"decoder.layers.{i}."
            sd[p + "input_layernorm.weight"].copy_(block.ln_1.weight)
            sd[p + "input_layernorm.bias"].copy_(block.ln_1.bias)
            w, b = block.attn.c_attn.weight.t(), block.attn.c_attn.bias  # [3h, h]: q | k | v
            q, k, v = w.split(h, 0)
            qb, kb, vb = b.split(h, 0)
            # megalite's fused layout groups rows per head: [q_j, k_j, v_j] for each head j.
            fused = torch.cat([torch.cat([q[j*d:(j+1)*d], k[j*d:(j+1)*d], v[j*d:(j+1)*d]])
                               for j in range(heads)])
            fused_b = torch.cat([torch.cat([qb[j*d:(j+1)*d], kb[j*d:(j+1)*d], vb[j*d:(j+1)*d]])
                                 for j in range(heads)])
            sd[p + "self_attention.linear_qkv.weight"].copy_(fused)
            sd[p + "self_attention.linear_qkv.bias"].copy_(fused_b)
            sd[p + "self_attention.linear_proj.weight"].copy_(block.attn.c_proj.weight.t())
            sd[p + "self_attention.linear_proj.bias"].copy_(block.attn.c_proj.bias)
            sd[p + "pre_mlp_layernorm.weight"].copy_(block.ln_2.weight)
            sd[p + "pre_mlp_layernorm.bias"].copy_(block.ln_2.bias)
            sd[p + "mlp.linear_fc1.weight"].copy_(block.mlp.c_fc.weight.t())
            sd[p + "mlp.linear_fc1.bias"].copy_(block.mlp.c_fc.bias)
            sd[p + "mlp.linear_fc2.weight"].copy_(block.mlp.c_proj.weight.t())
            sd[p + "mlp.linear_fc2.bias"].copy_(block.mlp.c_proj.bias)
        sd["decoder.final_layernorm.weight"].copy_(t.ln_f.weight)
        sd["decoder.final_layernorm.bias"].copy_(t.ln_f.bias)


def test_gpt2_style_matches_transformers_gpt2():
    torch.manual_seed(0)
    heads, hidden, layers, vocab, seq = 4, 32, 2, 70, 16
    hf_cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden,
                                     n_layer=layers, n_head=heads, activation_function="gelu",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     layer_norm_epsilon=1e-5)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    cfg = parse_args(["--num-layers", str(layers), "--hidden-size", str(hidden),
                      "--num-attention-heads", str(heads), "--seq-length", str(seq),
                      "--vocab-size", str(vocab), "--mock-data", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--lr", "1", "--train-iters", "1"])
    model = build_model(cfg, single_rank_state()).eval()
    _copy_gpt2_into_megalite(hf, model, heads)
    ids = torch.randint(0, vocab, (3, seq))
    labels = torch.randint(0, vocab, (3, seq))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model(ids)[..., :vocab]
        loss = model(ids, labels=labels)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, vocab), labels.reshape(-1),
                                                 reduction="none").view(3, seq)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
