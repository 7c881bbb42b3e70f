"""Per-model Hugging Face adapters (``from_hf`` / ``to_hf``) and their registry.

Importing this package registers the built-in adapters (Llama, Mixtral); a new family is a module
here with an ``HFAdapter`` subclass and one ``register_adapter`` line below.
"""
from megalite.checkpointing.hf_adapters.base import (HFAdapter, UnsupportedModelError,
                                                     adapter_for_family, adapter_for_hf,
                                                     adapter_for_model, register_adapter,
                                                     registered_adapters,
                                                     supported_architectures,
                                                     unregister_adapter)
from megalite.checkpointing.hf_adapters.llama import LlamaAdapter
from megalite.checkpointing.hf_adapters.mixtral import MixtralAdapter

register_adapter(LlamaAdapter())
register_adapter(MixtralAdapter())

__all__ = ["HFAdapter", "UnsupportedModelError", "adapter_for_family", "adapter_for_hf",
           "adapter_for_model", "register_adapter", "registered_adapters",
           "supported_architectures", "unregister_adapter", "LlamaAdapter", "MixtralAdapter"]
