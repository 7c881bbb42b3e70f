"""The fused, chunked output layer + cross entropy equals the unfused path (one rank).

Checked against ``F.linear`` + ``vocab_parallel_cross_entropy`` and against torch's own
``F.cross_entropy``: per-token loss, dX and dW in fp32 to 1e-5, with vocabulary padding,
chunks that do not divide the tokens, a loss mask (the path that forms the gradients in
forward) and a per-token weighting the forward did not expect (the recomputing path).
The multi-rank (TP2, TP2+SP, TP4 with an all-padding rank) checks are in
tests/distributed/test_fused_cross_entropy_dist.py.
"""
import pytest
import torch
import torch.nn.functional as F

from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.parallel_state import Group
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import (auto_chunk_tokens,
                                                          fused_linear_cross_entropy,
                                                          proportional_scale)

ONE = Group("tp", [0], None, 0)
S, B, H, VOCAB, V_PAD = 12, 3, 16, 50, 64


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g)
    w = torch.randn(V_PAD, H, generator=g) * 0.3
    w[VOCAB:] = 0.0                                       # padded rows, as in the model
    labels = torch.randint(0, VOCAB, (S, B), generator=g)
    mask = (torch.rand(S, B, generator=g) > 0.25).float()
    return x.to(dtype), w.to(dtype), labels, mask


def loss_and_grads(fused, x, w, labels, weigh, mask=None, chunk=0):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    if fused:
        loss = fused_linear_cross_entropy(x, w, labels, ONE, VOCAB, token_weights=mask,
                                          chunk_tokens=chunk)
    else:
        loss = vocab_parallel_cross_entropy(F.linear(x, w), labels, ONE, VOCAB)
    weigh(loss).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk", [0, 1, 5, 36, 100])
def test_fused_matches_unfused_masked_mean(chunk):
    x, w, labels, mask = inputs()

    def masked_mean(loss):
        return (loss * mask).sum() / mask.sum()
    ref = loss_and_grads(False, x, w, labels, masked_mean)
    got = loss_and_grads(True, x, w, labels, masked_mean, mask=mask, chunk=chunk)
    for a, b in zip(got, ref):
        assert rel(a, b) <= 1e-5
    assert (got[2][VOCAB:] == 0).all()                    # padded rows: no gradient
    # and torch's own cross entropy over the unpadded vocabulary
    torch_loss = F.cross_entropy(F.linear(x, w)[..., :VOCAB].reshape(-1, VOCAB),
                                 labels.reshape(-1), reduction="none").view(S, B)
    assert rel(got[0], torch_loss) <= 1e-5


@pytest.mark.parametrize("chunk", [0, 5])
def test_fused_softcapped_logits_match_unfused(chunk):
    """--final-logit-softcapping (Gemma 2): the fused loss of cap * tanh(logits / cap) and its
    gradients equal the unfused path's, on both the mask-guessed and the exact path."""
    x, w, labels, mask = inputs()
    cap = 1.5
    odd = torch.rand(S, B, generator=torch.Generator().manual_seed(3))
    for weigh in (lambda loss: (loss * mask).sum() / mask.sum(), lambda loss: (loss * odd).sum()):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = vocab_parallel_cross_entropy(torch.tanh(F.linear(xr, wr) / cap) * cap, labels,
                                           ONE, VOCAB)
        weigh(ref).backward()
        xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = fused_linear_cross_entropy(xf, wf, labels, ONE, VOCAB, token_weights=mask,
                                         chunk_tokens=chunk, softcap=cap)
        weigh(got).backward()
        for a, b in ((got, ref), (xf.grad, xr.grad), (wf.grad, wr.grad)):
            assert rel(a.detach(), b.detach()) <= 1e-5
        plain = fused_linear_cross_entropy(x, w, labels, ONE, VOCAB)
        assert rel(got.detach(), plain) > 1e-3          # the cap matters here


def test_unexpected_token_weights_take_the_exact_path():
    """The forward guessed "mask" but backward weights every token differently."""
    x, w, labels, mask = inputs()
    odd = torch.rand(S, B, generator=torch.Generator().manual_seed(3))

    def weighted(loss):
        return (loss * odd).sum()
    ref = loss_and_grads(False, x, w, labels, weighted)
    got = loss_and_grads(True, x, w, labels, weighted, mask=mask, chunk=7)
    for a, b in zip(got, ref):
        assert rel(a, b) <= 1e-5


def test_no_mask_given_plain_mean_and_sum():
    x, w, labels, _ = inputs()
    for reduce in (torch.mean, torch.sum):
        ref = loss_and_grads(False, x, w, labels, reduce)
        got = loss_and_grads(True, x, w, labels, reduce, chunk=4)
        for a, b in zip(got, ref):
            assert rel(a, b) <= 1e-5


def test_backward_twice_with_retained_graph():
    """Zero-bubble style: B then W backward over one graph gives the same grads."""
    x, w, labels, mask = inputs()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(xr, wr, labels, ONE, VOCAB, token_weights=mask,
                                      chunk_tokens=5)
    total = (loss * mask).sum() / mask.sum()
    (gx,) = torch.autograd.grad(total, xr, retain_graph=True)
    (gw,) = torch.autograd.grad(total, wr)
    ref = loss_and_grads(False, x, w, labels, lambda l: (l * mask).sum() / mask.sum())
    assert rel(gx, ref[1]) <= 1e-5 and rel(gw, ref[2]) <= 1e-5


def test_bf16_close_to_unfused_bf16():
    x, w, labels, mask = inputs(torch.bfloat16)

    def masked_mean(loss):
        return (loss * mask).sum() / mask.sum()
    ref = loss_and_grads(False, x, w, labels, masked_mean)
    got = loss_and_grads(True, x, w, labels, masked_mean, mask=mask, chunk=5)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel(got[0], ref[0]) <= 1e-5                    # loss in fp32 from the same logits
    assert rel(got[1], ref[1]) <= 2e-2 and rel(got[2], ref[2]) <= 2e-2


def test_no_grad_forward_only():
    x, w, labels, _ = inputs()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, labels, ONE, VOCAB, chunk_tokens=5)
        ref = vocab_parallel_cross_entropy(F.linear(x, w), labels, ONE, VOCAB)
    assert rel(loss, ref) <= 1e-6


def test_proportional_scale():
    w = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert proportional_scale(w * 0.25, w) == pytest.approx(0.25)
    assert proportional_scale(torch.tensor([0.25, 0.0, 0.25, 0.3]), w) is None
    assert proportional_scale(torch.zeros(4), torch.zeros(4)) == 0.0
    assert proportional_scale(torch.ones(4), torch.zeros(4)) is None
    long = (torch.rand(100_000) > 0.1).float()           # an fp32 dot would drift here
    assert proportional_scale(long / long.sum(), long) == pytest.approx(1 / long.sum().item())


def test_auto_chunk_tokens_bounds():
    assert auto_chunk_tokens(32000) == 262
    assert 16 <= auto_chunk_tokens(10 ** 9) and auto_chunk_tokens(1) == 4096


def _model(fused: bool, tied: bool):
    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                    seq_length=S, vocab_size=VOCAB, make_vocab_size_divisible_by=16,
                    normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    add_bias_linear=False, untie_embeddings_and_output_weights=not tied,
                    hidden_dropout=0.0, attention_dropout=0.0,
                    cross_entropy_loss_fusion=fused, cross_entropy_chunk_tokens=7)
    return build_model(MegaliteConfig(model=m), single_rank_state())


@pytest.mark.parametrize("tied", [False, True])
def test_model_with_fusion_matches_model_without(tied):
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.ones(B, S)
    mask[:, -2:] = 0
    out = []
    for fused in (False, True):
        model = _model(fused, tied)
        assert model.fused_loss is fused
        loss = model(ids, labels=labels, loss_mask=mask)
        ((loss * mask).sum() / mask.sum()).backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        with torch.no_grad():
            assert rel(model(ids, labels=labels), loss) <= 1e-6     # eval: loss only
    (ref_loss, ref_grads), (loss, grads) = out
    assert rel(loss, ref_loss) <= 1e-5
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert rel(grads[name], ref_grads[name]) <= 1e-5, name


def test_fusion_flag_parses():
    from megalite.cli.arguments import parse_args

    cfg = parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
                      "--seq-length", "8", "--vocab-size", "16", "--mock-data",
                      "--train-iters", "1", "--lr", "1e-3", "--cross-entropy-loss-fusion",
                      "--cross-entropy-chunk-tokens", "128"])
    assert cfg.model.cross_entropy_loss_fusion and cfg.model.cross_entropy_chunk_tokens == 128
