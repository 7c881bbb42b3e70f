"""nanoGPT's baby-GPT recipe as a plain PyTorch loop, and the evaluation both sides share.

The side-by-side reference for convergence_baby_gpt.py. The model is nanoGPT's architecture
(pre-LayerNorm blocks, learned positions, exact GeLU, tied embeddings, ``bias`` switch as in
nanoGPT's GPTConfig), initialized as nanoGPT does (normal 0.02, residual projections
0.02/sqrt(2L), zero biases). Training: a window at a uniformly random offset per sample,
AdamW (weight decay on 2-D params only), nanoGPT's warmup + cosine LR function, clip 1.0.

Evaluation is one function for both systems, given a ``loss(tokens, labels)`` callable:
- :func:`full_split_loss`: every non-overlapping window of the validation split (the
  low-noise figure);
- :func:`nanogpt_estimates`: what nanoGPT's ``estimate_loss`` with ``--eval_iters=20`` would
  print (the mean of 20 random batches of 12 windows), as a distribution over many draws.
"""
import math
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class _LayerNorm(nn.Module):
    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool):
        super().__init__()
        self.heads = heads
        self.ln_attn, self.ln_mlp = _LayerNorm(hidden, bias), _LayerNorm(hidden, bias)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.attn_proj = nn.Linear(hidden, hidden, bias=bias)
        self.fc = nn.Linear(hidden, 4 * hidden, bias=bias)
        self.mlp_proj = nn.Linear(4 * hidden, hidden, bias=bias)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln_attn(x)).split(h, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_mlp(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int, seq: int = 64, hidden: int = 128, layers: int = 4,
                 heads: int = 4, bias: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads, bias) for _ in range(layers))
        self.ln_f = _LayerNorm(hidden, bias)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, tokens, labels):
        """Per-token losses [batch, seq]."""
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.t()  # tied output layer
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                               reduction="none").view(labels.shape)


def random_windows(data: np.ndarray, count: int, gen: torch.Generator, seq: int = 64):
    """``count`` (tokens, labels) rows at uniformly random offsets, as nanoGPT's get_batch."""
    ix = torch.randint(len(data) - seq, (count,), generator=gen).tolist()
    rows = torch.from_numpy(np.stack([data[i:i + seq + 1] for i in ix]).astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def train_reference(train: np.ndarray, vocab: int, seed: int, iters: int = 2000,
                    bias: bool = True) -> tuple[NanoGPT, float]:
    """nanoGPT's recipe; returns (model in eval mode, training wall seconds)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = NanoGPT(vocab, bias=bias)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))

    def lr_at(it):
        if it < 100:
            return 1e-3 * (it + 1) / 101
        ratio = min((it - 100) / max(iters - 100, 1), 1.0)
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * 9e-4

    t0 = time.time()
    for it in range(iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        loss = model(*random_windows(train, 12, gen)).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    model.eval()
    return model, time.time() - t0


@torch.no_grad()
def full_split_loss(token_losses, data: np.ndarray, seq: int = 64, batch: int = 256) -> float:
    """Mean loss over every non-overlapping ``seq``-token window of ``data`` (one pass).

    ``token_losses(tokens, labels)`` returns the per-token losses, shape [batch, seq].
    """
    starts = np.arange(0, len(data) - seq, seq)
    total = 0.0
    for i in range(0, len(starts), batch):
        rows = torch.from_numpy(np.stack([data[s:s + seq + 1] for s in starts[i:i + batch]]))
        total += token_losses(rows[:, :-1].long(), rows[:, 1:].long()).float().sum().item()
    return total / (len(starts) * seq)


@torch.no_grad()
def nanogpt_estimates(token_losses, data: np.ndarray, seed: int, draws: int = 2000,
                      pool: int = 4800) -> np.ndarray:
    """``draws`` values of nanoGPT's 20-batch estimate (the mean over 20 x 12 random windows),
    resampled from the losses of ``pool`` random windows."""
    gen = torch.Generator().manual_seed(seed)
    per_window = torch.cat([token_losses(*random_windows(data, 240, gen)).float().mean(dim=1)
                            for _ in range(pool // 240)]).numpy()
    rng = np.random.default_rng(seed)
    return per_window[rng.integers(0, len(per_window), size=(draws, 240))].mean(axis=1)
