"""Bad data stops a run before it trains on garbage (issue 15): token ids outside the
vocabulary are an error naming the file (at TP>1 the vocab-parallel embedding would map
them to zero vectors silently); NaN/Inf or negative blend weights are refused at
validation."""
import numpy as np
import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.data.gpt_dataset import build_train_valid_test_datasets
from megalite.data.indexed_dataset import write_documents
from megalite.errors import DataError


def test_token_id_beyond_vocabulary_names_the_dataset(tmp_path):
    prefix = str(tmp_path / "ds")
    docs = [np.arange(50) % 90 for _ in range(20)]
    docs[7] = np.array([1, 2, 100, 3] * 10)
    write_documents(prefix, docs)
    with pytest.raises(DataError, match=r"ds\.bin: token id 100 at position \d+ is outside "
                                         r"the vocabulary \(size 100\)"):
        build_train_valid_test_datasets(data_path=[prefix], split="100,0,0", seq_length=8,
                                        seed=1, num_samples=(10, 0, 0), mock=False,
                                        vocab_size=100, cache_dir=str(tmp_path))
    build_train_valid_test_datasets(data_path=[prefix], split="100,0,0", seq_length=8, seed=1,
                                    num_samples=(10, 0, 0), mock=False, vocab_size=101,
                                    cache_dir=str(tmp_path))


@pytest.mark.parametrize("weight", ["nan", "inf", "-0.5"])
def test_bad_blend_weights_refused_at_validation(tmp_path, weight):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for p in (a, b):
        write_documents(p, [np.arange(20)] * 4)
    with pytest.raises(ConfigError, match=f"--data-path weight '{weight}' must be a finite"):
        parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "16", "--lr", "1e-3", "--train-iters", "1",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                    "--data-path", weight, a, "1.0", b])
