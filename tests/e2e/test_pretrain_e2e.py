"""The user's path end to end: tokenizer -> preprocess -> torchrun pretrain_gpt.py (TP=2,
2 processes) for 20 iterations -> loss falls -> checkpoint -> generate; then resume and
--skip-train from that checkpoint at another layout."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, **kw)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def test_tokenize_preprocess_train_checkpoint_generate(tmp_path):
    corpus = tmp_path / "corpus.txt"
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read()[:200_000]
    corpus.write_text(text)
    _run([PY, "-m", "megalite.data.train_tokenizer", "--input", str(corpus), "--model-prefix",
          str(tmp_path / "tok"), "--vocab-size", "256", "--type", "bpe"])
    _run([PY, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
          str(tmp_path / "shk"), "--tokenizer-type", "SentencePieceTokenizer",
          "--tokenizer-model", str(tmp_path / "tok.model"), "--append-eod"])
    prefix = str(tmp_path / "shk_text_document")
    assert os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    metrics = tmp_path / "metrics.jsonl"
    ckpt = tmp_path / "ckpt"
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--seq-length", "64",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
             "--lr-warmup-iters", "2", "--data-path", prefix, "--split", "95,5,0",
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             str(tmp_path / "tok.model"), "--eval-interval", "10", "--eval-iters", "2",
             "--log-interval", "5", "--hidden-dropout", "0", "--attention-dropout", "0"]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = _run([*torchrun, "pretrain_gpt.py", "--tensor-model-parallel-size", "2", *flags,
                "--train-iters", "20", "--save", str(ckpt), "--metrics-file", str(metrics),
                "--loss-plot", str(tmp_path / "loss.png")])
    assert "iteration       20/      20" in out and "lm loss" in out
    recs = [json.loads(l) for l in metrics.read_text().splitlines()]
    train = [r for r in recs if "split" not in r]
    valid = [r for r in recs if r.get("split") == "valid"]
    assert [r["iteration"] for r in train] == list(range(1, 21))
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.5, (train[0], train[-1])
    assert valid and valid[-1]["lm_loss"] < train[0]["lm_loss"]
    for key in ("consumed_samples", "lr", "grad_norm", "elapsed_ms", "tokens_per_sec",
                "tflops_per_device", "mfu", "peak_mem_bytes"):
        assert key in train[-1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert (tmp_path / "loss.png").stat().st_size > 1000

    sample = _run([PY, "-m", "megalite.generate", "--load", str(ckpt), "--prompt", "ROMEO:",
                   "--max-new-tokens", "30"])
    assert sample.startswith("ROMEO:") and len(sample.strip()) > len("ROMEO:")

    # Evaluate the TP=2 checkpoint at TP=1 in one process: same validation loss.
    metrics2 = tmp_path / "eval.jsonl"
    _run([PY, "pretrain_gpt.py", *flags, "--train-iters", "20", "--load", str(ckpt),
          "--skip-train", "--metrics-file", str(metrics2)])
    ev = [json.loads(l) for l in metrics2.read_text().splitlines()]
    assert abs(ev[-1]["lm_loss"] - valid[-1]["lm_loss"]) < 1e-4 * valid[-1]["lm_loss"]

    # Resume it at TP=1 for two more iterations: the data position of every split carries on
    # (the evaluation at iteration 10 read 2 x 8 validation samples; none ran since)
    first = json.loads((ckpt / "iter_0000020" / "metadata.json").read_text())
    assert first["extra"]["consumed_valid_samples"] == 16
    _run([PY, "pretrain_gpt.py", *flags, "--train-iters", "22", "--load", str(ckpt),
          "--save", str(ckpt), "--override-opt_param-scheduler"])
    meta = json.loads((ckpt / "iter_0000022" / "metadata.json").read_text())
    assert meta["consumed_samples"] == 22 * 8 and meta["iteration"] == 22
    assert meta["extra"]["consumed_valid_samples"] == 16
    assert meta["extra"]["consumed_test_samples"] == 0
