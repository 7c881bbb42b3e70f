"""Hugging Face checkpoints <-> megalite: files, and dispatch to per-model adapters.

The mapping of each model family lives in ``megalite.checkpointing.hf_adapters`` (Llama,
Mistral, Qwen2, Qwen3, Mixtral, Phi-3, SmolLM3, OLMo 2, ...); this module reads and writes
safetensors directories and picks the adapter by the Hugging Face ``architectures``
(import) or by what the megalite model is (export).  Only the ``safetensors`` package is
used (no ``transformers`` import, no network).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megalite.checkpointing import hf_files
from megalite.config import checkpoint_folders
from megalite.checkpointing.hf_adapters import (HFAdapter, UnsupportedModelError,  # noqa: F401
                                                adapter_for_hf, adapter_for_model)
from megalite.errors import CheckpointError


# -- one-call mappings (dispatch through the registry) ------------------------------------

def hf_config_to_model_config(hf: dict) -> dict:
    """HF config.json -> a complete ``ModelConfig`` dict."""
    return adapter_for_hf(hf).config_from_hf(hf)


def model_config_to_hf_config(m: dict, torch_dtype: str = "float32") -> dict:
    """megalite model flags -> HF config.json (raises if no adapter fits the model)."""
    return adapter_for_model(m).config_to_hf(m, torch_dtype)


def hf_to_megalite_state_dict(hf_sd: Dict[str, torch.Tensor], m: dict) -> Dict[str, torch.Tensor]:
    return adapter_for_model(m).from_hf(hf_sd, m)


def megalite_to_hf_state_dict(sd: Dict[str, torch.Tensor], m: dict,
                              dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    return adapter_for_model(m).to_hf(sd, m, dtype)


# -- files -------------------------------------------------------------------------------------

def load_hf_checkpoint(directory: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """config.json + model.safetensors (or a sharded safetensors index)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Hugging Face directory '{directory}' does not exist")
    cfg_path = os.path.join(directory, checkpoint_folders.CONFIG)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"'{directory}' has no config.json")
    try:
        with open(cfg_path) as f:
            hf_cfg = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"'{cfg_path}' is not valid JSON ({exc}); download it again") \
            from None
    single = os.path.join(directory, checkpoint_folders.WEIGHTS)
    index = os.path.join(directory, checkpoint_folders.WEIGHTS_INDEX)
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"'{directory}' has no model.safetensors (only safetensors "
                                "checkpoints are supported)")
    sd: Dict[str, torch.Tensor] = {}
    for path in files:
        sd.update(_read_safetensors(path))
    return hf_cfg, sd


def _read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """One safetensors file; a truncated or damaged one is a ``CheckpointError`` naming it
    (safetensors raises its own ``SafetensorError``, not an OSError)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"'{path}' (named by the safetensors index) does not exist; "
                              "download the checkpoint again")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"'{path}' is not a readable safetensors file ({exc}); it is "
                              "probably truncated: download or copy it again") from None


def save_hf_checkpoint(directory: str, hf_cfg: dict, hf_sd: Dict[str, torch.Tensor]) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    save_file(hf_sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def import_hf(directory: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """HF directory -> (megalite model config dict, full megalite state dict), through the
    adapter registered for its architecture."""
    hf_cfg, hf_sd = load_hf_checkpoint(directory)
    adapter = adapter_for_hf(hf_cfg)
    m = adapter.config_from_hf(hf_cfg)
    return m, adapter.from_hf(hf_sd, m)


def export_hf(directory: str, model_cfg: dict, full_sd: Dict[str, torch.Tensor],
              dtype: torch.dtype = torch.float32, architecture: Optional[str] = None,
              side: Optional[dict] = None) -> HFAdapter:
    """Full megalite state dict -> HF directory (config.json + model.safetensors +
    generation_config.json), through the adapter of ``architecture`` or else the first
    registered adapter that can write the model; returns that adapter.  ``side``: what the
    import recorded (``hf_files.side_files_record``): its special token ids go into
    config.json and its tokenizer files are copied beside the weights."""
    adapter = adapter_for_model(model_cfg, architecture)
    hf_cfg = adapter.config_to_hf(model_cfg, str(dtype).replace("torch.", ""))
    hf_cfg.update((side or {}).get("token_ids", {}))
    save_hf_checkpoint(directory, hf_cfg, adapter.to_hf(full_sd, model_cfg, dtype))
    hf_files.write_side_files(directory, side)
    return adapter
