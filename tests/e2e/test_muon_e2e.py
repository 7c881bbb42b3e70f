"""--optimizer muon as a user runs it: the bundled corpus (byte-level tokens), torchrun
pretrain_gpt.py at TP2 for 14 iterations with a checkpoint at 12 -- the loss falls -- then
the iteration-12 checkpoint resumed at DP2 with the distributed optimizer: its iterations
13 and 14 give the uninterrupted run's losses, so the Muon momentum (and AdamW's moments)
resharded through DCP from TP-split tensors to flat ranges over DP."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable


def _run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _losses(path):
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, open(path))
            if "split" not in r}


def test_muon_trains_on_the_corpus_and_resumes_at_another_layout(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read()[:60_000])
    _run([PY, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
          str(tmp_path / "shk"), "--tokenizer-type", "ByteLevelTokenizer", "--append-eod"])
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--seq-length", "32",
             "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2",
             "--lr-warmup-iters", "2", "--data-path", str(tmp_path / "shk_text_document"),
             "--split", "100,0,0", "--tokenizer-type", "ByteLevelTokenizer", "--eval-iters",
             "0", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--optimizer", "muon", "--muon-nesterov", "--train-iters", "14"]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ckpt = tmp_path / "ckpt"
    _run([*torchrun, "pretrain_gpt.py", *flags, "--tensor-model-parallel-size", "2",
          "--save", str(ckpt), "--save-interval", "12", "--metrics-file",
          str(tmp_path / "tp2.jsonl")])
    straight = _losses(tmp_path / "tp2.jsonl")
    assert sorted(straight) == list(range(1, 15))
    assert straight[14] < straight[1] - 0.5, straight        # Muon trains
    _run([*torchrun, "pretrain_gpt.py", *flags, "--use-distributed-optimizer", "--load",
          str(ckpt), "--ckpt-step", "12", "--metrics-file", str(tmp_path / "dp2.jsonl")])
    resumed = _losses(tmp_path / "dp2.jsonl")
    assert sorted(resumed) == [13, 14], resumed
    for it in (13, 14):
        assert abs(resumed[it] - straight[it]) <= 1e-4 * straight[it], (it, resumed, straight)
