"""Tokenizers on OpenAI's ``tiktoken`` BPE: Megatron's ``TikTokenizer`` and Meta's Llama 3.

Two file formats exist and both are read here (the BPE itself is ``tiktoken.Encoding``):

* ``TikTokenizer`` (Megatron-LM, ``--tiktoken-pattern v1|v2``): a JSON list of
  ``{"rank", "token_bytes" (base64), "token_str"}``. The first ``--tiktoken-num-special-tokens``
  ids are special tokens (``<unk>``, ``<s>``, ``</s>``, then ``<SPECIAL_i>`` fillers); the BPE
  ranks follow, shifted by that count. ``eod`` is ``</s>``.
* ``Llama3Tokenizer`` (Meta's ``tokenizer.model``): one ``base64-token rank`` per line, the
  Llama 3 split pattern, and 256 special tokens after the BPE ranks (``<|begin_of_text|>``
  first). Each document starts with ``<|begin_of_text|>``; ``eod`` is ``<|end_of_text|>``.

Text is encoded as ordinary text (``encode_ordinary``): a document that contains the string
``</s>`` or ``<|eot_id|>`` gets the ids of those characters, never a control id, as
Megatron-LM's ``CustomTikTokenizer`` and Meta's ``Tokenizer.encode`` do by default.
"""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, Iterable, List, Optional

__all__ = ["DEFAULT_TIKTOKEN_VOCAB", "LLAMA3_PATTERN", "Llama3Tokenizer", "TIKTOKEN_PATTERNS",
           "TikTokenizer", "read_llama3_ranks", "read_megatron_ranks", "write_megatron_ranks"]

# Megatron-LM's two split patterns (megatron/training/tokenizer/tokenizer.py).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_TIKTOKEN_VOCAB = 2 ** 17          # Megatron's fallback when --vocab-size is absent
MEGATRON_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256


def llama3_special_tokens() -> List[str]:
    """Meta's Llama 3 special tokens, in id order (ids start after the BPE ranks)."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
             "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|reserved_special_token_4|>", "<|eot_id|>"]
    return named + [f"<|reserved_special_token_{i}|>"
                    for i in range(5, LLAMA3_NUM_SPECIAL - 5)]


def _existing(path: Optional[str], name: str) -> str:
    if not path:
        raise FileNotFoundError(f"{name} needs a tokenizer file: pass --tokenizer-model PATH")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {path!r} does not exist (needed by {name})")
    return path


def _check_ranks(ranks: Dict[bytes, int], path: str) -> None:
    """tiktoken needs ranks 0..n-1 with every single byte present (any text must encode)."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path!r}: BPE ranks are not 0..{len(ranks) - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"--tokenizer-model {path!r}: {len(missing)} single bytes have no "
                         f"rank (e.g. {missing[0]}); a byte-level BPE file lists all 256")


def read_megatron_ranks(path: str, max_vocab: Optional[int] = None) -> Dict[bytes, int]:
    """BPE ranks of a Megatron TikTokenizer JSON file (first ``max_vocab`` entries)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        if not isinstance(entries, list):
            raise ValueError("expected a JSON list")
        if max_vocab is not None:
            entries = entries[:max_vocab]
        ranks = {}
        for i, e in enumerate(entries):
            if e["rank"] != i:
                raise ValueError(f"entry {i} has rank {e['rank']}")
            ranks[base64.b64decode(e["token_bytes"])] = i
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--tokenizer-model {path!r} is not a Megatron TikTokenizer JSON file "
                         f"(a list of {{rank, token_bytes, token_str}}): {exc}") from None
    _check_ranks(ranks, path)
    return ranks


def write_megatron_ranks(ranks: Dict[bytes, int], path: str) -> None:
    """Write BPE ranks in Megatron's TikTokenizer JSON format (what its tools produce)."""
    entries = [{"rank": r, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")}
               for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)


def read_llama3_ranks(path: str) -> Dict[bytes, int]:
    """BPE ranks of a tiktoken ``.model``/``.tiktoken`` file (``base64 rank`` per line).

    Read here rather than with ``tiktoken.load.load_tiktoken_bpe``, which caches local files
    by path name and would serve a stale copy after the file is replaced in place."""
    ranks = {}
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer-model {path!r} is not a tiktoken BPE file "
                         f"('base64-token rank' per line): line {n}: {exc}") from None
    _check_ranks(ranks, path)
    return ranks


def _encoding(name: str, pattern: str, ranks: Dict[bytes, int], special: Dict[str, int]):
    try:
        # optional dependency: tiktoken (the tiktoken extra)
        import tiktoken
    except ImportError:
        raise ImportError(f"{name} needs the 'tiktoken' package: pip install tiktoken") from None
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens=special)


class TikTokenizer:
    """Megatron-LM's ``--tokenizer-type TikTokenizer``: special ids first, BPE after.

    ``vocab_size`` is ``--vocab-size`` (the file is cut to ``vocab_size - num_special_tokens``
    ranks, as Megatron does); without it, Megatron's 2**17, or the file's own size plus the
    special tokens when the file is smaller (where Megatron would stop on an assertion).
    """

    name = "TikTokenizer"

    def __init__(self, path: Optional[str], pattern: Optional[str] = None,
                 vocab_size: Optional[int] = None, num_special_tokens: int = 1000,
                 special_tokens: Optional[List[str]] = None) -> None:
        path = _existing(path, self.name)
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        special = list(special_tokens) if special_tokens else list(MEGATRON_SPECIAL_TOKENS)
        if len(set(special)) != len(special):
            raise ValueError(f"--tiktoken-special-tokens has duplicates: {special}")
        lacking = [t for t in MEGATRON_SPECIAL_TOKENS if t not in special]
        if lacking:
            raise ValueError(f"--tiktoken-special-tokens must include {MEGATRON_SPECIAL_TOKENS}"
                             f" (missing {lacking})")
        if num_special_tokens < len(special):
            raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} is fewer than "
                             f"the {len(special)} special tokens")
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        limit = (vocab_size or DEFAULT_TIKTOKEN_VOCAB) - num_special_tokens
        if limit < 256:
            raise ValueError(f"--vocab-size {vocab_size} leaves {limit} BPE ids after "
                             f"{num_special_tokens} special tokens; it needs at least 256")
        ranks = read_megatron_ranks(path, max_vocab=limit)
        if vocab_size is not None and len(ranks) < limit:
            raise ValueError(f"--vocab-size {vocab_size}: {path!r} has only {len(ranks)} BPE "
                             f"ranks, not the {limit} that vocab minus "
                             f"{num_special_tokens} special tokens needs")
        shifted = {t: r + num_special_tokens for t, r in ranks.items()}
        ids = {t: i for i, t in enumerate(special)}
        self.enc = _encoding(os.path.basename(path), TIKTOKEN_PATTERNS[pattern], shifted, ids)
        self.num_special_tokens = num_special_tokens
        self.special_tokens = special
        self.vocab_size = num_special_tokens + len(ranks)
        self.bos, self.eod, self.unk = ids["<s>"], ids["</s>"], ids["<unk>"]

    def tokenize(self, text: str) -> List[int]:
        return self.enc.encode_ordinary(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])


class Llama3Tokenizer:
    """Meta's Llama 3 tokenizer from its local ``tokenizer.model`` (tiktoken format).

    Documents get ``<|begin_of_text|>`` first, as Megatron-LM's Llama3Tokenizer
    (``tokenize(s, bos=True, eos=False)``) gives them; ``eod`` is ``<|end_of_text|>``.
    """

    name = "Llama3Tokenizer"

    def __init__(self, path: Optional[str]) -> None:
        path = _existing(path, self.name)
        ranks = read_llama3_ranks(path)
        n = len(ranks)
        ids = {t: n + i for i, t in enumerate(llama3_special_tokens())}
        self.enc = _encoding(os.path.basename(path), LLAMA3_PATTERN, ranks, ids)
        self.vocab_size = n + LLAMA3_NUM_SPECIAL
        self.bos = ids["<|begin_of_text|>"]
        self.eod = ids["<|end_of_text|>"]
        self.eot = ids["<|eot_id|>"]

    def tokenize(self, text: str) -> List[int]:
        return [self.bos] + self.enc.encode_ordinary(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])
