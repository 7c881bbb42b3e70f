"""Per-model Hugging Face adapters (``from_hf`` / ``to_hf``) and their registry.

Importing this package registers the built-in adapters; a new family is a module here with
an ``HFAdapter`` subclass and one ``register_adapter`` line below (docs/models.md).  Export
picks the first registered adapter that can write a model, so the order matters where two
families write the same model (Llama before Mistral).
"""
from megalite.checkpointing.hf_adapters.base import (HFAdapter, UnsupportedModelError,
                                                     adapter_for_architecture,
                                                     adapter_for_family, adapter_for_hf,
                                                     adapter_for_model, register_adapter,
                                                     registered_adapters,
                                                     supported_architectures,
                                                     unregister_adapter)
from megalite.checkpointing.hf_adapters.deepseek_v3 import DeepseekV3Adapter
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.checkpointing.hf_adapters.mistral import MistralAdapter
from megalite.checkpointing.hf_adapters.mixtral import MixtralAdapter
from megalite.checkpointing.hf_adapters.olmo2 import Olmo2Adapter
from megalite.checkpointing.hf_adapters.phi3 import Phi3Adapter
from megalite.checkpointing.hf_adapters.qwen2 import Qwen2Adapter
from megalite.checkpointing.hf_adapters.qwen3 import Qwen3Adapter
from megalite.checkpointing.hf_adapters.smollm3 import SmolLM3Adapter
from megalite.checkpointing.hf_adapters.qwen_moe import Qwen2MoeAdapter, Qwen3MoeAdapter
# Gemma 2/3
from megalite.checkpointing.hf_adapters.gemma import Gemma2Adapter, Gemma3Adapter
# gpt-oss
from megalite.checkpointing.hf_adapters.gpt_oss import GptOssAdapter
# Qwen3-Next (Gated DeltaNet hybrid)
from megalite.checkpointing.hf_adapters.qwen3_next import Qwen3NextAdapter
# Llama 4 and GLM-4.5
from megalite.checkpointing.hf_adapters.llama4 import Llama4Adapter
from megalite.checkpointing.hf_adapters.glm4_moe import Glm4MoeAdapter

register_adapter(LlamaAdapter())
register_adapter(MistralAdapter())
register_adapter(Qwen2Adapter())
register_adapter(Qwen3Adapter())
register_adapter(MixtralAdapter())
register_adapter(Qwen2MoeAdapter())
register_adapter(Qwen3MoeAdapter())
register_adapter(DeepseekV3Adapter())
register_adapter(Phi3Adapter())
register_adapter(SmolLM3Adapter())
register_adapter(Olmo2Adapter())
# Gemma 2/3
register_adapter(Gemma2Adapter())
register_adapter(Gemma3Adapter())
# gpt-oss
register_adapter(GptOssAdapter())
# Qwen3-Next (Gated DeltaNet hybrid)
register_adapter(Qwen3NextAdapter())
# Llama 4 and GLM-4.5
register_adapter(Llama4Adapter())
register_adapter(Glm4MoeAdapter())

__all__ = ["HFAdapter", "UnsupportedModelError", "adapter_for_architecture",
           "adapter_for_family", "adapter_for_hf", "adapter_for_model", "register_adapter",
           "registered_adapters", "supported_architectures", "unregister_adapter",
           "LlamaAdapter", "MistralAdapter", "MixtralAdapter", "Qwen2Adapter", "Qwen3Adapter",
           "Qwen2MoeAdapter", "Qwen3MoeAdapter", "DeepseekV3Adapter", "Phi3Adapter",
           "SmolLM3Adapter", "Olmo2Adapter",
           "Gemma2Adapter", "Gemma3Adapter",   # Gemma 2/3
           "GptOssAdapter",
           "Qwen3NextAdapter",
           # Llama 4 and GLM-4.5
           "Llama4Adapter", "Glm4MoeAdapter"]
