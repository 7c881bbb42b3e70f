"""Tokenize a corpus into Megatron's ``.bin/.idx`` format (same flags as Megatron's tool).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

writes ``data/corpus_text_document.bin/.idx`` (one pair per ``--json-keys`` key); pass
``--data-path data/corpus_text_document`` to training.

Input format rule: a file ending in ``.jsonl``/``.json``, or whose first non-empty line is a
JSON object, is JSON lines (one document per line, text under each ``--json-keys`` key; blank
lines are skipped). Anything else is plain text, split by ``--text-docs``: ``file`` (default:
the whole file is one document, as nanoGPT treats it), ``paragraph`` (blank-line separated
blocks) or ``line``. Plain text is written under the first ``--json-keys`` key.
A document whose text tokenizes to nothing is left out (of that key's output).

Megatron's ``--split-sentences`` cuts each document into sentences (one sequence each, the
document boundaries kept; output ``{prefix}_{key}_sentence``) with a built-in rule-based
splitter (no nltk: see ``split_sentences``); ``--keep-newlines`` keeps the whitespace that
follows each sentence.  ``--partitions N`` deals the documents (of every file the ``--input``
glob matches) to N partitions as Megatron does -- round-robin, or in consecutive blocks with
``--keep-sequential-samples`` -- and writes them partition after partition: the output is the
file Megatron's merge of its partition outputs gives.
Bad input exits with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import re
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from megalite.data.indexed_dataset import IndexedDatasetBuilder, best_dtype  # noqa: E402
from megalite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer_from_config  # noqa: E402
from megalite.errors import DataError  # noqa: E402

PROG = "preprocess_data.py"


class InputError(DataError):
    """A problem with the user's input: reported as one line, exit status 2."""


def get_args(argv=None):
    from megalite.cli.arguments import OneLineErrorParser   # a bad flag: one line, exit 2

    p = OneLineErrorParser(prog=PROG, help_hint=f"{PROG} --help",
                           description="Tokenize a corpus into Megatron .bin/.idx files.")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines or plain-text file")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--text-docs", choices=("file", "paragraph", "line"), default="file",
                   help="plain text only: what one document is (default: the whole file)")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (writes {prefix}_{key}_sentence.bin/.idx)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences: keep the whitespace (newlines) after sentences")
    g.add_argument("--lang", default="english",
                   help="Megatron's nltk language; the built-in splitter is the same for all")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer file (sentencepiece .model, char .json, HF dir)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer vocab size; TikTokenizer: vocab incl. special tokens")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                   help="TikTokenizer split pattern (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved for special tokens")
    g.add_argument("--tiktoken-special-tokens", nargs="+", default=None,
                   help="TikTokenizer special tokens (must include <unk> <s> </s>)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1,
                   help="deal the documents to N partitions, written one after another "
                   "(Megatron's order); --input may then be a glob of files")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: consecutive blocks of documents, not round-robin")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.log_interval < 1:
        p.error("--log-interval must be >= 1")
    if args.partitions < 1:
        p.error("--partitions must be >= 1")
    if args.keep_newlines and not args.split_sentences:
        p.error("--keep-newlines keeps newlines between sentences: it needs --split-sentences")
    return args


# ---------------------------------------------------------------------------------------
# workers: parse + tokenize one document; errors come back as values so order is kept
# ---------------------------------------------------------------------------------------
_W: dict = {}


def _init_worker(tokenizer_args, keys, is_json, append_eod, sentences=None):
    _W["tok"] = build_tokenizer_from_config(tokenizer_args, tokenizer_args.vocab_size)
    _W.update(keys=keys, is_json=is_json, append_eod=append_eod, sentences=sentences)


def _encode(item):
    """``(where, raw bytes)`` -> ``(where, {key: [int64 tokens of each sequence]}, error or
    None, bytes read)``; ``where`` (file, line number) comes back as given."""
    lineno, raw = item
    lineno, out, error = _encode_text(lineno, raw)
    return lineno, out, error, len(raw)


# A sentence ends at . ! ? (or their CJK forms, or an ellipsis), possibly followed by closing
# quotes or brackets, where whitespace and then a non-lowercase character (or the end) follow.
_SENTENCE_END = re.compile(r"""[.!?\u2026\u3002\uff01\uff1f]+"""   # the end marks
                           r"""["'\u2019\u201d)\]]*"""              # closing quotes, brackets
                           r"""(?=\s+(?![a-z])|$)""")                 # then space + no lowercase
_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e",
                  "cf", "fig", "no", "vol", "ch", "sec"}


def split_sentences(text: str, keep_newlines: bool = False) -> list:
    """``text`` as sentences, without nltk: cut after a sentence end followed by whitespace
    and a character that is not lowercase, except after a known abbreviation or a single
    capital (an initial).  ``keep_newlines``: each sentence keeps the whitespace after it
    (so the sentences concatenate back to the text), as Megatron's punkt variable does;
    otherwise sentences are stripped.  Text without a sentence end is one sentence."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        word = text[start:m.start()].rsplit(None, 1)[-1] if text[start:m.start()].strip() else ""
        stem = word.lower().rstrip(".")
        if text[m.start()] == "." and (stem in _ABBREVIATIONS or
                                       (len(word) == 1 and word.isupper())):
            continue
        end = m.end()
        while keep_newlines and end < len(text) and text[end].isspace():
            end += 1
        out.append(text[start:end])
        start = end
    if start < len(text):
        out.append(text[start:])
    if not keep_newlines:
        out = [t.strip() for t in out]
    return [t for t in out if t.strip()]


def _encode_text(lineno, raw):
    tok, keys = _W["tok"], _W["keys"]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return lineno, None, f"not UTF-8 text ({e.reason} at byte {e.start})"
    if _W["is_json"]:
        try:
            obj = json.loads(text)
        except ValueError as e:
            return lineno, None, f"malformed JSON ({e})"
        if not isinstance(obj, dict):
            return lineno, None, f"expected a JSON object, got {type(obj).__name__}"
        texts = {}
        for k in keys:
            if k not in obj:
                return lineno, None, f"missing key {k!r} (see --json-keys)"
            if not isinstance(obj[k], str):
                return lineno, None, f"key {k!r} is {type(obj[k]).__name__}, expected a string"
            texts[k] = obj[k]
    else:
        texts = {keys[0]: text}
    out = {}
    for k, t in texts.items():
        parts = [t] if _W["sentences"] is None else split_sentences(t, _W["sentences"])
        seqs = []
        for part in parts:
            try:
                ids = tok.tokenize(part)
            except ValueError as e:
                return lineno, None, str(e)
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
                return lineno, None, (f"token id {int(arr.max())} outside the vocab of "
                                      f"{tok.vocab_size}")
            if arr.size:              # Megatron drops sentences of no tokens
                seqs.append(arr)
        if _W["append_eod"] and seqs:  # on the last sentence, as Megatron counts it
            seqs[-1] = np.append(seqs[-1], tok.eod)
        out[k] = seqs
    return lineno, out, None


# ---------------------------------------------------------------------------------------
# reading the input
# ---------------------------------------------------------------------------------------
def detect_json_lines(path: str) -> bool:
    if path.endswith((".jsonl", ".json")):
        return True
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line.decode("utf-8")), dict)
                except ValueError:
                    return False
    return False


def input_files(args) -> list:
    """The files ``--input`` names: one file, or with ``--partitions`` > 1 every file its glob
    matches (Megatron's rule), sorted so the output does not depend on the file system."""
    if args.partitions > 1:
        found = sorted(f for f in glob.glob(args.input) if os.path.isfile(f))
        if not found:
            raise InputError(f"--input {args.input!r} matches no file")
        return found
    if not os.path.exists(args.input):
        raise InputError(f"input file {args.input!r} does not exist")
    if not os.path.isfile(args.input):
        raise InputError(f"input {args.input!r} is not a file")
    return [args.input]


def partitioned_documents(files, text_docs: str, partitions: int, sequential: bool):
    """``(path, is_json, line number, raw bytes)`` of every document of ``files`` in the
    order Megatron's ``--partitions`` output has them: partition p holds documents
    p, p+N, p+2N, ... (round-robin over all files), or with ``sequential`` the p-th block of
    consecutive documents -- which is the input order, so one pass."""
    def every():
        for path in files:
            is_json = detect_json_lines(path)
            for lineno, raw in iter_documents(path, is_json, text_docs):
                yield path, is_json, lineno, raw
    if partitions == 1 or sequential:
        yield from every()
        return
    for p in range(partitions):              # one pass over the input per partition
        for i, doc in enumerate(every()):
            if i % partitions == p:
                yield doc


def iter_documents(path: str, is_json: bool, text_docs: str):
    """Yield ``(line number, raw bytes)`` per document."""
    if is_json:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
        return
    with open(path, "rb") as f:
        data = f.read()
    if text_docs == "file":
        yield 1, data
        return
    lines = data.split(b"\n")
    if text_docs == "line":
        for lineno, line in enumerate(lines, 1):
            if line.strip():
                yield lineno, line.rstrip(b"\r")
        return
    buf, first = [], 0
    for lineno, line in enumerate(lines + [b""], 1):
        if line.strip():
            first = first or lineno
            buf.append(line.rstrip(b"\r"))
        elif buf:  # a blank line closes the paragraph
            yield first, b"\n".join(buf)
            buf, first = [], 0


class Progress:
    """tqdm bar for big inputs on a terminal, else a log line every ``interval`` documents."""

    def __init__(self, total_bytes: int, interval: int) -> None:
        self.total, self.interval, self.start = total_bytes, interval, time.time()
        self.bytes = self.docs = 0
        self.bar = None
        if total_bytes >= (1 << 20) and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)

    def doc(self, nbytes: int) -> None:
        self.docs += 1
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(min(nbytes, self.total - self.bar.n))
        if self.bar is None and self.docs % self.interval == 0:
            dt = max(time.time() - self.start, 1e-9)
            print(f"processed {self.docs} documents ({self.docs / dt:.1f} docs/s, "
                  f"{self.bytes / dt / 2**20:.2f} MB/s)", file=sys.stderr, flush=True)

    def close(self, done: bool = False) -> None:
        if self.bar is not None:
            if done:  # blank lines and separators were never counted
                self.bar.update(self.total - self.bar.n)
            self.bar.close()


def tokenizer_args(args) -> argparse.Namespace:
    """The tokenizer flags alone (picklable for the worker processes)."""
    names = ("tokenizer_type", "tokenizer_model", "vocab_size", "vocab_file", "merge_file",
             "tiktoken_pattern", "tiktoken_num_special_tokens", "tiktoken_special_tokens")
    return argparse.Namespace(**{n: getattr(args, n) for n in names})


# ---------------------------------------------------------------------------------------
def run(args) -> list[str]:
    files = input_files(args)
    size = sum(os.path.getsize(f) for f in files)
    if size == 0:
        raise InputError(f"input file {args.input!r} is empty")
    tokenizer = build_tokenizer_from_config(args, args.vocab_size)   # DataError: one line
    kinds = {detect_json_lines(f) for f in files}
    if len(kinds) > 1:
        raise InputError(f"--input {args.input!r} mixes JSON-lines and plain-text files")
    is_json = kinds.pop()
    keys = args.json_keys if is_json else args.json_keys[:1]
    dtype = best_dtype(tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    level = "sentence" if args.split_sentences else "document"      # Megatron's naming
    prefixes = {k: f"{args.output_prefix}_{k}_{level}" for k in keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype) for k, p in prefixes.items()}
    written = {k: [] for k in keys}
    init = (tokenizer_args(args), keys, is_json, args.append_eod,
            args.keep_newlines if args.split_sentences else None)
    progress = Progress(size, args.log_interval)
    pool = None
    n_docs = n_skipped = n_tokens = n_sentences = 0
    ok = False
    try:
        docs = (((path, lineno), raw) for path, _, lineno, raw in partitioned_documents(
            files, args.text_docs, args.partitions, args.keep_sequential_samples))
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init)
            results = pool.imap(_encode, docs, chunksize=64)
        else:
            _init_worker(*init)
            results = map(_encode, docs)
        for (path, lineno), encoded, error, nbytes in results:
            if error is not None:
                where = f"line {lineno}" if is_json or args.text_docs != "file" else "input"
                raise InputError(f"{path}: {where}: {error}")
            for k, seqs in encoded.items():
                if not seqs:  # empty for this key: skipped in this key's output only
                    n_skipped += 1
                    continue
                for arr in seqs:
                    builders[k].add_item(arr)
                    n_tokens += int(arr.size)
                n_sentences += len(seqs)
                builders[k].end_document()
            n_docs += 1
            progress.doc(nbytes)
        if n_tokens == 0:
            raise InputError(f"input file {args.input!r} has no text to tokenize (empty after parsing)")
        for k, p in prefixes.items():
            builders[k].finalize(p + ".idx")
            written[k] = [p + ".bin", p + ".idx"]
        ok = True
    finally:
        progress.close(done=ok)
        if pool is not None:
            pool.terminate()
            pool.join()
        if not ok:  # never leave a half-written dataset behind
            for k, p in prefixes.items():
                builders[k]._file.close()
                for path in (p + ".bin", p + ".idx"):
                    if os.path.exists(path):
                        os.remove(path)
    dt = time.time() - progress.start
    skipped = f", skipped {n_skipped} empty texts" if n_skipped else ""
    if args.split_sentences:
        skipped += f", {n_sentences} sentences"
    if args.partitions > 1:
        skipped += f" from {len(files)} file(s) in {args.partitions} partitions"
    print(f"{PROG}: {n_docs} documents{skipped}, {n_tokens} tokens ({np.dtype(dtype).name}) in {dt:.1f}s; "
          f"tokenizer {args.tokenizer_type} (vocab {tokenizer.vocab_size}, eod {tokenizer.eod})")
    for k, p in prefixes.items():
        print(f"  --data-path {p}")
    return [p for k in keys for p in written[k]]


def main(argv=None) -> int:
    """Behind megalite's boundary: a bad input is one line and exit status 2; Ctrl-C says
    that no half-written dataset was left."""
    from megalite.cli.boundary import run_cli

    return run_cli(_main, argv, prog=PROG)


def _main(argv=None) -> int:
    args = get_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        from megalite.errors import Interrupted

        raise Interrupted(f"interrupted by Ctrl-C: no output written for "
                          f"{args.output_prefix!r} (partial files removed)") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
