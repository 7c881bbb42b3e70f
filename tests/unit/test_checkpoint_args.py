"""--use-checkpoint-args and model-flag mismatches, against checkpoints imported from Hugging
Face by the converter (whose printed flags must describe exactly the checkpoint's model)."""

import contextlib
import dataclasses
import io
import json
import os
import shlex
import shutil
import sys

import pytest

from megalite.config.fields import opt
import torch

from megalite.cli.arguments import parse_args
from megalite.checkpointing.checkpoint_args import (check_model_matches_checkpoint,
                                                    model_flags, read_checkpoint_meta)
from megalite.config import ConfigError, ModelConfig
from megalite.config.activations import activation_of

transformers = pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools", "checkpoint"))
import convert  # noqa: E402

RUN = ["--mock-data", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2",
       "--lr", "1e-4", "--finetune"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny HF Llama (GQA, untied, rope_theta 5e5) converted for TP=2 x PP=2; the
    converter's printed flags."""
    d = tmp_path_factory.mktemp("ckargs")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=80,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=500000.0, rms_norm_eps=1e-6)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(d / "hf"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert convert.main(["--source-format", "hf", "--target-format", "megalite",
                             "--load-dir", str(d / "hf"), "--save-dir", str(d / "ckpt"),
                             "--target-tensor-parallel-size", "2",
                             "--target-pipeline-model-parallel-size", "2"]) == 0
    line = [ln for ln in out.getvalue().splitlines() if ln.strip().startswith("--load")][0]
    return str(d / "ckpt"), shlex.split(line)


def _saved_model(ckpt):
    return ModelConfig(**read_checkpoint_meta(ckpt)[1]["model"])


def test_converter_prints_the_flags_of_the_checkpoint(imported):
    ckpt, flags = imported
    assert flags[:2] == ["--load", ckpt]
    assert "--rotary-base" in flags and flags[flags.index("--rotary-base") + 1] == "500000"
    assert "--tensor-model-parallel-size" in flags          # the layout it was written for
    cfg = parse_args(flags + RUN + ["--world-size", "4"])   # passes the mismatch check
    saved = _saved_model(ckpt)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("seq_length", "transformer_impl"):
            assert getattr(cfg.model, f.name) == getattr(saved, f.name), f.name
    assert model_flags(dataclasses.asdict(ModelConfig())) == []   # defaults print nothing


# (flag to change, its new argv, the flag and both values the one-line error must name)
MISMATCHES = [
    ("--ffn-hidden-size", ["--ffn-hidden-size", "64"], "this run has 64, .* has 80"),
    ("--rotary-base", ["--rotary-base", "10000"], "this run has 10000, .* has 500000"),
    ("--num-layers", ["--num-layers", "3"], "this run has 3, .* has 2"),
    ("--hidden-size", ["--hidden-size", "64"], "this run has 64, .* has 32"),
    ("--num-attention-heads", ["--num-attention-heads", "8"], "this run has 8, .* has 4"),
    ("--num-query-groups", ["--num-query-groups", "4"], "this run has 4, .* has 2"),
    ("--normalization", ["--normalization", "LayerNorm"], "this run has LayerNorm, .* RMSNorm"),
    ("--norm-epsilon", ["--norm-epsilon", "1e-05"], "this run has 1e-05, .* has 1e-06"),
    ("--vocab-size", ["--vocab-size", "128"], "this run has 128, .* has 96"),
    ("--kv-channels", ["--kv-channels", "16"], "this run has 16, .* has 8"),
    ("--position-embedding-type", ["--position-embedding-type", "learned_absolute"],
     "this run has learned_absolute, .* has rope"),
]
DROPPED = [("--swiglu", "this run has off, .* has on; pass --swiglu"),
           ("--untie-embeddings-and-output-weights", "this run has off, .* has on"),
           ("--disable-bias-linear", "this run has off, .* has on; pass --disable-bias-linear")]


def _replace(flags, flag, new):
    i = flags.index(flag)
    return flags[:i] + new + flags[i + 2:]


@pytest.mark.parametrize("flag,new,values", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_a_mismatched_model_flag_is_one_line_before_process_groups(imported, flag, new, values):
    ckpt, flags = imported
    with pytest.raises(ConfigError, match=f"^{flag}: {values}.*--use-checkpoint-args") as e:
        parse_args(_replace(flags, flag, new) + RUN + ["--world-size", "4"])
    assert "\n" not in str(e.value) and ckpt in str(e.value)
    assert not torch.distributed.is_initialized()
    # the same flags with --use-checkpoint-args: architecture switches come from the
    # checkpoint; a shape flag given on the command line is kept and still must agree
    if flag in ("--rotary-base", "--normalization", "--norm-epsilon",
                "--num-query-groups", "--position-embedding-type"):
        cfg = parse_args(_replace(flags, flag, new) + RUN + ["--use-checkpoint-args"] +
                         ["--world-size", "4"])
        check_model_matches_checkpoint(cfg)
    else:
        with pytest.raises(ConfigError, match=f"^{flag}: "):
            parse_args(_replace(flags, flag, new) + RUN + ["--use-checkpoint-args"])


@pytest.mark.parametrize("flag,message", DROPPED, ids=[d[0] for d in DROPPED])
def test_a_dropped_switch_is_reported(imported, flag, message):
    ckpt, flags = imported
    argv = [f for f in flags if f != flag]
    with pytest.raises(ConfigError, match=f"^{flag}: {message}"):
        parse_args(argv + RUN + ["--world-size", "4"])


def test_use_checkpoint_args_needs_only_the_run_flags(imported, capsys):
    ckpt, _ = imported
    cfg = parse_args(["--load", ckpt, "--use-checkpoint-args", "--rotary-base", "20000"] + RUN)
    saved = _saved_model(ckpt)
    assert cfg.model.rotary_base == 500000 and cfg.model.num_layers == 2
    assert cfg.model.resolved_query_groups() == 2 and cfg.model.vocab_size == 96
    assert (cfg.model.swiglu, cfg.model.normalization) == (True, "RMSNorm")
    assert cfg.model.seq_length == 32                      # the command line's, not max pos
    # every model and regularisation flag is the checkpoint's (dropout 0.0 from HF, not 0.1)
    assert dataclasses.replace(cfg.model, seq_length=saved.seq_length) == saved
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.0)
    out = capsys.readouterr().out
    assert "--rotary-base 20000 replaced by the checkpoint's 500000" in out
    assert "model flags from the checkpoint" in out
    # layout flags may differ: checkpoints reshard on load
    parse_args(["--load", ckpt, "--use-checkpoint-args", "--world-size", "8",
                "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"] + RUN)


def test_use_checkpoint_args_keeps_dropout_unless_the_command_line_gives_it(imported, tmp_path):
    ckpt, _ = imported
    cfg = parse_args(["--load", ckpt, "--use-checkpoint-args", "--hidden-dropout", "0.1"] + RUN)
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.1, 0.0)
    (tmp_path / "ft.yaml").write_text("attention_dropout: 0.05\n")   # --config gives it too
    cfg = parse_args(["--config", str(tmp_path / "ft.yaml"), "--load", ckpt,
                      "--use-checkpoint-args"] + RUN)
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.05)


def test_every_model_field_has_a_checkpoint_args_rule():
    """Each ModelConfig field is a shape flag, an architecture switch, a how-it-was-trained
    flag or a run-time choice -- exactly one, declared beside the field (an architecture
    switch when it says nothing) -- so a new field cannot be forgotten by
    --use-checkpoint-args; the known ones keep their rule."""
    from megalite.checkpointing import checkpoint_args as ca

    rules = (ca.SHAPE_FIELDS, ca.ARCH_FIELDS, ca.TRAINED_FIELDS, ca.RUNTIME_FIELDS)
    for f in dataclasses.fields(ModelConfig):
        assert sum(f.name in r for r in rules) == 1, f.name
    assert set(ca.NOT_MODEL) <= set(ca.RUNTIME_FIELDS)
    assert set(ca.SHAPE_FIELDS) == {"num_layers", "hidden_size", "ffn_hidden_size",
                                    "num_attention_heads", "kv_channels", "seq_length",
                                    "max_position_embeddings", "vocab_size"}
    assert {"hidden_dropout", "attention_dropout", "moe_aux_loss_coeff"} <= set(
        ca.TRAINED_FIELDS)
    assert {"attention_backend", "fp8_format", "cross_entropy_loss_fusion"} <= set(
        ca.RUNTIME_FIELDS)
    assert {"rotary_base", "swiglu", "attn_logit_softcapping", "qk_layernorm"} <= set(
        ca.ARCH_FIELDS)
    with pytest.raises(ValueError, match="checkpoint='weights'"):
        opt(1, "x", checkpoint="weights")


def test_use_checkpoint_args_edge_cases(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--use-checkpoint-args .* give --load DIR"):
        parse_args(["--use-checkpoint-args", "--vocab-size", "64", "--num-layers", "2",
                    "--hidden-size", "32", "--num-attention-heads", "4"] + RUN)
    empty = str(tmp_path / "fresh")          # a run that will resume into --save: no ckpt yet
    cfg = parse_args(["--load", empty, "--save", empty, "--use-checkpoint-args",
                      "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
                      "--num-attention-heads", "4"] + RUN)
    assert cfg.model.num_layers == 2
    assert "no checkpoint in" in capsys.readouterr().out


def test_trained_checkpoint_metadata_gives_the_tokenizer_too(tmp_path):
    """A run's own checkpoint (metadata.json with model, args and tokenizer): the tokenizer
    is taken when the command line names none."""
    root = tmp_path / "run"
    it = root / "iter_0000007"
    it.mkdir(parents=True)
    model = dataclasses.asdict(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                           seq_length=32, vocab_size=257))
    import numpy as np

    from megalite.data.indexed_dataset import write_documents

    data = write_documents(str(tmp_path / "docs"), [list(range(1, 40))] * 4, np.uint16)
    meta = {"model": model, "iteration": 7,
            "args": {"data": {"tokenizer_type": "ByteLevelTokenizer", "tokenizer_model": None,
                              "tiktoken_pattern": None}},
            "extra": {"tokenizer": {"tokenizer_type": "ByteLevelTokenizer"}}}
    (it / "metadata.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    base = ["--load", str(root), "--use-checkpoint-args", "--seq-length", "32",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-4"]
    cfg = parse_args(base + ["--data-path", data, "--dry-run"])
    assert cfg.data.tokenizer_type == "ByteLevelTokenizer" and cfg.model.vocab_size == 257
    cfg = parse_args(base + ["--mock-data"])            # mock data: no tokenizer taken
    assert cfg.data.tokenizer_type is None
    with pytest.raises(ConfigError, match="^--hidden-size: this run has 64, .* has 32"):
        parse_args(base[:2] + ["--hidden-size", "64", "--num-layers", "2",
                               "--num-attention-heads", "4"] + base[3:] + ["--mock-data"])



def test_activation_spellings_agree_with_the_checkpoint(imported, tmp_path):
    """--activation swiglu and the checkpoint's --swiglu are one choice; another activation
    is one line naming --activation; a checkpoint written before --activation existed (its
    metadata has swiglu but no activation) still loads with --use-checkpoint-args."""
    ckpt, flags = imported
    argv = [f for f in flags if f != "--swiglu"]
    parse_args(argv + ["--activation", "swiglu"] + RUN + ["--world-size", "4"])
    with pytest.raises(ConfigError, match="^--activation: this run has gelu, .* has swiglu; "
                                          "pass --activation swiglu"):
        parse_args(argv + ["--activation", "gelu"] + RUN + ["--world-size", "4"])
    old = str(tmp_path / "old")
    shutil.copytree(ckpt, old)
    path, meta = read_checkpoint_meta(old)
    del meta["model"]["activation"]
    with open(path, "w") as f:
        json.dump(meta, f)
    cfg = parse_args(["--load", old, "--use-checkpoint-args", "--activation", "gelu"] + RUN)
    assert cfg.model.swiglu and activation_of(cfg.model).name == "swiglu"
    parse_args(argv + ["--load", old, "--activation", "swiglu"] + RUN[:-1] +
               ["--world-size", "4"])
