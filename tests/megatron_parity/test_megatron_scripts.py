"""Megatron-LM's example scripts pass ``pretrain_gpt.py --dry-run`` unchanged (world size from
their layout), and data, tokenizer and split are validated there; flags with no setting of
their own are listed once as having no effect; unknown flags stay errors."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megalite.cli.arguments import parse_args
from megalite.config import ConfigError
from megalite.data.indexed_dataset import write_documents
from megalite.training.entry import main

from megatron_examples import SCRIPTS, argv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The files the scripts point at: a corpus, GPT-2 BPE vocab/merges, a sentencepiece model."""
    d = tmp_path_factory.mktemp("megatron_scripts")
    rng = np.random.default_rng(0)
    data = write_documents(str(d / "corpus_text_document"),
                           [list(rng.integers(3, 50, size=40)) for _ in range(400)], np.int32)
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    text = ["the quick brown fox jumps over the lazy dog %d" % i for i in range(200)]
    bpe.train_from_iterator(text, vocab_size=300, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(text * 5), model_prefix=str(d / "sp"),
                                   vocab_size=60, bos_id=1, eos_id=2, unk_id=0)
    return dict(DATA=data, VOCAB=str(d / "vocab.json"), MERGE=str(d / "merges.txt"),
                TOKENIZER_MODEL=str(d / "sp.model"), CKPT=str(d / "ckpt"), TB=str(d / "tb"),
                CACHE=str(d / "cache"))


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_passes_dry_run_unchanged(name, paths, capsys):
    text, world = SCRIPTS[name]
    args = argv(text, **paths)
    assert main(args + ["--dry-run", "--world-size", str(world)]) == 0
    out = capsys.readouterr().out
    assert "accepted, no effect here" in out or name == "gpt3_175b"
    cfg = parse_args(args + ["--dry-run", "--world-size", str(world)])
    if name == "llama3_8b_fp8":
        assert cfg.data.split == "'99,1,0'" and cfg.optimizer.decoupled_lr == 5e-4
        flags = [f for f, _, _ in cfg.accepted_flags]
        assert "--use-mcore-models" in flags and "--manual-gc" in flags
        assert "--fp8-param-gather" in flags           # parses; refused when a run starts
        m = cfg.model                                  # real flags of the TE backend
        assert (m.fp8_format, m.fp8_amax_history_len, m.fp8_amax_compute_algo) == \
            ("hybrid", 1024, "max")
    if name == "gpt3_175b":
        assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
        # today's script: the step schedule, thresholds in tokens of --seq-length 2048
        assert cfg.training.step_batch_size_schedule[1] == "2.4B:320"
        assert "--step-batch-size-schedule" not in out


def test_gptoss_example_dry_run_as_a_subprocess_means_its_flags(paths):
    """examples/gptoss/02_train.sh's argv through pretrain_gpt.py --dry-run, as a user runs
    it: it exits 0, and each gpt-oss flag sets its field (sinks, quick-GeGLU knobs, the
    alternating window, --recompute-activations, the fp32 router)."""
    text, world = SCRIPTS["gptoss_20b"]
    args = argv(text, **paths) + ["--dry-run", "--world-size", str(world)]
    res = subprocess.run([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--enable-gpt-oss accepted, no effect here" in res.stdout
    assert "quick-geglu" in res.stdout and "step time" in res.stdout
    m = parse_args(args).model
    assert (m.softmax_type, m.quick_geglu, m.glu_linear_offset, m.activation_func_clamp_value,
            m.window_size, m.window_attn_skip_freq, m.moe_router_dtype) == \
        ("learnable", True, 1.0, 7.0, (127, 0), 2, "fp32")
    assert [m.layer_window(i) for i in range(4)] == [127, None, 127, None]
    cfg = parse_args(args)
    assert cfg.training.recompute_granularity == "selective"
    assert cfg.optimizer.disable_bf16_reduced_precision_matmul


def test_no_effect_flags_listed_once(paths, capsys):
    text, world = SCRIPTS["mixtral_8x7b"]
    main(argv(text, **paths) + ["--dry-run", "--world-size", str(world)])
    out = capsys.readouterr().out
    assert out.count("--no-masked-softmax-fusion accepted, no effect here") == 1


def test_dry_run_checks_files_tokenizer_and_split(paths):
    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--train-iters", "1", "--lr", "1e-3", "--dry-run"]
    data = ["--data-path", paths["DATA"], "--vocab-file", paths["VOCAB"],
            "--merge-file", paths["MERGE"]]
    parse_args(base + data + ["--split", "'99,1,0'"])
    with pytest.raises(ConfigError, match="--split"):
        parse_args(base + data + ["--split", "abc"])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(base + ["--data-path", paths["DATA"] + "x", "--vocab-file", paths["VOCAB"],
                           "--merge-file", paths["MERGE"]])
    with pytest.raises(ConfigError, match="--merge-file"):
        parse_args(base + ["--data-path", paths["DATA"], "--tokenizer-type", "GPT2BPETokenizer",
                           "--vocab-file", paths["VOCAB"]])
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        parse_args(base + ["--data-path", paths["DATA"], "--tokenizer-type", "Llama2Tokenizer",
                           "--tokenizer-model", "/nonexistent.model"])
    with pytest.raises(ConfigError, match="unrecognized arguments: --not-a-megatron-flag"):
        parse_args(base + ["--mock-data", "--vocab-size", "10", "--not-a-megatron-flag"])


def test_tokenizers_from_megatron_files(paths):
    from megalite.data import build_tokenizer

    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=paths["VOCAB"],
                           merge_file=paths["MERGE"])
    ids = gpt2.tokenize("the quick brown fox")
    assert gpt2.detokenize(ids) == "the quick brown fox"
    assert gpt2.eod == json.load(open(paths["VOCAB"]))["<|endoftext|>"]
    llama = build_tokenizer("Llama2Tokenizer", paths["TOKENIZER_MODEL"])
    ids = llama.tokenize("the lazy dog")
    assert ids[0] == 1 and llama.eod == 2 and llama.detokenize(ids[1:]) == "the lazy dog"


def test_fp8_parses_but_a_cpu_run_refuses_it(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--num-layers", "1",
           "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
           "--mock-data", "--vocab-size", "16", "--train-iters", "1", "--lr", "1e-3",
           "--device", "cpu", "--fp8-format", "hybrid", "--eval-iters", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 2 and "FP8 training needs Transformer Engine" in res.stderr
    assert res.stderr.count("\n") == 1


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_cpu_twin_trains_a_few_iterations(name, paths, tmp_path):
    from megatron_examples import twin

    text, _ = SCRIPTS[name]
    local = dict(paths, CKPT=str(tmp_path / "ckpt"), TB=str(tmp_path / "tb"))
    args = twin(argv(text, **local), keep_moe=name == "gptoss_20b")
    if "--tensorboard-dir" in args and not _has("tensorboard"):
        k = args.index("--tensorboard-dir")
        del args[k:k + 2]
    metrics = str(tmp_path / "metrics.jsonl")
    cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args, "--device", "cpu",
           "--metrics-file", metrics, "--no-progress-bar"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    iters = [json.loads(x) for x in open(metrics) if "split" not in x]
    assert [r["iteration"] for r in iters] == [1, 2, 3]
    if name == "gpt3_175b":     # the twin's schedule steps up after the first iteration
        assert [r["global_batch_size"] for r in iters] == [2, 4, 4]
        assert [r["consumed_samples"] for r in iters] == [2, 6, 10]
    assert all(np.isfinite(r["lm_loss"]) and 0 <= r["mfu"] <= 1 for r in iters)
    assert os.path.isdir(local["CKPT"])


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
