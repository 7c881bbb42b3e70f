"""What a Hugging Face checkpoint folder holds, without torch: its file names, the tokenizer
and generation files an export copies, and the one line that tells a user who passes one
to ``--load`` to convert it first (the training format is DCP;
``tools/checkpoint/convert.py`` writes it)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
from typing import List, Optional

from megalite.checkpointing.manifest import MARKER

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def weight_files(directory: str) -> List[str]:
    """The safetensors names a Hugging Face folder holds (empty when it holds none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(".safetensors") or n == WEIGHTS_INDEX)


def is_hf_checkpoint(directory: str) -> bool:
    """config.json beside safetensors weights, and no megalite marker."""
    return (os.path.isfile(os.path.join(directory, CONFIG)) and bool(weight_files(directory))
            and not os.path.isfile(os.path.join(directory, MARKER)))


def not_converted_problem(flag: str, directory: str) -> Optional[str]:
    """The line for a Hugging Face folder given where a megalite checkpoint belongs, or None."""
    if not is_hf_checkpoint(directory):
        return None
    target = os.path.normpath(directory) + "-megalite"
    cmd = ["python", "tools/checkpoint/convert.py", "--source-format", "hf",
           "--target-format", "megalite", "--load-dir", directory, "--save-dir", target]
    return f"{flag}: '{directory}' is a Hugging Face checkpoint (config.json + safetensors), " \
           f"not a megalite one; convert it first: {' '.join(map(shlex.quote, cmd))}, then " \
           f"{flag} {shlex.quote(target)} --use-checkpoint-args"


# -- what a Hugging Face folder holds beside the weights (kept through a conversion) --------

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
