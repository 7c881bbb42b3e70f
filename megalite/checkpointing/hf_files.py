"""The files beside a Hugging Face checkpoint's weights that an export carries over: the
tokenizer and generation files the import recorded, and the special token ids, so that
``AutoTokenizer`` + ``AutoModelForCausalLM`` + ``generate`` work on an exported folder alone
(``tools/checkpoint/convert.py``; the folder's own names are ``config/checkpoint_folders.py``).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import List, Optional

from megalite.config.checkpoint_folders import CONFIG

GENERATION_CONFIG = "generation_config.json"
# the files ``AutoTokenizer.from_pretrained`` reads, whichever tokenizer kind a model has
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def side_files_record(directory: str) -> dict:
    """What an export needs beside the weights, read at import: the special token ids of
    config.json, and which tokenizer / generation files the folder holds and where it is
    (the files are copied from there at export, so the exported folder loads with
    ``AutoTokenizer`` and generates on its own)."""
    try:
        with open(os.path.join(directory, CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = {}
    names = TOKENIZER_FILES + (GENERATION_CONFIG,)
    return {"source": os.path.abspath(directory),
            "files": [n for n in names if os.path.isfile(os.path.join(directory, n))],
            "token_ids": {k: cfg[k] for k in TOKEN_ID_KEYS if cfg.get(k) is not None}}


def export_record(extra: dict) -> Optional[dict]:
    """What goes beside an exported checkpoint's weights, from its metadata ``extra``: the
    import's record (``extra["hf"]``), else, for a checkpoint trained with a Hugging Face
    tokenizer folder (a training save keeps only the tokenizer), that folder as it is now."""
    if extra.get("hf"):
        return extra["hf"]
    tok = (extra.get("tokenizer") or {}).get("tokenizer_model")
    if tok and os.path.isdir(tok):
        return side_files_record(tok)
    return None


def missing_side_files(record: Optional[dict]) -> List[str]:
    """The recorded files no longer at their source (moved or deleted since the import)."""
    if not record:
        return []
    return [os.path.join(record["source"], n) for n in record.get("files", ())
            if not os.path.isfile(os.path.join(record["source"], n))]


def write_side_files(directory: str, record: Optional[dict]) -> None:
    """Copy the recorded tokenizer / generation files that still exist into ``directory``;
    without a recorded generation_config.json, write one from the token ids (what
    transformers derives from config.json), so ``generate`` finds its stop token."""
    record = record or {}
    source, files = record.get("source", ""), list(record.get("files", ()))
    for name in files:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(directory, name))
    if GENERATION_CONFIG not in files or \
            not os.path.isfile(os.path.join(source, GENERATION_CONFIG)):
        with open(os.path.join(directory, GENERATION_CONFIG), "w") as f:
            json.dump({"_from_model_config": True, **record.get("token_ids", {})}, f,
                      indent=2, sort_keys=True)
