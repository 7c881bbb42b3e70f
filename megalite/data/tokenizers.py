"""Tokenizers behind one small interface, selected by Megatron's ``--tokenizer-type`` names.

Every tokenizer exposes ``vocab_size``, ``eod`` (the id appended between documents),
``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``. The preprocessing tool
and the training loop only ever talk to that interface.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

import sentencepiece as spm

from megalite.data.tiktoken_models import Llama3Tokenizer, TikTokenizer
from megalite.errors import ConfigError, DataError

__all__ = [
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "CharacterTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "Llama3Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "build_tokenizer",
    "build_tokenizer_from_config",
    "train_char_tokenizer",
    "train_sentencepiece",
]


def _require_file(path: str | None, tokenizer_type: str, hint: str = "") -> str:
    """Fail early, naming the flag, instead of deep inside a third-party loader."""
    if not path:
        raise FileNotFoundError(
            f"{tokenizer_type} needs a tokenizer file: pass --tokenizer-model PATH{hint}"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--tokenizer-model {path!r} does not exist (needed by {tokenizer_type}){hint}"
        )
    return path


class ByteLevelTokenizer:
    """UTF-8 bytes as ids 0..255 plus an end-of-document id 256; needs no file."""

    name = "ByteLevelTokenizer"

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class CharacterTokenizer:
    """One id per character of a fixed alphabet (nanoGPT's shakespeare-char style).

    The alphabet lives in a small JSON file made by :func:`train_char_tokenizer`, so ids are
    stable across runs. Ids: alphabet ``0..n-1``, ``eod = n``, ``unk = n + 1`` (any character
    not in the alphabet).
    """

    name = "CharacterTokenizer"

    def __init__(self, vocab_file: str | None) -> None:
        path = _require_file(
            vocab_file,
            self.name,
            " (build one with: python -m megalite.data.train_tokenizer --type char ...;"
            " or use --tokenizer-type ByteLevelTokenizer, which needs no file)",
        )
        try:
            with open(path, encoding="utf-8") as f:
                spec = json.load(f)
            chars = spec["chars"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--tokenizer-model {path!r} is not a character-tokenizer JSON file "
                f"(expected an object with a 'chars' list): {e}"
            ) from None
        if not isinstance(chars, list) or any(not isinstance(c, str) or len(c) != 1 for c in chars):
            raise ValueError(f"--tokenizer-model {path!r}: 'chars' must be a list of single characters")
        if len(set(chars)) != len(chars):
            raise ValueError(f"--tokenizer-model {path!r}: 'chars' has duplicates")
        self.chars = list(chars)
        self._ids = {c: i for i, c in enumerate(self.chars)}
        self.eod = len(self.chars)
        self.unk = len(self.chars) + 1
        self.vocab_size = len(self.chars) + 2

    def tokenize(self, text: str) -> list[int]:
        ids, unk = self._ids, self.unk
        return [ids.get(c, unk) for c in text]

    def detokenize(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if 0 <= i < self.eod:
                out.append(self.chars[i])
            elif i == self.unk:
                out.append("\ufffd")
        return "".join(out)


class NullTokenizer:
    """Text is already token ids separated by spaces (Megatron's NullTokenizer).

    ``vocab_size`` is the given size and the last id is the end-of-document id. (Megatron
    instead reserves one extra id past ``--vocab-size``; here the model vocab is exactly
    ``--vocab-size``.)
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError("NullTokenizer needs --vocab-size N (N >= 2)")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(
                "NullTokenizer expects text made of integer token ids separated by spaces"
            ) from None

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer:
    """A sentencepiece ``.model`` file.

    ``eod`` is the model's ``</s>`` (eos) id. A model trained without eos gets one extra id
    past its pieces (``vocab_size = pieces + 1``) so documents can still be separated.
    """

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str | None) -> None:
        path = _require_file(model_file, self.name)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"--tokenizer-model {path!r} is not a sentencepiece model: {e}") from None
        self._pieces = self.sp.get_piece_size()
        eos = self.sp.eos_id()
        if 0 <= eos < self._pieces:
            self.eod = eos
            self.vocab_size = self._pieces
        else:
            self.eod = self._pieces
            self.vocab_size = self._pieces + 1

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self._pieces])


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained``).

    Imported lazily so megalite never needs ``transformers`` unless this type is used.
    ``eod`` is the tokenizer's eos id (else an extra id past its vocab).
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, model_path: str | None) -> None:
        path = _require_file(model_path, self.name)
        try:
            # optional dependency: transformers (--tokenizer-type HuggingFaceTokenizer)
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError("HuggingFaceTokenizer needs the 'transformers' package") from None
        self.tok = AutoTokenizer.from_pretrained(path)
        n = len(self.tok)
        eos = self.tok.eos_token_id
        if eos is not None and 0 <= eos < n:
            self.eod, self.vocab_size = int(eos), n
        else:
            self.eod, self.vocab_size = n, n + 1

    def tokenize(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids if int(i) < len(self.tok)])


# Megatron-LM's tokenizer types on the well-kept libraries (no hand-written BPE):
# GPT2BPETokenizer (--vocab-file vocab.json --merge-file merges.txt, through `tokenizers`;
# eod is <|endoftext|>), Llama2Tokenizer (sentencepiece; <s> before each document, eod </s>),
# GPTSentencePieceTokenizer (sentencepiece without bos).
class GPT2BPETokenizer:
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        for path, flag in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer needs {flag} FILE (got {path!r})")
        # optional dependency: tokenizers (the Hugging Face tokenizers package)
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
        self.tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        self.vocab_size = len(vocab)
        self.eod = vocab.get("<|endoftext|>", self.vocab_size - 1)

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    name = "GPTSentencePieceTokenizer"


class Llama2Tokenizer(SentencePieceTokenizer):
    name = "Llama2Tokenizer"

    def tokenize(self, text: str) -> list[int]:
        bos = self.sp.bos_id()
        return ([bos] if bos >= 0 else []) + list(self.sp.encode(text))


TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "CharacterTokenizer",
    "ByteLevelTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "Llama2Tokenizer",
    "GPTSentencePieceTokenizer",
    "TikTokenizer",
    "Llama3Tokenizer",
)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, tiktoken_pattern: str | None = None,
                    tiktoken_num_special_tokens: int = 1000,
                    tiktoken_special_tokens: Sequence[str] | None = None):
    """Build a tokenizer from Megatron-style ``--tokenizer-type/--tokenizer-model/--vocab-size``
    (``--vocab-file/--merge-file`` for GPT-2 BPE, ``--tiktoken-*`` for TikTokenizer)."""
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size,
                            tiktoken_num_special_tokens, tiktoken_special_tokens)
    if tokenizer_type == "Llama3Tokenizer":
        return Llama3Tokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "CharacterTokenizer":
        return CharacterTokenizer(tokenizer_model)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of: {', '.join(TOKENIZER_TYPES)}"
    )


def build_tokenizer_from_config(data, vocab_size: int | None = None):
    """The tokenizer a run's ``DataConfig`` (or the preprocessing tool's arguments) names;
    None without ``--tokenizer-type``. One place maps flags to the constructor.

    The constructors' complaints are about the user's files and flags (a file that is not a
    sentencepiece model, a tiktoken file with gaps, a missing package): each becomes one
    ``DataError`` line naming ``--tokenizer-model`` (or the flag it names)."""
    if not getattr(data, "tokenizer_type", None):
        return None
    try:
        return build_tokenizer(
            data.tokenizer_type, data.tokenizer_model, vocab_size,
            getattr(data, "vocab_file", None), getattr(data, "merge_file", None),
            getattr(data, "tiktoken_pattern", None),
            getattr(data, "tiktoken_num_special_tokens", None) or 1000,
            getattr(data, "tiktoken_special_tokens", None))
    except ImportError as exc:
        raise ConfigError(f"--tokenizer-type {data.tokenizer_type}: {exc}") from None
    except (ValueError, OSError) as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if not text.startswith("--") and "NullTokenizer" not in text:
            where = data.tokenizer_model or getattr(data, "vocab_file", None) or ""
            text = f"--tokenizer-model {where!r} ({data.tokenizer_type}): {text}"
        raise DataError(text) from None


def _check_inputs(files: Sequence[str]) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = [os.fspath(f) for f in files]
    if not files:
        raise ValueError("no input files given")
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"input file {f!r} does not exist")
    return files


def train_char_tokenizer(text_files: Sequence[str], out_path: str) -> CharacterTokenizer:
    """Write the sorted set of characters seen in ``text_files`` as a CharacterTokenizer JSON."""
    chars: set[str] = set()
    for path in _check_inputs(text_files):
        with open(path, encoding="utf-8") as f:
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                chars.update(block)
    if not chars:
        raise ValueError(f"input {list(text_files)} is empty: no characters to build a vocabulary from")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"type": "CharacterTokenizer", "chars": sorted(chars)}, f, ensure_ascii=False)
        f.write("\n")
    return CharacterTokenizer(out_path)


def train_sentencepiece(
    input_files: Sequence[str], model_prefix: str, vocab_size: int, model_type: str = "bpe"
) -> SentencePieceTokenizer:
    """Train a sentencepiece model on plain-text files; writes ``{model_prefix}.model/.vocab``.

    Ids follow sentencepiece defaults (unk 0, bos 1, eos 2), so ``eod`` is 2. Text round-trips
    exactly (newlines and runs of spaces included); the vocab must hold every character seen.
    """
    files = _check_inputs(input_files)
    if model_type not in ("bpe", "unigram", "char", "word"):
        raise ValueError(f"unknown sentencepiece model type {model_type!r}")
    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=",".join(files),
            model_prefix=model_prefix,
            vocab_size=int(vocab_size),
            model_type=model_type,
            character_coverage=1.0,
            # lossless: keep newlines and repeated spaces, no unicode normalization
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            user_defined_symbols=["\n"],
            allow_whitespace_only_pieces=True,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed (vocab size {vocab_size}): {e}") from None
    return SentencePieceTokenizer(model_prefix + ".model")
