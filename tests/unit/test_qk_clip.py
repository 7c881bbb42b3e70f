"""--qk-clip (optimizer/qk_clip.py): a query group pushed above tau has its Q and K rows
scaled so that, on the same batch, its largest logit is tau at the next step; the other
groups, and every V row, are untouched.  lr 0: the clip is the only change."""
import pytest
import torch

from cpu_trainer import build_cpu_trainer  # noqa: E402  (tests/ is on sys.path)
import megalite.training.loop as loop

FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "16",
         "--vocab-size", "100", "--position-embedding-type", "rope", "--normalization",
         "RMSNorm", "--disable-bias-linear", "--mock-data", "--lr", "0", "--train-iters", "2",
         "--global-batch-size", "4", "--micro-batch-size", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--eval-iters", "0", "--optimizer", "muon",
         "--qk-clip", "--qk-clip-threshold", "0.5"]


def test_a_group_above_tau_is_capped_at_the_next_step(monkeypatch):
    trainer = build_cpu_trainer(FLAGS, 1)
    attn = next(m for m in trainer.model_chunks[0].modules()
                if type(m).__name__ == "SelfAttention")
    r, d = attn.heads_per_group, attn.head_dim
    w = attn.linear_qkv.weight
    with torch.no_grad():
        w[:r * d] *= 40.0                    # group 0's query rows: logits far above tau
    before = w.detach().clone()
    seen = []
    real = loop.clip_qk

    def spy(*args, **kwargs):
        seen.append(attn.core_attention.max_logits.clone())
        return real(*args, **kwargs)
    monkeypatch.setattr(loop, "clip_qk", spy)
    for _ in range(2):                       # the same first batch twice
        trainer.train_step(trainer.data_iterator(trainer.train_ds, 0))
    first, second = (m.view(2, r).amax(dim=1) for m in seen)
    assert first[0] > 0.5 > first[1], first
    torch.testing.assert_close(second[0], torch.tensor(0.5), rtol=1e-4, atol=0)
    torch.testing.assert_close(second[1], first[1])     # the other group: as it was
    eta = 0.5 / first[0]
    per_group = (r + 2) * d
    after = w.detach()
    torch.testing.assert_close(after[:r * d], before[:r * d] * eta.sqrt())          # Q
    torch.testing.assert_close(after[r * d:(r + 1) * d], before[r * d:(r + 1) * d] * eta.sqrt())
    assert torch.equal(after[(r + 1) * d:per_group], before[(r + 1) * d:per_group])  # V
    assert torch.equal(after[per_group:], before[per_group:])                       # group 1
    assert attn.core_attention.max_logits is None           # reset for the next step


def test_evaluation_records_nothing():
    trainer = build_cpu_trainer(FLAGS, 1)
    trainer.evaluate(trainer.train_ds, 1)
    assert all(getattr(m, "max_logits", None) is None for m in trainer.model_chunks[0].modules())
