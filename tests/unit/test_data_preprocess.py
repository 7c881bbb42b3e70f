"""tools/preprocess_data.py end to end, as a user runs it (subprocess), plus its input errors."""

import json
import os
import subprocess
import sys

import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import build_tokenizer, train_char_tokenizer, train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
DOCS = ["First Citizen: Before we proceed any further, hear me speak.",
        "All: Speak, speak.",
        "",  # empty document: skipped
        "First Citizen: You are all resolved rather to die than to famish?"]


def run(*args, cwd=None):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    jsonl = d / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "title": f"t{i}"}) + "\n" for i, t in enumerate(DOCS)))
    text = d / "plain.txt"
    text.write_text("\n\n".join(t for t in DOCS if t) + "\n")
    train_char_tokenizer([str(text)], str(d / "char.json"))
    train_sentencepiece([str(text)], str(d / "sp"), vocab_size=40, model_type="bpe")
    nums = d / "nums.jsonl"
    nums.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
    return d


TOKENIZERS = [
    ("ByteLevelTokenizer", []),
    ("CharacterTokenizer", ["--tokenizer-model", "char.json"]),
    ("SentencePieceTokenizer", ["--tokenizer-model", "sp.model"]),
]


@pytest.mark.parametrize("kind,extra", TOKENIZERS)
def test_jsonl_end_to_end(files, kind, extra):
    extra = [str(files / e) if e.endswith((".json", ".model")) else e for e in extra]
    out = files / f"out_{kind}"
    r = run("--input", str(files / "docs.jsonl"), "--output-prefix", str(out), "--tokenizer-type", kind,
            *extra, "--append-eod", "--workers", "2", "--json-keys", "text", "title")
    assert r.returncode == 0, r.stderr
    tok = build_tokenizer(kind, extra[1] if extra else None)
    kept = [t for t in DOCS if t]
    text_ds = IndexedDataset(f"{out}_text_document")
    assert text_ds.num_documents == len(kept)
    for i, doc in enumerate(kept):
        assert text_ds[i].tolist() == tok.tokenize(doc) + [tok.eod]
    title_ds = IndexedDataset(f"{out}_title_document")
    titles = [tok.tokenize(t) + [tok.eod] for t in ["t0", "t1", "t2", "t3"]]
    assert [title_ds[i].tolist() for i in range(len(title_ds))] == titles
    assert text_ds.dtype.name == "uint16"
    assert "skipped 1 empty" in r.stdout and "4 documents" in r.stdout


def test_null_tokenizer_end_to_end(files):
    out = files / "null"
    r = run("--input", str(files / "nums.jsonl"), "--output-prefix", str(out),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "10")
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(f"{out}_text_document")
    assert [ds[0].tolist(), ds[1].tolist()] == [[1, 2, 3], [4, 5]]
    r = run("--input", str(files / "nums.jsonl"), "--output-prefix", str(out),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "4")
    assert r.returncode == 2 and "line 2: token id 5 outside the vocab of 4" in r.stderr


@pytest.mark.parametrize("mode,expected_docs", [("file", 1), ("paragraph", 3), ("line", 3)])
def test_plain_text(files, mode, expected_docs):
    out = files / f"plain_{mode}"
    r = run("--input", str(files / "plain.txt"), "--output-prefix", str(out),
            "--tokenizer-type", "ByteLevelTokenizer", "--text-docs", mode)
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(f"{out}_text_document")
    assert ds.num_documents == expected_docs
    text = (files / "plain.txt").read_bytes()
    if mode == "file":
        assert bytes(ds[0].tolist()) == text  # the whole file, byte for byte, no eod
    else:
        assert [bytes(ds[i].tolist()).decode() for i in range(3)] == [t for t in DOCS if t]


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs(files):
    bl = ["--tokenizer-type", "ByteLevelTokenizer", "--output-prefix", str(files / "bad")]
    one_line_error(run("--input", str(files / "missing.jsonl"), *bl), "missing.jsonl", "does not exist")
    (files / "empty.txt").write_text("")
    one_line_error(run("--input", str(files / "empty.txt"), *bl), "empty.txt", "is empty")
    (files / "blank.jsonl").write_text("\n\n")
    one_line_error(run("--input", str(files / "blank.jsonl"), *bl), "no text to tokenize")
    (files / "broken.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n{"text": "ok"}\n')
    one_line_error(run("--input", str(files / "broken.jsonl"), *bl, "--workers", "2"), "line 3", "malformed JSON")
    assert not (files / "bad_text_document.bin").exists()  # no half-written output left behind
    (files / "latin.txt").write_bytes(b"caf\xe9 au lait\n")
    one_line_error(run("--input", str(files / "latin.txt"), *bl), "latin.txt", "not UTF-8")
    (files / "nokey.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    one_line_error(run("--input", str(files / "nokey.jsonl"), *bl), "line 2", "missing key 'text'")
    one_line_error(run("--input", str(files / "docs.jsonl"), "--tokenizer-type", "SentencePieceTokenizer",
                       "--output-prefix", str(files / "bad")), "--tokenizer-model")
    one_line_error(run("--input", str(files / "docs.jsonl"), "--tokenizer-type", "SentencePieceTokenizer",
                       "--tokenizer-model", str(files / "nope.model"), "--output-prefix", str(files / "bad")),
                   "--tokenizer-model", "nope.model")
