"""Every Hugging Face adapter's export, in one process: for each family (Llama, Mistral,
Qwen2, Qwen3, Phi-3, Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3 with its MTP module)
``to_hf(from_hf(sd))`` gives back the HF file key by key, and the exported directory loaded
by transformers gives the original model's logits.  The import direction alone cannot see
an export that swaps two same-shaped tensors (q/k norms, gate/up halves, a router bias):
the tiny fixtures draw every norm and bias away from its init, so a swap changes values.
(tests/e2e/test_hf_families_e2e.py and test_deepseek_v3_hf_e2e.py run the same export
through convert.py, in the long tier.)"""
import pytest
import torch

from deepseek_v3_fixture import hf_deepseek_v3
from hf_families import FAMILIES, VOCAB, rel, save_hf_model
from megalite.checkpointing import hf
from mixtral_fixture import hf_mixtral

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(3))
CLASSES = {f: cls for f, (_, cls, _) in FAMILIES.items()}
CLASSES.update(mixtral="MixtralForCausalLM", deepseek_v3="DeepseekV3ForCausalLM")


def _save(family, path):
    if family == "mixtral":
        return hf_mixtral(path)
    if family == "deepseek_v3":
        return hf_deepseek_v3(path)[0]
    return save_hf_model(family, path)


@pytest.mark.parametrize("family", list(CLASSES))
def test_export_gives_back_the_hf_file_key_by_key_and_transformers_logits(tmp_path, family):
    src, out = str(tmp_path / "hf"), str(tmp_path / "out")
    ref = _save(family, src)
    hf_cfg, hf_sd = hf.load_hf_checkpoint(src)
    model_cfg, full = hf.import_hf(src)
    adapter = hf.adapter_for_model(model_cfg, hf_cfg["architectures"][0])  # Phi-3: not Llama
    back = adapter.to_hf(full, model_cfg)
    # export writes DeepSeek's release layout (per-expert MTP weights, its embedding and
    # head copies) where the fixture holds transformers' fused MTP experts
    # (gpt-oss's and Llama 4's release layout is the fused one: their experts come back key
    # by key)
    fused = {k for k in hf_sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
             and family not in ("gpt_oss", "llama4")}
    assert set(hf_sd) - set(back) == fused
    assert family == "deepseek_v3" or sorted(back) == sorted(hf_sd)
    for key in set(hf_sd) - fused:          # a pure re-mapping: the same numbers
        assert back[key].shape == hf_sd[key].shape and torch.equal(back[key], hf_sd[key]), key
    again_full = adapter.from_hf(back, model_cfg)
    assert sorted(again_full) == sorted(full)
    for key, tensor in full.items():
        assert torch.equal(again_full[key], tensor), key

    hf.export_hf(out, model_cfg, full, architecture=hf_cfg["architectures"][0])
    again = getattr(transformers, CLASSES[family]).from_pretrained(out).eval()
    assert again.config.architectures == [CLASSES[family]]
    ids = IDS % min(VOCAB, ref.config.vocab_size)
    with torch.no_grad():
        assert rel(again(ids).logits, ref(ids).logits) <= 1e-6
