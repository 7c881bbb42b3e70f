"""Hugging Face Llama interop, the shard checkpoint format and tools/checkpoint/convert.py."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megalite.checkpointing import hf
from megalite.checkpointing.model_io import (full_state_dict_from_checkpoint, load_full_state_dict,
                                             load_model_shards, save_model_shards)
from megalite.config import MegaliteConfig, ModelConfig
from megalite.models.gpt import build_model, single_rank_state
from megalite.checkpointing.checkpoint import save_model_checkpoint

transformers = pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVERT = os.path.join(REPO, "tools", "checkpoint", "convert.py")


def hf_llama(tmp_path, kv_heads=2, tied=False, name="hf", seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=64,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # make norms non-trivial so a swapped mapping would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    path = str(tmp_path / name)
    model.save_pretrained(path)
    return model, path


def megalite_from(model_cfg, full):
    model = build_model(MegaliteConfig(model=ModelConfig(**model_cfg)), single_rank_state()).eval()
    load_full_state_dict(model, full, single_rank_state())
    return model


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kv_heads,tied", [(8, False), (2, False), (4, True)])
def test_imported_llama_gives_hf_logits_and_loss(tmp_path, kv_heads, tied):
    ref, path = hf_llama(tmp_path, kv_heads, tied)
    model_cfg, full = hf.import_hf(path)
    assert model_cfg["num_query_groups"] == kv_heads
    assert model_cfg["group_query_attention"] == (kv_heads != 8)
    assert model_cfg["untie_embeddings_and_output_weights"] == (not tied)
    assert model_cfg["rotary_base"] == 500000
    model = megalite_from(model_cfg, full)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ref(ids, labels=ids)
        ours = model(ids)
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    assert rel(ours[..., :100], out.logits) <= 1e-5
    assert abs(loss.mean().item() - out.loss.item()) <= 1e-5 * out.loss.item()


def test_export_import_roundtrips_bit_exactly(tmp_path):
    _, path = hf_llama(tmp_path)
    original = load_file(os.path.join(path, "model.safetensors"))
    model_cfg, full = hf.import_hf(path)
    hf.export_hf(str(tmp_path / "out"), model_cfg, full)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    cfg2, full2 = hf.import_hf(str(tmp_path / "out"))
    assert cfg2 == model_cfg
    assert all(torch.equal(full2[k], full[k]) for k in full)
    # the exported directory loads in transformers and gives the same logits
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert rel(megalite_from(model_cfg, full)(ids)[..., :100], again(ids).logits) <= 1e-5


def test_config_mapping_and_unsupported_models():
    cfg = hf.hf_config_to_model_config({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 10,
        "hidden_size": 16, "intermediate_size": 40, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
        "max_position_embeddings": 32})
    back = hf.model_config_to_hf_config(cfg)
    assert back["num_key_value_heads"] == 2 and back["intermediate_size"] == 40
    assert back["head_dim"] == 4 and back["tie_word_embeddings"] is False
    with pytest.raises(hf.UnsupportedModelError, match="MistralForCausalLM config lacks "
                       "num_hidden_layers, hidden_size"):
        hf.hf_config_to_model_config({"model_type": "mistral",
                                      "architectures": ["MistralForCausalLM"]})
    with pytest.raises(hf.UnsupportedModelError, match="rope_type 'dynamic' is not supported"):
        hf.hf_config_to_model_config({**back, "rope_parameters": {"rope_type": "dynamic",
                                                                   "rope_theta": 1.0}})
    with pytest.raises(hf.UnsupportedModelError, match=r"rope_parameters \(linear\) lacks "
                       "factor"):
        hf.hf_config_to_model_config({**back, "rope_parameters": {"rope_type": "linear",
                                                                   "rope_theta": 1.0}})
    linear = hf.hf_config_to_model_config({**back, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}})
    assert linear["rotary_seq_len_interpolation_factor"] == 4.0
    assert hf.model_config_to_hf_config(linear)["rope_parameters"]["rope_type"] == "linear"
    gpt2 = dict(cfg, normalization="LayerNorm", swiglu=False)
    with pytest.raises(hf.UnsupportedModelError, match="RMSNorm"):
        hf.model_config_to_hf_config(gpt2)


def test_shard_checkpoint_save_load_and_relayout(tmp_path):
    m = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8,
                    vocab_size=50, make_vocab_size_divisible_by=8, normalization="LayerNorm")
    cfg = MegaliteConfig(model=m)
    state = single_rank_state()
    model = build_model(cfg, state)
    save_model_shards(str(tmp_path / "c"), 5, model, cfg, state, extra={"note": 1})
    assert open(tmp_path / "c" / "latest_checkpointed_iteration.txt").read() == "5"
    meta = json.load(open(tmp_path / "c" / "iter_0000005" / "metadata.json"))
    assert meta["tensor_model_parallel_size"] == 1 and meta["model"]["num_layers"] == 3
    assert meta["extra"] == {"note": 1}
    assert os.path.isfile(tmp_path / "c" / "iter_0000005" / "mp_rank_00_000" / "model.pt")
    cfg.training.seed = 77
    other = build_model(cfg, state)
    assert load_model_shards(str(tmp_path / "c"), [other], cfg, state) == 5
    for (n, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n
    # the legacy files re-written in the training format (cut for TP=2), back to full
    # tensors bit-exactly; the vocabulary is stored unpadded (50 rows, not 64)
    mcfg, full = full_state_dict_from_checkpoint(str(tmp_path / "c"))
    save_model_checkpoint(str(tmp_path / "d"), mcfg, full, {"tp": 2, "pp": 3}, iteration=5)
    assert sorted(os.listdir(tmp_path / "d" / "iter_0000005")) == [
        ".metadata", "__0_0.distcp", "manifest.json", "metadata.json"]
    _, full2 = full_state_dict_from_checkpoint(str(tmp_path / "d"))
    assert set(full2) == set(full) and all(torch.equal(full2[k], full[k]) for k in full)
    assert full2["embedding.word_embeddings.weight"].shape == (50, 32)
    with pytest.raises(FileNotFoundError):
        full_state_dict_from_checkpoint(str(tmp_path / "nope"))


def _convert(*args):
    return subprocess.run([sys.executable, CONVERT, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_convert_cli_roundtrip_and_errors(tmp_path):
    ref, path = hf_llama(tmp_path, kv_heads=4)
    mg, mg1, out = str(tmp_path / "mg"), str(tmp_path / "mg1"), str(tmp_path / "out")
    r = _convert("--source-format", "hf", "--target-format", "megalite", "--load-dir", path,
                 "--save-dir", mg, "--target-tensor-parallel-size", "2",
                 "--target-pipeline-model-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    # the format training writes: DCP files, metadata, manifest, marker (no mp_rank_* dirs)
    assert sorted(os.listdir(os.path.join(mg, "iter_0000000"))) == [
        ".metadata", "__0_0.distcp", "manifest.json", "metadata.json"]
    assert json.load(open(os.path.join(mg, "iter_0000000", "metadata.json")))["format"] == \
        "megalite-dcp-v1"
    r = _convert("--source-format", "megalite", "--target-format", "megalite", "--load-dir", mg,
                 "--save-dir", mg1, "--target-tensor-parallel-size", "1")
    assert r.returncode == 0, r.stderr
    model_cfg, full = full_state_dict_from_checkpoint(mg1)
    ids = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        assert rel(megalite_from(model_cfg, full)(ids)[..., :100], ref(ids).logits) <= 1e-5
    r = _convert("--source-format", "megalite", "--target-format", "hf", "--load-dir", mg,
                 "--save-dir", out)
    assert r.returncode == 0, r.stderr
    a = load_file(os.path.join(path, "model.safetensors"))
    b = load_file(os.path.join(out, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    r = _convert("--source-format", "hf", "--target-format", "megalite", "--load-dir",
                 str(tmp_path / "missing"), "--save-dir", mg1)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr


def _convert_in_process(capsys, *args):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()  # drop earlier output (transformers' progress bars)
    with pytest.raises(SystemExit) as exc:
        tool.main(list(args))
    return exc.value.code, capsys.readouterr().err


def test_convert_errors_are_one_line_exit_2(tmp_path, capsys):
    _, path = hf_llama(tmp_path, kv_heads=4)
    out = str(tmp_path / "o")
    code, err = _convert_in_process(capsys, "--source-format", "hf", "--target-format",
                                    "megalite", "--load-dir", path, "--save-dir", out,
                                    "--target-tensor-parallel-size", "3")
    assert code == 2 and err.count("\n") == 1 and \
        "is not divisible by --target-tensor-parallel-size (3)" in err
    code, err = _convert_in_process(capsys, "--source-format", "megalite", "--target-format",
                                    "hf", "--load-dir", path, "--save-dir", out)
    assert code == 2 and "not a megalite checkpoint" in err
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(model_type="falcon", architectures=["FalconForCausalLM"])
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    code, err = _convert_in_process(capsys, "--source-format", "hf", "--target-format",
                                    "megalite", "--load-dir", path, "--save-dir", out)
    assert code == 2 and "unsupported architecture" in err and err.count("\n") == 1
    assert not os.path.exists(out)
