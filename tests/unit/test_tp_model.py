"""Single-process checks of the GPT model: loss, padding, init rule, pipeline slices."""
import sys

import pytest
import torch
import torch.nn.functional as F

from megalite.backends import get_layer_spec
from megalite.config import MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.gpt import build_chunk, build_model, parameter_specs, single_rank_state
from megalite.param_spec import Split
from megalite.parallel_state import ParallelState, RankGrid
from megalite.tensor_parallel import vocab_parallel_cross_entropy
from megalite.transformer.norms import RMSNorm
from megalite.transformer.rotary import RotaryEmbedding, apply_rotary

V, S, B = 70, 8, 2


def mcfg(arch="llama", layers=2, **over):
    d = dict(num_layers=layers, hidden_size=32, num_attention_heads=8, seq_length=S, vocab_size=V,
             make_vocab_size_divisible_by=16, hidden_dropout=0.0, attention_dropout=0.0)
    if arch == "llama":
        d.update(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 add_bias_linear=False, untie_embeddings_and_output_weights=True,
                 group_query_attention=True, num_query_groups=2)
    d.update(over)
    return ModelConfig(**d)


def cfg_of(m, seed=1234, tp=1, sp=False):
    cfg = MegaliteConfig(model=m, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                          sequence_parallel=sp))
    cfg.training.seed = seed
    return cfg


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_loss_is_cross_entropy_over_the_real_vocab(arch):
    model = build_model(cfg_of(mcfg(arch)), single_rank_state())
    ids, labels = data()
    logits = model(ids)
    assert logits.shape == (B, S, 80)
    assert (logits[..., V:] == 0).all()
    loss = model(ids, labels=labels)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    ref = F.cross_entropy(logits[..., :V].reshape(-1, V), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.view(B, S), rtol=1e-6, atol=1e-6)
    loss.mean().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(ids)[..., :V].reshape(-1, V), labels.reshape(-1)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-5, atol=1e-7)
    head = model.output_layer.weight if arch == "llama" else model.embedding.word_embeddings.weight
    assert (ours[[n for n, p in model.named_parameters() if p is head][0]][V:] == 0).all()


def test_vocab_parallel_cross_entropy_single_rank():
    group = single_rank_state().tp
    logits = torch.randn(5, 3, 16, requires_grad=True)
    target = torch.randint(0, 12, (5, 3))
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target, group, vocab_size=12)
    assert torch.equal(logits.detach(), before)  # not in place unless asked
    ref = F.cross_entropy(logits[..., :12].reshape(-1, 12), target.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref)
    w = torch.rand(5, 3)
    (loss * w).sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    (F.cross_entropy(logits[..., :12].reshape(-1, 12), target.reshape(-1), reduction="none")
     * w.reshape(-1)).sum().backward()
    torch.testing.assert_close(g, logits.grad)
    assert (g[..., 12:] == 0).all()


def test_init_depends_on_name_and_seed_not_on_pipeline_slice():
    m = mcfg(layers=4)
    full = dict(build_model(cfg_of(m), single_rank_state()).canonical_named_parameters())
    stage = build_chunk(cfg_of(m), single_rank_state(), False, True, [2, 3])
    names = [n for n, _ in stage.canonical_named_parameters()]
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in names
    assert not any(n.startswith(("embedding", "decoder.layers.0")) for n in names)
    for n, p in stage.canonical_named_parameters():
        assert torch.equal(p, full[n]), n
    other = dict(build_model(cfg_of(m, seed=5), single_rank_state()).canonical_named_parameters())
    w = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(other[w], full[w])
    l0, l1 = full[w], full["decoder.layers.1.mlp.linear_fc1.weight"]
    assert not torch.equal(l0, l1)
    assert abs(l0.std().item() - 0.02) < 0.003  # normal(0, init_method_std)
    assert set(parameter_specs(m)) == set(full)


def test_tied_pipeline_split_matches_full_model():
    m = mcfg("gpt2", layers=4)  # tied embeddings, learned positions, biases
    ids, labels = data(1)
    full = build_model(cfg_of(m), single_rank_state())
    full_loss = full(ids, labels=labels)
    full_loss.mean().backward()
    assert full.output_layer.weight is None
    assert full.shared_embedding_weight() is full.embedding.word_embeddings.weight

    s0 = build_chunk(cfg_of(m), single_rank_state(), True, False, [0, 1])
    s1 = build_chunk(cfg_of(m), single_rank_state(), False, True, [2, 3])
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        s1(None)
    hidden = s0(ids)
    assert hidden.shape == (S, B, 32)
    recv = hidden.detach().requires_grad_()
    s1.set_input_tensor([recv])
    loss = s1(None, labels=labels)
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=0)
    loss.mean().backward()
    hidden.backward(recv.grad)
    copy = s1.shared_embedding_weight()
    assert copy is s1.output_layer.weight
    assert s1.param_table.spec("output_layer.weight").tied == "copy"
    assert s1.param_table.canonical("output_layer.weight") == "embedding.word_embeddings.weight"
    first = s0.shared_embedding_weight()
    assert s0.param_table.spec("embedding.word_embeddings.weight").tied == "owner"
    assert torch.equal(copy, s0.shared_embedding_weight())
    # summing the two copies' grads (what the 'embedding' group all-reduce does) = full grad
    torch.testing.assert_close(copy.grad + s0.shared_embedding_weight().grad,
                               full.embedding.word_embeddings.weight.grad, rtol=1e-5, atol=1e-7)
    for n, p in s1.named_parameters():
        if n.startswith("decoder"):
            torch.testing.assert_close(p.grad, dict(full.named_parameters())[n].grad)
    assert build_chunk(cfg_of(mcfg()), single_rank_state(), True, False, [0]).shared_embedding_weight() is None


def test_position_ids_default_and_explicit_agree():
    for arch in ("llama", "gpt2"):
        model = build_model(cfg_of(mcfg(arch)), single_rank_state())
        ids, _ = data()
        pos = torch.arange(S).expand(B, S)
        torch.testing.assert_close(model(ids), model(ids, position_ids=pos), rtol=0, atol=0)


def test_local_shapes_at_tp4_without_process_groups():
    state = ParallelState.build(RankGrid(4, tp=4), 2, create_groups=False)
    m = mcfg(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64, kv_channels=6)
    model = build_model(cfg_of(m, tp=4, sp=True), state)
    p = dict(model.named_parameters())
    assert p["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((8 + 8) * 6 // 4, 32)
    assert p["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 8 * 6 // 4)
    assert p["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 64 // 4, 32)
    assert p["embedding.word_embeddings.weight"].shape == (128 // 4, 32)
    spec = model.param_table.spec
    qkv = spec("decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.splits == (Split(0, "tp"),) and qkv.init == ("normal", 0.02)
    assert spec("decoder.layers.0.mlp.linear_fc1.weight").splits == (Split(0, "tp", 2),)
    assert spec("embedding.word_embeddings.weight").splits == (Split(0, "tp", 1, 16),)
    assert spec("decoder.layers.0.self_attention.linear_proj.weight").splits == (Split(1, "tp"),)
    assert spec("decoder.layers.0.input_layernorm.weight").sequence_parallel == "tp"
    assert spec("decoder.layers.0.input_layernorm.weight").splits == ()
    assert not qkv.sequence_parallel
    assert not any(hasattr(p, a) for p in model.parameters()       # nothing on the params
                   for a in ("shard_meta", "sequence_parallel", "tensor_model_parallel",
                             "shared_embedding", "is_embedding_copy", "canonical_name"))
    with pytest.raises(AssertionError, match="heads split over TP"):   # validation refuses it
        build_model(cfg_of(mcfg(num_query_groups=2), tp=4), state)


def test_sequence_parallel_is_ignored_at_tp1_and_dropout_is_seeded():
    m = mcfg(hidden_dropout=0.2, attention_dropout=0.2)
    model = build_model(cfg_of(m, sp=True), single_rank_state())
    assert not model.sequence_parallel
    ids, labels = data()
    torch.manual_seed(3)
    tracked = model.rng_tracker.get_states()  # attention dropout draws from the tracker
    a = model(ids, labels=labels)
    torch.manual_seed(3)
    c0 = model(ids, labels=labels)             # tracker advanced: different masks
    torch.manual_seed(3)
    model.rng_tracker.set_states(tracked)
    b = model(ids, labels=labels)
    assert not torch.allclose(a, c0)
    model.eval()
    c = model(ids, labels=labels)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)


def test_rope_and_rmsnorm_match_hf_formulas():
    rot = RotaryEmbedding(8, 10000)
    cos, sin = rot(5)
    x = torch.randn(2, 3, 5, 8)
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), x * cos + rotate_half * sin)
    xd = torch.randn(2, 3, 5, 8, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos.double(), sin.double()), (xd,))
    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_()
    y = torch.randn(4, 8)
    ref = norm.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(y), ref, rtol=1e-6, atol=1e-6)


def test_backend_spec_and_no_transformer_engine_import():
    assert get_layer_spec("local").column_parallel_linear.__name__ == "ColumnParallelLinear"
    with pytest.raises(ValueError, match="needs the model config"):   # TE: tests/unit/test_te_backend.py
        get_layer_spec("transformer_engine")
    with pytest.raises(ValueError):
        get_layer_spec("bogus")
    assert "transformer_engine" not in sys.modules


def test_sequence_not_divisible_by_tp_is_a_clear_error():
    from megalite.parallel_state import Group
    from megalite.tensor_parallel import reduce_scatter_to_sp_region, scatter_to_sp_region

    fake_tp = Group("tp", [0, 1], None, 0)  # the error is raised before any collective
    for fn in (reduce_scatter_to_sp_region, scatter_to_sp_region):
        with pytest.raises(ValueError, match="not divisible by TP=2"):
            fn(torch.zeros(3, 1, 4), fake_tp)
