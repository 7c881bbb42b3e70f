"""The Hugging Face adapter interface and its registry.

One adapter per model family maps a Hugging Face architecture (config.json + state dict)
to megalite's model config and full, unsharded state dict, and back (torchtitan's
per-model state-dict adapters).  ``import_hf`` / ``export_hf`` and
``tools/checkpoint/convert.py`` pick the adapter here: by the ``architectures`` (or
``model_type``) of a Hugging Face config, or by asking each adapter whether it can write
a megalite model.  Adding a family (Mixtral, Qwen, ...) is one module that registers an
adapter; nothing else changes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megalite.errors import CheckpointError


class UnsupportedModelError(CheckpointError, ValueError):
    """The checkpoint or config is not something this converter maps (a user error: one
    line naming the key; still a ValueError for callers that catch those)."""


class HFAdapter:
    """Maps one Hugging Face architecture family to megalite and back.

    Full state dicts on both sides: megalite's are keyed by global parameter names with
    logical (unpadded, unsharded) tensors, as ``full_state_dict_from_checkpoint`` gives."""
    family: str = ""                       # megalite model family, e.g. "llama"
    architectures: Tuple[str, ...] = ()    # HF "architectures" entries this adapter reads
    model_type: str = ""                   # HF "model_type"

    def config_from_hf(self, hf_cfg: dict) -> dict:
        """HF config.json -> a complete ``ModelConfig`` dict (raises if unsupported)."""
        raise NotImplementedError

    def export_problems(self, model_cfg: dict) -> List[str]:
        """What a megalite model lacks to be written as this architecture ([] = nothing)."""
        raise NotImplementedError

    def config_to_hf(self, model_cfg: dict, torch_dtype: str = "float32") -> dict:
        """``ModelConfig`` dict -> HF config.json (raises if ``export_problems``)."""
        raise NotImplementedError

    def from_hf(self, hf_sd: Dict[str, torch.Tensor], model_cfg: dict
                ) -> Dict[str, torch.Tensor]:
        """HF state dict -> full megalite state dict (fp32)."""
        raise NotImplementedError

    def to_hf(self, full_sd: Dict[str, torch.Tensor], model_cfg: dict,
              dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        """Full megalite state dict -> HF state dict (fresh tensors of ``dtype``)."""
        raise NotImplementedError


def softmax_router_problems(mc) -> List[str]:
    """What a ``ModelConfig``'s router lacks to be a Hugging Face softmax top-k gate (Mixtral,
    Qwen-MoE): no sigmoid scores, expert bias, scaling factor or group-limited routing."""
    return [msg for bad, msg in (
        (mc.moe_router_score_function != "softmax", "--moe-router-score-function softmax"),
        (mc.moe_router_enable_expert_bias, "no --moe-router-enable-expert-bias"),
        (mc.moe_router_topk_scaling_factor not in (None, 1.0),
         "no --moe-router-topk-scaling-factor"),
        (mc.moe_router_num_groups is not None, "no --moe-router-num-groups"),
        (mc.moe_apply_probs_on_input, "no --moe-apply-probs-on-input")) if bad]


_ADAPTERS: List[HFAdapter] = []


def register_adapter(adapter: HFAdapter) -> HFAdapter:
    """Add ``adapter`` to the registry (replacing one of the same family)."""
    if not adapter.family or not adapter.architectures:
        raise ValueError("an HF adapter needs a family and at least one architecture")
    unregister_adapter(adapter.family)
    _ADAPTERS.append(adapter)
    return adapter


def unregister_adapter(family: str) -> None:
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.family != family]


def registered_adapters() -> List[HFAdapter]:
    return list(_ADAPTERS)


def supported_architectures() -> List[str]:
    return [arch for a in _ADAPTERS for arch in a.architectures]


def adapter_for_family(family: str) -> HFAdapter:
    for adapter in _ADAPTERS:
        if adapter.family == family:
            return adapter
    raise UnsupportedModelError(f"no Hugging Face adapter for model family '{family}'; "
                                f"known: {', '.join(a.family for a in _ADAPTERS)}")


def adapter_for_hf(hf_cfg: dict) -> HFAdapter:
    """The adapter for a HF config: by ``architectures``, else by ``model_type``.  A
    quantized checkpoint (``quantization_config``: DeepSeek-V3's and Kimi K2's FP8 blocks)
    is refused for every family: its weights need their scales, which no adapter reads."""
    quant = hf_cfg.get("quantization_config")
    if quant:
        kind = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise UnsupportedModelError(
            f"quantization_config ({kind}) is not supported: megalite imports unquantized "
            "weights; convert the checkpoint to bf16 first")
    archs = hf_cfg.get("architectures") or []
    for adapter in _ADAPTERS:
        if archs and all(a in adapter.architectures for a in archs):
            return adapter
        if not archs and hf_cfg.get("model_type") == adapter.model_type:
            return adapter
    known = ", ".join(f"{arch} (model_type '{a.model_type}')"
                      for a in _ADAPTERS for arch in a.architectures)
    raise UnsupportedModelError(
        f"unsupported architecture {archs or hf_cfg.get('model_type')}; only {known} converts")


def adapter_for_architecture(architecture: str) -> HFAdapter:
    """The adapter that writes Hugging Face ``architecture`` (e.g. MistralForCausalLM)."""
    for adapter in _ADAPTERS:
        if architecture in adapter.architectures:
            return adapter
    raise UnsupportedModelError(f"no Hugging Face adapter writes '{architecture}'; known: "
                                f"{', '.join(supported_architectures())}")


def adapter_for_model(model_cfg: dict, architecture: Optional[str] = None) -> HFAdapter:
    """The adapter that writes this megalite model: the one for ``architecture`` if given
    (one line naming what the model lacks for it), else the first registered that can."""
    if architecture is not None:
        adapter = adapter_for_architecture(architecture)
        missing = adapter.export_problems(model_cfg)
        if missing:
            raise UnsupportedModelError(f"this model does not export as {architecture}; it "
                                        f"needs {', '.join(missing)}")
        return adapter
    problems = []
    for adapter in _ADAPTERS:
        missing = adapter.export_problems(model_cfg)
        if not missing:
            return adapter
        problems.append(f"{adapter.architectures[0]} needs {', '.join(missing)}")
    raise UnsupportedModelError("no Hugging Face architecture fits this model: "
                                + "; ".join(problems))
