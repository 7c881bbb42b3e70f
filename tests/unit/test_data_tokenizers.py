"""Tokenizers: round trips, eod ids, training helpers and clear errors for missing files."""

import json

import pytest

from megalite.data.tokenizers import build_tokenizer, train_char_tokenizer, train_sentencepiece
from megalite.data.train_tokenizer import main as train_tokenizer_main

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TEXT * 40 + "The slings and arrows of outrageous fortune,\n" * 20)
    return str(path)


def test_byte_level():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert tok.vocab_size == 257 and tok.eod == 256
    ids = tok.tokenize("héllo")
    assert ids == list("héllo".encode("utf-8")) and len(ids) == 6
    assert tok.detokenize(ids + [tok.eod]) == "héllo"


def test_character_tokenizer(corpus, tmp_path):
    path = str(tmp_path / "char.json")
    tok = train_char_tokenizer([corpus], path)
    chars = sorted(set(open(corpus).read()))
    assert json.load(open(path))["chars"] == chars
    tok = build_tokenizer("CharacterTokenizer", path)
    assert tok.vocab_size == len(chars) + 2 and tok.eod == len(chars)
    ids = tok.tokenize("To be")
    assert ids == [chars.index(c) for c in "To be"]
    assert tok.detokenize(ids + [tok.eod]) == "To be"
    assert tok.tokenize("Z") == [tok.unk]  # not in the corpus


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 100 and tok.eod == 99
    assert tok.tokenize("3 14 15") == [3, 14, 15]
    assert tok.detokenize([3, 14, 15]) == "3 14 15"
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="integer token ids"):
        tok.tokenize("a b")


def test_sentencepiece(corpus, tmp_path):
    prefix = str(tmp_path / "sp")
    tok = train_sentencepiece([corpus], prefix, vocab_size=60, model_type="bpe")
    tok = build_tokenizer("SentencePieceTokenizer", prefix + ".model")
    assert tok.vocab_size == 60 and tok.eod == 2  # sentencepiece's </s>
    ids = tok.tokenize("that is the question")
    assert all(0 <= i < 60 for i in ids) and len(ids) < len("that is the question")
    assert tok.detokenize(ids + [tok.eod]) == "that is the question"
    assert tok.detokenize(tok.tokenize(TEXT + "\n  To")) == TEXT + "\n  To"  # lossless, newlines kept


def test_train_tokenizer_cli(corpus, tmp_path, capsys):
    assert train_tokenizer_main(["--input", corpus, "--model-prefix", str(tmp_path / "c"), "--type", "char"]) == 0
    assert "--tokenizer-type CharacterTokenizer" in capsys.readouterr().out
    assert (tmp_path / "c.json").exists()
    assert train_tokenizer_main(["--input", corpus, "--model-prefix", str(tmp_path / "b"), "--vocab-size", "50"]) == 0
    assert (tmp_path / "b.model").exists()
    assert train_tokenizer_main(["--input", str(tmp_path / "nope.txt"), "--model-prefix", "x", "--type", "char"]) == 2
    assert "nope.txt" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "CharacterTokenizer", "HuggingFaceTokenizer"])
def test_missing_tokenizer_file_names_the_flag(kind, tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(kind, None)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model.*missing.model"):
        build_tokenizer(kind, str(tmp_path / "missing.model"))


def test_bad_tokenizer_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{\"nochars\": 1}")
    with pytest.raises(ValueError, match="character-tokenizer JSON"):
        build_tokenizer("CharacterTokenizer", str(bad))
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        build_tokenizer("SentencePieceTokenizer", str(bad))
    with pytest.raises(ValueError, match="unknown --tokenizer-type"):
        build_tokenizer("GPT3Tokenizer")


def test_huggingface_tokenizer(corpus, tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    inner = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    inner.train([corpus], trainer)
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "hf")
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"))
    assert tok.eod == 1 and tok.vocab_size == len(tok.tok)
    ids = tok.tokenize("to be or not")
    assert tok.detokenize(ids) == "to be or not"
