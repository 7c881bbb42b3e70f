"""Hugging Face Mixtral interop: a tiny random ``MixtralForCausalLM`` gives the same logits
after import (one process; EP=2 in tests/distributed/test_mixtral_hf_dist.py), and an export
loads back into ``transformers`` with the same logits."""
import pytest
import torch

from megalite.checkpointing import hf
from megalite.checkpointing.model_io import load_full_state_dict
from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state

transformers = pytest.importorskip("transformers")

from mixtral_fixture import IDS, hf_mixtral, rel  # noqa: E402  (tests/ is on sys.path)


def test_imported_mixtral_gives_hf_logits_and_export_loads_back(tmp_path):
    ref = hf_mixtral(str(tmp_path / "hf"))
    model_cfg, full = hf.import_hf(str(tmp_path / "hf"))
    assert (model_cfg["num_experts"], model_cfg["moe_router_topk"]) == (4, 2)
    assert full["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape == (4, 48, 32)
    model = build_model(MegaliteConfig(model=ModelConfig(**model_cfg)), single_rank_state())
    load_full_state_dict(model.eval(), full, single_rank_state())
    with torch.no_grad():
        expected = ref(IDS).logits
        assert rel(model(IDS)[..., :100], expected) <= 1e-5
    adapter = hf.export_hf(str(tmp_path / "out"), model_cfg, full)
    assert adapter.family == "mixtral"
    again = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert rel(again(IDS).logits, expected) <= 1e-6
    cfg2, full2 = hf.import_hf(str(tmp_path / "out"))
    assert all(torch.equal(full[k], full2[k]) for k in full)


def test_mixtral_export_refuses_what_it_cannot_write(tmp_path):
    hf_mixtral(str(tmp_path / "hf"))
    model_cfg, full = hf.import_hf(str(tmp_path / "hf"))
    bad = dict(model_cfg, moe_shared_expert_intermediate_size=16)
    with pytest.raises(hf.UnsupportedModelError, match="shared-expert"):
        hf.export_hf(str(tmp_path / "x"), bad, full)
