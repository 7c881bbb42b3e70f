"""Data pipeline: tokenizers, Megatron-format indexed datasets, GPT datasets, blending, samplers.

See docs/data.md. The training loop needs only :func:`build_tokenizer`,
:func:`build_train_valid_test_datasets` and :func:`build_data_iterator`.

Names are imported lazily so ``tools/preprocess_data.py`` (numpy only) starts without
importing torch.
"""

import importlib

_EXPORTS = {
    "BlendedDataset": "gpt_dataset",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "build_train_valid_test_datasets": "gpt_dataset",
    "parse_data_path": "gpt_dataset",
    "parse_split": "gpt_dataset",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "best_dtype": "indexed_dataset",
    "write_documents": "indexed_dataset",
    "RandomWindowDataset": "random_windows",
    "PretrainingSampler": "samplers",
    "build_data_iterator": "samplers",
    "collate_samples": "samplers",
    "TOKENIZER_TYPES": "tokenizers",
    "build_tokenizer": "tokenizers",
    "build_tokenizer_from_config": "tokenizers",
    "train_char_tokenizer": "tokenizers",
    "train_sentencepiece": "tokenizers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
