"""megalite's training step (loss normalization, AdamW groups, clipping, LR schedule) follows
a plain PyTorch loop on transformers' GPT-2 with the same weights and batches, step by step."""
import pytest
import torch

from megalite.cli.arguments import parse_args
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training.loop import Trainer

from test_gpt2_hf_equivalence import _copy_gpt2_into_megalite

transformers = pytest.importorskip("transformers")


def test_twenty_steps_track_a_plain_pytorch_loop():
    torch.manual_seed(0)
    heads, hidden, layers, vocab, seq, batch, steps = 4, 32, 2, 65, 16, 6, 20
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    cfg = parse_args(["--num-layers", str(layers), "--hidden-size", str(hidden),
                      "--num-attention-heads", str(heads), "--seq-length", str(seq),
                      "--vocab-size", str(vocab), "--mock-data", "--hidden-dropout", "0",
                      "--attention-dropout", "0", "--lr", "3e-3", "--min-lr", "3e-4",
                      "--lr-warmup-iters", "5", "--lr-decay-style", "cosine",
                      "--train-iters", str(steps), "--adam-beta2", "0.99",
                      "--weight-decay", "0.1", "--clip-grad", "0.5",
                      "--micro-batch-size", str(batch // 2), "--global-batch-size", str(batch),
                      "--eval-iters", "0"])
    trainer = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    trainer.setup()
    _copy_gpt2_into_megalite(hf, trainer.model_chunks[0], heads)
    if trainer.optimizer.bf16:
        pytest.skip("fp32 comparison")

    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.9, 0.99), eps=1e-8)
    gen = torch.Generator().manual_seed(1)
    ours, ref = [], []
    for step in range(1, steps + 1):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)  # learnable: counting mod 11
        tokens = (start + torch.arange(seq + 1)) % 11
        micro = [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(len(t), seq),
                  "position_ids": torch.arange(seq).expand(len(t), seq)} for t in tokens.chunk(2)]
        ours.append(trainer.train_step(iter(micro))["lm_loss"])
        logits = hf(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 tokens[:, 1:].reshape(-1))
        ref_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 0.5)
        for g in ref_opt.param_groups:
            g["lr"] = trainer.scheduler.lr(step)
        ref_opt.step()
        ref.append(loss.item())
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-4 * abs(b), (ours, ref)
    assert ours[-1] < ours[0]
