"""A trained checkpoint carries its model: resume it with --use-checkpoint-args and only the
run's flags; retyped model flags that disagree stop the launch with one line, exit 2."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _run(cmd, ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if ok:
        assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p


def test_trained_checkpoint_resumes_from_its_own_args(tmp_path):
    import numpy as np

    from megalite.data.indexed_dataset import write_documents

    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt"), "rb").read()[:60_000]
    docs = [list(text[i:i + 3000]) for i in range(0, len(text), 3000)]
    data = write_documents(str(tmp_path / "bytes"), docs, np.uint16)
    ckpt = str(tmp_path / "ckpt")
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--rotary-base", "50000", "--swiglu",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    run = ["--seq-length", "32", "--micro-batch-size", "4", "--lr", "1e-3", "--data-path", data,
           "--split", "90,10,0", "--eval-iters", "2", "--eval-interval", "100",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu"]
    tokenizer = ["--tokenizer-type", "ByteLevelTokenizer"]
    first = tmp_path / "first.jsonl"
    _run([PY, "pretrain_gpt.py", *model, *run, *tokenizer, "--train-iters", "3", "--save", ckpt,
          "--metrics-file", str(first)])
    valid = [json.loads(ln) for ln in first.read_text().splitlines()
             if json.loads(ln).get("split") == "valid"]

    # only the run's flags: model and tokenizer come from the checkpoint
    again = tmp_path / "again.jsonl"
    p = _run([PY, "pretrain_gpt.py", *run, "--train-iters", "3", "--load", ckpt,
              "--use-checkpoint-args", "--skip-train", "--metrics-file", str(again)])
    assert "model flags from the checkpoint" in p.stdout and "loaded" in p.stdout
    ev = [json.loads(ln) for ln in again.read_text().splitlines()]
    assert abs(ev[-1]["lm_loss"] - valid[-1]["lm_loss"]) < 1e-5 * valid[-1]["lm_loss"]

    # retyped flags that disagree: one line naming the flag and both values, exit 2
    wrong = [f if f != "50000" else "10000" for f in model]
    p = _run([PY, "pretrain_gpt.py", *wrong, *run, *tokenizer, "--train-iters", "4",
              "--load", ckpt], ok=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        f"megalite: error: --rotary-base: this run has 10000, the checkpoint in {ckpt} has "
        "50000; pass --rotary-base 50000 (or --use-checkpoint-args)"]
