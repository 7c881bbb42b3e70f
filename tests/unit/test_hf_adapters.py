"""The Hugging Face adapter registry: dispatch by architecture / by model, a second adapter
plugged in from outside, and the Llama adapter's mapping (bit-exact, no transformers)."""
import dataclasses
import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megalite.checkpointing import hf
from megalite.checkpointing.hf_adapters import (HFAdapter, LlamaAdapter, UnsupportedModelError,
                                                adapter_for_family, adapter_for_hf,
                                                adapter_for_model, register_adapter,
                                                registered_adapters, unregister_adapter)
from megalite.checkpointing.model_io import full_state_dict_from_checkpoint
from megalite.config import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(REPO, "tools", "checkpoint", "convert.py")


class ToyAdapter(HFAdapter):
    """A stand-in family: LayerNorm models whose HF names are megalite's under 'toy.'."""
    family, architectures, model_type = "toy", ("ToyForCausalLM",), "toy"

    def __init__(self):
        self.calls = []

    def config_from_hf(self, hf_cfg):
        self.calls.append("config_from_hf")
        return dataclasses.asdict(toy_model(hf_cfg["n_layer"]))

    def export_problems(self, model_cfg):
        return [] if model_cfg["normalization"] == "LayerNorm" else ["--normalization LayerNorm"]

    def config_to_hf(self, model_cfg, torch_dtype="float32"):
        self.calls.append("config_to_hf")
        return {"architectures": ["ToyForCausalLM"], "model_type": "toy",
                "n_layer": model_cfg["num_layers"], "torch_dtype": torch_dtype}

    def from_hf(self, hf_sd, model_cfg):
        self.calls.append("from_hf")
        return {k[len("toy."):]: v.float() for k, v in hf_sd.items()}

    def to_hf(self, full_sd, model_cfg, dtype=torch.float32):
        self.calls.append("to_hf")
        return {"toy." + k: v.to(dtype).clone() for k, v in full_sd.items()}


def toy_model(layers=2):
    return ModelConfig(num_layers=layers, hidden_size=16, num_attention_heads=2, seq_length=8,
                       vocab_size=40, make_vocab_size_divisible_by=8, normalization="LayerNorm")


@pytest.fixture
def toy():
    before = [a.family for a in registered_adapters()]
    adapter = register_adapter(ToyAdapter())
    try:
        yield adapter
    finally:
        unregister_adapter("toy")
    assert [a.family for a in registered_adapters()] == before


def llama_cfg(**kw):
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 50,
            "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 2, "rope_theta": 10000.0,
            "max_position_embeddings": 32, "tie_word_embeddings": False, **kw}


def fake_llama_sd(hf_cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, f, v = hf_cfg["hidden_size"], hf_cfg["intermediate_size"], hf_cfg["vocab_size"]
    d = h // hf_cfg["num_attention_heads"]
    kv = hf_cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i in range(hf_cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_registry_dispatch_and_unknown_architectures():
    llama = adapter_for_hf(llama_cfg())
    assert isinstance(llama, LlamaAdapter) and adapter_for_family("llama") is llama
    assert adapter_for_hf({"model_type": "llama"}) is llama     # no architectures: model_type
    m = llama.config_from_hf(llama_cfg())
    assert adapter_for_model(m) is llama
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture \['Falcon"):
        adapter_for_hf({"model_type": "falcon", "architectures": ["FalconForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM needs --normalization"):
        adapter_for_model(dataclasses.asdict(toy_model()))
    with pytest.raises(UnsupportedModelError, match="no Hugging Face adapter for model family"):
        adapter_for_family("toy")
    with pytest.raises(ValueError, match="family"):
        register_adapter(HFAdapter())


def test_llama_adapter_roundtrip_is_bit_exact_and_fuses_qkv_per_group():
    hf_cfg = llama_cfg()
    hf_sd = fake_llama_sd(hf_cfg)
    m = hf.hf_config_to_model_config(hf_cfg)
    full = hf.hf_to_megalite_state_dict(hf_sd, m)
    qkv = full["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf_sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    # 8 heads of dim 4 in 2 query groups: group g = [q rows of its 4 heads, k_g, v_g]
    g1 = qkv[24:48]
    assert torch.equal(g1[:16], q[16:32]) and torch.equal(g1[16:20], k[4:8]) and \
        torch.equal(g1[20:], v[4:8])
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:40], hf_sd["model.layers.0.mlp.gate_proj.weight"])
    back = hf.megalite_to_hf_state_dict(full, m)
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert hf.model_config_to_hf_config(m)["num_key_value_heads"] == 2
    half = LlamaAdapter().to_hf(full, m, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    tied = hf.hf_config_to_model_config(llama_cfg(tie_word_embeddings=True))
    assert "output_layer.weight" not in hf.hf_to_megalite_state_dict(hf_sd, tied)
    with pytest.raises(UnsupportedModelError, match="no tensor 'model.norm.weight'"):
        hf.hf_to_megalite_state_dict(
            {k: t for k, t in hf_sd.items() if k != "model.norm.weight"}, m)


def test_import_export_files_dispatch_to_llama(tmp_path):
    hf_cfg = llama_cfg()
    hf_sd = fake_llama_sd(hf_cfg, seed=3)
    os.makedirs(tmp_path / "in")
    json.dump(hf_cfg, open(tmp_path / "in" / "config.json", "w"))
    save_file(hf_sd, str(tmp_path / "in" / "model.safetensors"))
    m, full = hf.import_hf(str(tmp_path / "in"))
    assert hf.export_hf(str(tmp_path / "out"), m, full).family == "llama"
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(out) == set(hf_sd) and all(torch.equal(out[k], hf_sd[k]) for k in hf_sd)


def _convert_tool():
    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_a_registered_adapter_is_picked_by_architecture_and_model(tmp_path, toy):
    from megalite.models.gpt import build_model, single_rank_state
    from megalite.config import MegaliteConfig

    assert adapter_for_hf({"architectures": ["ToyForCausalLM"]}) is toy
    assert adapter_for_family("toy") is toy
    model = build_model(MegaliteConfig(model=toy_model(2)), single_rank_state())
    full = {n: p.detach().clone() for n, p in model.canonical_named_parameters()}
    m = dataclasses.asdict(toy_model(2))
    assert adapter_for_model(m) is toy           # LayerNorm: Llama declines, toy accepts
    assert hf.export_hf(str(tmp_path / "hf"), m, full) is toy
    written = json.load(open(tmp_path / "hf" / "config.json"))
    assert written["architectures"] == ["ToyForCausalLM"]
    assert "toy.decoder.layers.1.mlp.linear_fc2.weight" in load_file(
        str(tmp_path / "hf" / "model.safetensors"))
    m2, full2 = hf.import_hf(str(tmp_path / "hf"))
    assert m2 == m and all(torch.equal(full2[k], full[k]) for k in full)
    assert toy.calls == ["config_to_hf", "to_hf", "config_from_hf", "from_hf"]
    # the converter dispatches through the same registry (in-process: it is registered here)
    tool = _convert_tool()
    assert tool.main(["--source-format", "hf", "--target-format", "megalite", "--load-dir",
                      str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mg"),
                      "--target-pipeline-model-parallel-size", "2"]) == 0
    _, full3 = full_state_dict_from_checkpoint(str(tmp_path / "mg"))
    assert all(torch.equal(full3[k], full[k]) for k in full)
    assert tool.main(["--source-format", "megalite", "--target-format", "hf", "--load-dir",
                      str(tmp_path / "mg"), "--save-dir", str(tmp_path / "hf2")]) == 0
    assert json.load(open(tmp_path / "hf2" / "config.json"))["architectures"] == ["ToyForCausalLM"]
