"""tiktoken models against independent oracles: megatron-core's TikTokenTokenizer for
Megatron's ``TikTokenizer`` JSON files, and Hugging Face ``tokenizers`` (transformers'
``TikTokenConverter``, a separate BPE implementation) for Llama 3 ``tokenizer.model`` files.

The BPE files are trained here, offline, by a few lines of byte-pair merging."""

import argparse
import base64
import collections
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tiktoken")
regex = pytest.importorskip("regex")

from megalite.cli.arguments import parse_args  # noqa: E402
from megalite.config import ConfigError  # noqa: E402
from megalite.data.tiktoken_models import (LLAMA3_PATTERN, TIKTOKEN_PATTERNS,  # noqa: E402
                                           write_megatron_ranks)
from megalite.data.tokenizers import build_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = ("The model's tokenizer splits text into pieces; the pieces become ids. "
          "Numbers like 12345 and 2026 split digit by digit. Unicode: wörld, naïve, 東京. "
          "Tabs\tand  double spaces, newlines\n\nand CamelCaseWords or snake_case_names. ") * 6
TEXTS = ["Hello wörld 12345, the model's tokenizer!\n\n  spaces\tand tabs",
         "CamelCaseWords and snake_case_names 2026", "東京 naïve", "", " leading space",
         "unseen: qzxj ⚡ émoji 🙂"]


def train_ranks(text: str, merges: int, pattern: str) -> dict:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent pair, merged, repeatedly."""
    words = [tuple(bytes([b]) for b in w.encode()) for w in regex.findall(pattern, text)]
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(merges):
        pairs = collections.Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(tuple(out))
        words = merged
    return ranks


@pytest.fixture(scope="module")
def megatron_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("tik") / "tokenizer.json"
    ranks = train_ranks(CORPUS, 120, TIKTOKEN_PATTERNS["v2"])
    write_megatron_ranks(ranks, str(path))
    return str(path), len(ranks)


@pytest.fixture(scope="module")
def llama3_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    ranks = train_ranks(CORPUS, 120, LLAMA3_PATTERN)
    with open(path, "wb") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")
    return str(path), len(ranks)


def _megatron_core_tiktoken(path, pattern, vocab_size, num_special):
    pytest.importorskip("megatron.core")
    from megatron.core.tokenizers.text.utils.build_tokenizer import \
        build_tokenizer as mcore_build

    ns = argparse.Namespace(tokenizer_type="TikTokenizer", tokenizer_model=path,
                            tiktoken_pattern=pattern, vocab_size=vocab_size,
                            tiktoken_num_special_tokens=num_special,
                            tokenizer_special_tokens=None, tokenizer_metadata=None)
    return mcore_build(ns)


@pytest.mark.parametrize("pattern,num_special", [("v2", 1000), ("v1", 16)])
def test_tiktokenizer_matches_megatron_core(megatron_json, pattern, num_special):
    path, n = megatron_json
    oracle = _megatron_core_tiktoken(path, pattern, num_special + n, num_special)
    ours = build_tokenizer("TikTokenizer", path, tiktoken_pattern=pattern,
                           tiktoken_num_special_tokens=num_special)
    assert ours.vocab_size == oracle.vocab_size == num_special + n
    assert (ours.eod, ours.bos) == (oracle.eod, oracle.bos) == (2, 1)
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == oracle.tokenize(text), text
        assert all(num_special <= i < ours.vocab_size for i in ids)
        assert ours.detokenize(ids) == text
    # pieces were learned: a seen phrase is fewer ids than bytes
    assert len(ours.tokenize("the tokenizer splits")) < len(b"the tokenizer splits")


def test_tiktokenizer_vocab_size_cuts_the_file(megatron_json):
    path, n = megatron_json
    cut = build_tokenizer("TikTokenizer", path, vocab_size=1000 + 300)
    oracle = _megatron_core_tiktoken(path, "v2", 1300, 1000)
    assert cut.vocab_size == 1300
    assert cut.tokenize(CORPUS[:200]) == oracle.tokenize(CORPUS[:200])
    assert max(cut.tokenize(CORPUS)) < 1300
    with pytest.raises(ValueError, match=r"--vocab-size 99999: .* has only"):
        build_tokenizer("TikTokenizer", path, vocab_size=99999)


def test_tiktokenizer_special_strings_stay_text(megatron_json):
    path, _ = megatron_json
    tok = build_tokenizer("TikTokenizer", path)
    ids = tok.tokenize("a </s> b <s>")
    assert tok.eod not in ids and tok.bos not in ids
    assert tok.detokenize(ids) == "a </s> b <s>"


def test_llama3_matches_hf_tokenizers(llama3_model, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")        # the oracle reads the file uncached
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path, n = llama3_model
    oracle = TikTokenConverter(vocab_file=path, pattern=LLAMA3_PATTERN).converted()
    tok = build_tokenizer("Llama3Tokenizer", path)
    assert tok.vocab_size == n + 256
    assert (tok.bos, tok.eod, tok.eot) == (n, n + 1, n + 9)      # Meta's special-token order
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids[0] == tok.bos
        assert ids[1:] == oracle.encode(text, add_special_tokens=False).ids, text
        assert tok.detokenize(ids[1:]) == text
    assert tok.detokenize([tok.bos]) == "<|begin_of_text|>"
    # control strings inside a document are text, not control ids
    assert tok.eod not in tok.tokenize("x <|end_of_text|> y")


def test_bad_tiktoken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("TikTokenizer", str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="Llama3Tokenizer needs a tokenizer file"):
        build_tokenizer("Llama3Tokenizer", None)
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a Megatron TikTokenizer JSON file"):
        build_tokenizer("TikTokenizer", str(bad))
    few = tmp_path / "few.model"
    few.write_bytes(b"YQ== 0\nYg== 1\n")
    with pytest.raises(ValueError, match="single bytes have no rank"):
        build_tokenizer("Llama3Tokenizer", str(few))
    with pytest.raises(ValueError, match="--tiktoken-pattern must be v1 or v2"):
        build_tokenizer("TikTokenizer", str(bad), tiktoken_pattern="v3")


def test_flags_and_dry_run_validation(megatron_json, tmp_path):
    path, n = megatron_json
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--mock-data", "--train-iters", "1", "--lr", "1e-3"]
    cfg = parse_args(base + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path,
                             "--tiktoken-pattern", "v1", "--tiktoken-num-special-tokens", "8",
                             "--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<pad>"])
    d = cfg.data
    assert (d.tiktoken_pattern, d.tiktoken_num_special_tokens) == ("v1", 8)
    assert d.tiktoken_special_tokens == ["<unk>", "<s>", "</s>", "<pad>"]
    from megalite.data import build_tokenizer_from_config

    tok = build_tokenizer_from_config(d)
    assert tok.vocab_size == 8 + n and tok.special_tokens[3] == "<pad>"
    with pytest.raises(ConfigError, match="--tokenizer-model: .* does not exist"):
        parse_args(base + ["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model",
                           str(tmp_path / "missing.model"), "--dry-run"])
    with pytest.raises(ConfigError, match="--tokenizer-type TikTokenizer needs --tokenizer-model"):
        parse_args(base + ["--tokenizer-type", "TikTokenizer"])


@pytest.mark.parametrize("kind", ["TikTokenizer", "Llama3Tokenizer"])
def test_preprocess_data_accepts_tiktoken_types(kind, megatron_json, llama3_model, tmp_path):
    from megalite.data.indexed_dataset import IndexedDataset

    path = megatron_json[0] if kind == "TikTokenizer" else llama3_model[0]
    corpus = tmp_path / "c.jsonl"
    docs = ["the model's tokenizer", "Numbers like 12345", "wörld 東京"]
    corpus.write_text("".join(f'{{"text": "{d}"}}\n' for d in docs), encoding="utf-8")
    extra = ["--tiktoken-pattern", "v2"] if kind == "TikTokenizer" else []
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                           "--tokenizer-type", kind, "--tokenizer-model", path, "--append-eod",
                           "--workers", "2", *extra], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tok = build_tokenizer(kind, path)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(ds) == 3
    for i, d in enumerate(docs):
        assert np.asarray(ds[i]).tolist() == tok.tokenize(d) + [tok.eod]


def test_preprocess_data_accepts_gpt2_bpe_files(tmp_path):
    """Megatron's GPT-2 flags (--vocab-file/--merge-file) reach the preprocessing tool too."""
    tokenizers = pytest.importorskip("tokenizers")
    from megalite.data.indexed_dataset import IndexedDataset

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([CORPUS], vocab_size=300, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(tmp_path))
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    corpus = tmp_path / "c.txt"
    corpus.write_text("the model's tokenizer\n\nsplits text", encoding="utf-8")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                           "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                           "--merge-file", merges, "--text-docs", "paragraph"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [np.asarray(ds[i]).tolist() for i in range(len(ds))] == \
        [tok.tokenize("the model's tokenizer"), tok.tokenize("splits text")]
