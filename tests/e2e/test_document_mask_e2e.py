"""Document masking as a user runs it: the bundled corpus, one document per paragraph with
an EOD after each (docs/data.md), then ``pretrain_gpt.py --reset-attention-mask
--reset-position-ids --eod-mask-loss`` on one process and under torchrun with CP 2 (ring
attention): the same losses (1e-5 at step 1), and not those of the unmasked run."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _losses(path):
    return [r["lm_loss"] for r in map(json.loads, open(path)) if "split" not in r]


def test_packed_documents_train_alike_on_one_process_and_under_cp(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read()[:20_000])
    tok = tmp_path / "char"
    _run([PY, "-m", "megalite.data.train_tokenizer", "--input", str(corpus), "--model-prefix",
          str(tok), "--type", "char"])
    _run([PY, "tools/preprocess_data.py", "--input", str(corpus), "--text-docs", "paragraph",
          "--output-prefix", str(tmp_path / "shk"), "--append-eod",
          "--tokenizer-type", "CharacterTokenizer", "--tokenizer-model", f"{tok}.json"])
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1",
             "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--data-path", str(tmp_path / "shk_text_document"), "--split", "1,0,0",
             "--tokenizer-type", "CharacterTokenizer", "--tokenizer-model", f"{tok}.json",
             "--device", "cpu", "--transformer-impl", "local", "--no-progress-bar",
             "--eod-mask-loss"]
    docs = ["--reset-attention-mask", "--reset-position-ids"]
    runs = {"one": [PY, "pretrain_gpt.py", *flags, *docs],
            "cp2": [*TORCHRUN, "pretrain_gpt.py", *flags, *docs, "--context-parallel-size", "2"],
            "plain": [PY, "pretrain_gpt.py", *flags]}
    losses = {}
    for name, cmd in runs.items():
        path = tmp_path / f"{name}.jsonl"
        _run([*cmd, "--metrics-file", str(path)])
        losses[name] = _losses(path)
    one, cp2, plain = losses["one"], losses["cp2"], losses["plain"]
    assert len(one) == len(cp2) == 3
    assert abs(cp2[0] - one[0]) <= 1e-5 * one[0], (one, cp2)
    for a, b in zip(cp2, one):
        assert abs(a - b) <= 1e-4 * b, (one, cp2)
    assert abs(plain[0] - one[0]) > 1e-4 * one[0], (one, plain)   # the mask matters
