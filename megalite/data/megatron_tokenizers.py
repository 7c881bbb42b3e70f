"""Megatron-LM's tokenizer types on the well-kept libraries (no hand-written BPE).

* ``GPT2BPETokenizer``: ``--vocab-file vocab.json --merge-file merges.txt`` through
  ``tokenizers`` (byte-level BPE, GPT-2's pre-tokenizer); ``eod`` is ``<|endoftext|>``.
* ``Llama2Tokenizer``: a sentencepiece model; like Megatron's it prepends ``<s>`` (bos) to
  each document and uses ``</s>`` (eos) as ``eod``.
* ``GPTSentencePieceTokenizer``: a sentencepiece model without bos (Megatron's name).
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from megalite.data.tokenizers import SentencePieceTokenizer


class GPT2BPETokenizer:
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        for path, flag in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer needs {flag} FILE (got {path!r})")
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
