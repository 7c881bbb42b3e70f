"""Train a tokenizer on plain-text files.

    python -m megalite.data.train_tokenizer --input data/tinyshakespeare.txt \\
        --model-prefix data/shakespeare_bpe --vocab-size 2000            # -> .model/.vocab
    python -m megalite.data.train_tokenizer --input data/tinyshakespeare.txt \\
        --model-prefix data/shakespeare_char --type char                 # -> .json

Prints the ``--tokenizer-type/--tokenizer-model`` flags to pass to preprocessing and training.
"""

from __future__ import annotations

import argparse
import sys

from megalite.data.tokenizers import train_char_tokenizer, train_sentencepiece


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megalite.data.train_tokenizer",
                                description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="plain-text file(s)")
    p.add_argument("--model-prefix", required=True, help="output path without extension")
    p.add_argument("--vocab-size", type=int, default=None, help="required for bpe/unigram")
    p.add_argument("--type", choices=("bpe", "unigram", "char"), default="bpe")
    args = p.parse_args(argv)
    try:
        if args.type == "char":
            out = args.model_prefix + ".json"
            tok = train_char_tokenizer(args.input, out)
            flags = f"--tokenizer-type CharacterTokenizer --tokenizer-model {out}"
        else:
            if args.vocab_size is None:
                p.error(f"--vocab-size is required for --type {args.type}")
            tok = train_sentencepiece(args.input, args.model_prefix, args.vocab_size, args.type)
            flags = f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {args.model_prefix}.model"
    except (OSError, ValueError) as e:
        print(f"train_tokenizer: error: {e}", file=sys.stderr)
        return 2
    print(f"vocab size {tok.vocab_size}, eod id {tok.eod}; use: {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
