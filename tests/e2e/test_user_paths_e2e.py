"""The user paths of issue 24, run as a user runs them (the tools and entry points as
subprocesses, on files a user has): Hugging Face Mixtral -> megalite at an expert layout and
back, evaluation and generation with no optimizer flag, a fine-tune that keeps the imported
model's dropout, Megatron's preprocessing flags, a --config that is not YAML.  Losses are
checked against the Hugging Face model on the same tokens."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
CONVERT = [PY, "tools/checkpoint/convert.py"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
SEQ = 16
# the valid split is ONE document of 2 x SEQ + 1 tokens: exactly two samples, so the eval
# loss of a 2-sample global batch is the mean over both windows whatever the shuffle
VALID_DOC = [int(t) for t in np.random.default_rng(3).integers(3, 70, size=2 * SEQ + 1)]
EVAL = ["--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--eval-iters", "1", "--split", "1,1,0", "--device", "cpu"]


def _run(cmd, ok=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, **kw)
    if ok:
        assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p


def _corpus(path):
    """Two documents: the training one, then VALID_DOC (--split 1,1,0 gives one each)."""
    from megalite.data.indexed_dataset import write_documents

    train = [int(t) for t in np.random.default_rng(4).integers(3, 70, size=200)]
    return write_documents(str(path), [train, VALID_DOC], np.uint16)


def _hf_loss(model) -> float:
    """The HF model's mean next-token loss over the two windows of VALID_DOC."""
    ids = torch.tensor([VALID_DOC[:SEQ + 1], VALID_DOC[SEQ:]])
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1)).item()


def _valid_losses(metrics):
    return [r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines())
            if r.get("split") == "valid"]


def _close(a, b, tol=1e-5):
    return abs(a - b) <= tol * abs(b)


def test_mixtral_hf_to_megalite_at_expert_layouts_and_back(tmp_path):
    """convert.py imports a Mixtral cut for TP2 x PP2; pretrain_moe.py loads it at EP2 and
    evaluates Hugging Face's loss; that run's checkpoint re-lays out to TP2 x PP2 x EP2
    (Megatron's flag spellings) and exports to a Mixtral with the same loss."""
    from mixtral_fixture import hf_mixtral

    ref = hf_mixtral(str(tmp_path / "hf"))
    data = _corpus(tmp_path / "corpus")
    mg = str(tmp_path / "mg")
    out = _run(CONVERT + ["--source-format", "hf", "--target-format", "megalite", "--load-dir",
                          str(tmp_path / "hf"), "--save-dir", mg,
                          "--target-tensor-parallel-size", "2",
                          "--target-pipeline-model-parallel-size", "2"]).stdout
    assert "cut for TP=2, PP=2, expert-TP=2" in out and "--sequence-parallel" in out
    it_dir = os.path.join(mg, "iter_0000000")
    assert sorted(os.listdir(it_dir)) == [".metadata", "__0_0.distcp", "manifest.json",
                                          "metadata.json"]        # the training format
    # fine-tune at EP2 with --lr 0 (the weights stay the imported ones): the run's final
    # evaluation is Hugging Face's loss, and its checkpoint is a pretrain_moe.py one
    ft, metrics = str(tmp_path / "ft"), tmp_path / "ft.jsonl"
    p = _run(TORCHRUN + ["pretrain_moe.py", "--data-path", data, "--tokenizer-type",
                         "NullTokenizer", *EVAL, "--load", mg, "--use-checkpoint-args",
                         "--expert-model-parallel-size", "2", "--finetune", "--train-iters",
                         "1", "--lr", "0", "--save", ft, "--metrics-file", str(metrics)])
    assert "legacy" not in p.stdout + p.stderr
    trained = _valid_losses(metrics)[-1]
    assert _close(trained, _hf_loss(ref))
    assert json.load(open(os.path.join(ft, "iter_0000001", "metadata.json")))[
        "optimizer_step"] == 1.0
    re_laid, hf_out = str(tmp_path / "tp2"), str(tmp_path / "hf_out")
    out = _run(CONVERT + ["--source-format", "megalite", "--target-format", "megalite",
                          "--load-dir", ft, "--save-dir", re_laid,      # Megatron's spellings
                          "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2",
                          "--target-expert-parallel-size", "2",
                          "--target-expert-tensor-parallel-size", "1"]).stdout
    assert "cut for TP=2, PP=2, EP=2" in out and "--expert-model-parallel-size 2" in out
    _run(CONVERT + ["--source-format", "megalite", "--target-format", "hf", "--load-dir",
                    re_laid, "--save-dir", hf_out])
    back = transformers.MixtralForCausalLM.from_pretrained(hf_out).eval()
    assert _close(_hf_loss(back), trained)
    assert json.load(open(os.path.join(hf_out, "config.json")))["attention_dropout"] == 0.0


def _hf_llama_with_tokenizer(path):
    """A tiny Llama and a character-level tokenizer (tokenizer.json) in one HF directory."""
    import string

    from tokenizers import Tokenizer, decoders, models

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    chars = string.ascii_letters + string.digits + " .,:;!?'\n-"
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         eos_token="</s>").save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(HF model, its directory, the converted megalite checkpoint, a corpus)."""
    root = tmp_path_factory.mktemp("llama")
    model = _hf_llama_with_tokenizer(str(root / "hf"))
    mg = str(root / "mg")
    _run(CONVERT + ["--source-format", "hf", "--target-format", "megalite", "--load-dir",
                    str(root / "hf"), "--save-dir", mg, "--target-tensor-parallel-size", "2"])
    return model, str(root / "hf"), mg, _corpus(root / "corpus")


def test_converted_llama_evaluates_and_generates_without_optimizer_flags(llama, tmp_path):
    """--skip-train with no --lr (and no model flag: the checkpoint's) gives the Hugging Face
    loss; megalite.generate samples from it with the tokenizer of the HF directory, which
    the converter recorded."""
    model, _, mg, data = llama
    metrics = tmp_path / "eval.jsonl"
    p = _run([PY, "pretrain_gpt.py", "--load", mg, "--use-checkpoint-args", "--skip-train",
              "--data-path", data, "--tokenizer-type", "NullTokenizer", *EVAL,
              "--metrics-file", str(metrics)])
    assert "Traceback" not in p.stderr
    assert _close(_valid_losses(metrics)[-1], _hf_loss(model))
    out = _run([PY, "-m", "megalite.generate", "--load", mg, "--prompt", "ROMEO:",
                "--max-new-tokens", "8", "--temperature", "0"]).stdout
    assert out.startswith("ROMEO:") and len(out.rstrip("\n")) > len("ROMEO:")


def test_finetune_of_imported_llama_keeps_its_dropout(llama, tmp_path):
    """The converter's hint plus --use-checkpoint-args --finetune trains the imported Llama
    with ITS dropout (0.0), so the saved run and the exported HF config say 0.0 too."""
    _, _, mg, data = llama
    ft = str(tmp_path / "ft")
    _run([PY, "pretrain_gpt.py", "--load", mg, "--use-checkpoint-args", "--finetune",
          "--data-path", data, "--tokenizer-type", "NullTokenizer", *EVAL, "--train-iters", "1",
          "--lr", "1e-4", "--save", ft])
    saved = json.load(open(os.path.join(ft, "iter_0000001", "metadata.json")))
    assert (saved["model"]["hidden_dropout"], saved["model"]["attention_dropout"]) == (0.0, 0.0)
    assert saved["args"]["model"]["attention_dropout"] == 0.0
    _run(CONVERT + ["--source-format", "megalite", "--target-format", "hf", "--load-dir", ft,
                    "--save-dir", str(tmp_path / "hf")])
    assert json.load(open(tmp_path / "hf" / "config.json"))["attention_dropout"] == 0.0


def test_exported_folder_alone_tokenizes_loads_and_generates(llama, tmp_path):
    """convert.py's export keeps the special token ids, writes generation_config.json and
    copies the tokenizer files the import recorded: AutoTokenizer + AutoModelForCausalLM +
    generate work on the exported folder alone and generate what the original model does."""
    model, hf_dir, mg, _ = llama
    out = str(tmp_path / "out")
    _run(CONVERT + ["--source-format", "megalite", "--target-format", "hf", "--load-dir", mg,
                    "--save-dir", out])
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "config.json", "model.safetensors"} <= set(os.listdir(out))
    cfg, src = (json.load(open(os.path.join(d, "config.json"))) for d in (out, hf_dir))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg.get(key) == src.get(key), key
    tok = transformers.AutoTokenizer.from_pretrained(out)
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert again.generation_config.eos_token_id == model.generation_config.eos_token_id
    ids = tok("ROMEO:", return_tensors="pt").input_ids
    assert ids.tolist() == transformers.AutoTokenizer.from_pretrained(hf_dir)(
        "ROMEO:", return_tensors="pt").input_ids.tolist()
    greedy = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ours, ref = again.generate(ids, **greedy), model.generate(ids, **greedy)
    assert ours.tolist() == ref.tolist() and ours.shape[1] > ids.shape[1]
    assert tok.decode(ours[0]).startswith("ROMEO:")


def test_preprocess_megatron_sentence_and_partition_flags(tmp_path):
    """--split-sentences --keep-newlines --partitions 2 over a glob of two JSON-lines files:
    Megatron's _sentence output, one sequence per sentence (whitespace kept), documents in
    partition order (round-robin: 0, 2, 1, 3); --keep-sequential-samples keeps input order."""
    from megalite.data.indexed_dataset import IndexedDataset

    texts = ["First one. Second one!\nThird?", "Doc two. Has two.", "Doc three.",
             "Mr. Smith left. Bye."]
    for i, chunk in enumerate((texts[:2], texts[2:])):
        with open(tmp_path / f"part{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in chunk)
    common = [PY, "tools/preprocess_data.py", "--input", str(tmp_path / "part*.jsonl"),
              "--tokenizer-type", "ByteLevelTokenizer", "--split-sentences", "--keep-newlines",
              "--partitions", "2", "--workers", "2", "--append-eod"]

    def read(prefix):
        d = IndexedDataset(prefix)
        seqs = [bytes(t for t in d[i].tolist() if t < 256).decode() for i in range(len(d))]
        docs = d.document_indices.tolist()
        return ["".join(seqs[a:b]) for a, b in zip(docs, docs[1:])], seqs, d

    out = _run(common + ["--output-prefix", str(tmp_path / "rr")]).stdout
    assert "8 sentences" in out and "2 partitions" in out
    docs, seqs, d = read(str(tmp_path / "rr_text_sentence"))
    assert docs == [texts[0], texts[2], texts[1], texts[3]]
    assert seqs[:3] == ["First one. ", "Second one!\n", "Third?"]
    assert d[2].tolist()[-1] == 256 and d[0].tolist()[-1] != 256    # eod ends the document
    _run(common + ["--output-prefix", str(tmp_path / "seq"), "--keep-sequential-samples"])
    assert read(str(tmp_path / "seq_text_sentence"))[0] == texts


def test_config_that_is_not_yaml_says_so_in_one_line(tmp_path):
    (tmp_path / "run.toml").write_text("[model]\nnum_layers = 2\nhidden_size = 32\n")
    p = _run([PY, "pretrain_gpt.py", "--config", str(tmp_path / "run.toml"), "--mock-data"],
             ok=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not valid YAML" in lines[0] and \
        "--config takes a YAML file" in lines[0], p.stderr
