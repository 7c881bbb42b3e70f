"""nanoGPT's baby-GPT recipe as a plain PyTorch loop on transformers' GPT2LMHeadModel.

The side-by-side reference for convergence_baby_gpt.py: nanoGPT's initialization (normal
0.02, residual projections 0.02/sqrt(2L)), random 64-character windows, AdamW (weight decay
on 2-D params only), its warmup + cosine LR function, clip 1.0; validation = mean of
``eval_batches`` random batches of the last 10% of the text.  Needs ``transformers``.
"""
import math
import time

import numpy as np
import torch


def train_reference(text: str, seed: int, iters: int = 2000, eval_batches: int = 200) -> dict:
    import transformers

    torch.manual_seed(seed)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int64)
    n = int(0.9 * len(data))
    train, val = data[:n], data[n:]
    cfg = transformers.GPT2Config(vocab_size=len(chars), n_positions=64, n_embd=128, n_layer=4,
                                  n_head=4, activation_function="gelu", resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, 0.0, 0.02)
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))
            if name.endswith(".bias") and ".ln_" not in name:
                p.zero_()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))

    def lr_at(it):
        if it < 100:
            return 1e-3 * (it + 1) / 101
        ratio = min((it - 100) / (iters - 100), 1.0)
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * 9e-4

    def batch(d):
        ix = torch.randint(len(d) - 64, (12,))
        x = torch.stack([torch.from_numpy(d[i:i + 64]) for i in ix])
        y = torch.stack([torch.from_numpy(d[i + 1:i + 65]) for i in ix])
        return x, y

    t0 = time.time()
    for it in range(iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        x, y = batch(train)
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, len(chars)), y.view(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    wall = time.time() - t0
    model.eval()
    with torch.no_grad():
        losses = []
        for _ in range(eval_batches):
            x, y = batch(val)
            losses.append(torch.nn.functional.cross_entropy(
                model(x).logits.view(-1, len(chars)), y.view(-1)).item())
    return {"val_loss": sum(losses) / len(losses), "wall_s": wall}
