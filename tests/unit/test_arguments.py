"""Megatron-compatible flags, YAML configs, and one clear error per bad input (exit 2)."""
import os
import subprocess
import sys

import pytest

from megalite.cli.arguments import ConfigError, build_parser, parse_args
from megalite.training.entry import main as pretrain_main
from megalite.config.activations import ACTIVATIONS, activation_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--mock-data", "--vocab-size", "1000", "--train-iters", "2",
        "--lr", "1e-3"]


def run_main(argv, capsys, world=8):
    with pytest.raises(SystemExit) as exc:
        pretrain_main(["--world-size", str(world), *argv])
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


BAD_INPUTS = [
    # (extra flags, world, words the one-line message must contain)
    (["--tensor-model-parallel-size", "3"], 8, ["--tensor-model-parallel-size", "world size 8"]),
    (["--expert-model-parallel-size", "3", "--num-experts", "6"], 8,
     ["--expert-model-parallel-size", "--expert-tensor-parallel-size"]),
    (["--pipeline-model-parallel-size", "8", "--num-layers", "12"], 8,
     ["--num-layers", "--pipeline-model-parallel-size", "--decoder-first-pipeline-num-layers"]),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4"], 8,
     ["--num-layers (4)", "virtual stages (4)"]),
    (["--tensor-model-parallel-size", "8"], 8, ["--num-attention-heads (4)", "divisible"]),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "2"],
     8, ["--num-query-groups (2)", "--tensor-model-parallel-size (4)"]),
    (["--hidden-size", "66"], 8, ["--hidden-size (66)", "--num-attention-heads"]),
    (["--global-batch-size", "12", "--micro-batch-size", "2"], 8,
     ["--global-batch-size (12)", "--micro-batch-size (2)", "data-parallel size (8)"]),
    (["--context-parallel-size", "4", "--seq-length", "36"], 8,
     ["--seq-length (36)", "--context-parallel-size"]),
    (["--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "34"], 8,
     ["--sequence-parallel", "--seq-length (34)"]),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 8,
     ["--num-experts (6)", "--expert-model-parallel-size (4)"]),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 8, ["virtual", "--pipeline-model-parallel-size"]),
    (["--tensor-model-parallel-size", "0"], 8, ["--tensor-model-parallel-size", "positive"]),
    (["--micro-batch-size", "-1"], 8, ["--micro-batch-size", "positive"]),
    (["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
      "--global-batch-size", "6", "--num-layers", "8"], 4, ["micro-batches (6 =", "multiple of --pipeline-model-parallel-size (4)"]),
    (["--bogus-flag", "1"], 8, ["unrecognized arguments: --bogus-flag"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3",
      "--num-layers", "8"], 8, ["--num-layers (8)", "--num-layers-per-virtual-pipeline-stage (3)"]),
    (["--fp16", "--bf16"], 8, ["--fp16", "--bf16"]),
    (["--fp16", "--hysteresis", "0"], 8, ["--hysteresis", ">= 1"]),
    (["--context-parallel-size", "2"], 8, ["--context-parallel-size", "--attention-dropout 0"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--attention-dropout", "0",
      "--group-query-attention", "--num-query-groups", "2"], 8,
     ["--cp-comm-type a2a", "query groups (2)", "TP x CP (4)"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--tensor-model-parallel-size",
      "2", "--attention-dropout", "0"], 8, ["--num-attention-heads (4)", "TP x CP (8)"]),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], 8, ["--cp-comm-type", "ring"]),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 8,
     ["--num-experts", "--sequence-parallel"]),
    (["--num-experts", "8", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 8,
     ["--moe-router-num-groups (3)", "--num-experts (8)"]),
    (["--transformer-impl", "transformer_engine"], 8, ["--transformer-impl", "local"]),
    (["--sample-windows", "random"], 8, ["--sample-windows random", "--mock-data"]),
]


@pytest.mark.parametrize("extra,world,words", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2(extra, world, words, capsys):
    code, err = run_main(BASE + extra, capsys, world)
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("megalite: error:"), err
    for w in words:
        assert w in err, (w, err)


def test_missing_data_path_and_tokenizer_file(capsys, tmp_path):
    no_mock = [a for a in BASE if a != "--mock-data"]
    code, err = run_main(no_mock + ["--tokenizer-type", "ByteLevelTokenizer"], capsys, 1)
    assert code == 2 and "--data-path is required" in err
    code, err = run_main(no_mock + ["--tokenizer-type", "ByteLevelTokenizer", "--data-path",
                                    str(tmp_path / "nope")], capsys, 1)
    assert code == 2 and "--data-path" in err and "preprocess_data.py" in err
    code, err = run_main(BASE + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                 str(tmp_path / "missing.model")], capsys, 1)
    assert code == 2 and "--tokenizer-model" in err and "does not exist" in err


def test_entry_point_exit_status_no_traceback():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--world-size", "8",
                        *BASE, "--tensor-model-parallel-size", "3"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0
    assert "--tensor-model-parallel-size (3)" in p.stderr


def test_derived_sizes_and_vocab_padding():
    cfg = parse_args(["--world-size", "16", *BASE, "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                      "--global-batch-size", "8", "--dry-run"])
    assert cfg.data_parallel_size == 2 and cfg.num_micro_batches == 4
    assert cfg.padded_vocab_size == 1024  # 1000 -> multiple of 128*2
    cfg = parse_args(["--world-size", "8", *BASE, "--tensor-model-parallel-size", "8",
                      "--num-attention-heads", "8", "--vocab-size", "50257"])
    assert cfg.padded_vocab_size == 51200
    assert parse_args(BASE).training.global_batch_size == 1  # default micro * DP


def test_megatron_flag_names_and_defaults():
    cfg = parse_args(["--world-size", "32", *BASE, "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                      "1", "--context-parallel-size", "2", "--expert-model-parallel-size", "2",
                      "--expert-tensor-parallel-size", "1", "--num-experts", "4", "--sequence-parallel",
                      "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
                      "--use-distributed-optimizer", "--recompute-granularity", "selective",
                      "--global-batch-size", "16", "--save", "/tmp/x", "--lr-decay-style", "cosine",
                      "--dry-run"])
    p, m = cfg.parallel, cfg.model
    assert (p.tp, p.pp, p.cp, p.ep, p.etp) == (2, 2, 2, 2, 1)
    assert p.virtual_stages(m.num_layers) == 2 and p.sequence_parallel
    assert m.add_bias_linear is False and m.swiglu and m.untie_embeddings_and_output_weights
    assert cfg.checkpoint.save == "/tmp/x" and cfg.optimizer.lr_decay_style == "cosine"
    d = parse_args(BASE)
    # Megatron-LM's defaults.
    assert d.model.normalization == "LayerNorm" and d.model.make_vocab_size_divisible_by == 128
    assert d.optimizer.weight_decay == 0.01 and d.optimizer.clip_grad == 1.0
    assert d.training.seed == 1234 and d.model.init_method_std == 0.02
    assert d.parallel.sequence_parallel is False


def test_help_groups_flags_by_topic():
    text = build_parser().format_help()
    for title in ("parallelism", "model shape", "optimizer", "data and tokenizer", "checkpoints",
                  "logging"):
        assert title in text
    assert text.index("  --tensor-model-parallel-size") > text.index("parallelism (DP")


def test_yaml_config_and_override(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  num_layers: 8\n  hidden_size: 128\nnum-attention-heads: 8\n"
                 "seq_length: 64\nmock-data: true\nvocab_size: 500\ntrain_iters: 3\nlr: 0.1\n"
                 "tensor_model_parallel_size: 2\ndisable_bias_linear: true\n")
    cfg = parse_args(["--config", str(f), "--world-size", "4", "--num-layers", "4"])
    assert cfg.model.num_layers == 4 and cfg.model.hidden_size == 128  # flag overrides file
    assert cfg.parallel.tp == 2 and cfg.model.add_bias_linear is False
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layerz: 3\n")
    with pytest.raises(ConfigError, match="unknown setting 'num_layerz'"):
        parse_args(["--config", str(bad), *BASE])


def test_slurm_variables_give_world_size(monkeypatch):
    from megalite.parallel_state import launch_env

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    env = launch_env()
    assert (env.rank, env.world_size, env.local_rank) == (5, 8, 1)
    assert parse_args([*BASE, "--tensor-model-parallel-size", "2"]).world_size == 8
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch_env().rank == 2  # torchrun's variables win


def test_dry_run_prints_layout(capsys):
    assert pretrain_main(["--world-size", "8", *BASE, "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 CP=1 DP=2 PP=2" in out and "vocabulary 1000 padded to 1024" in out


def test_import_needs_no_cuda_or_te():
    code = ("import sys, megalite, megalite.config, megalite.cli.arguments, megalite.parallel_state, "
            "megalite.training; assert 'transformer_engine' not in sys.modules; "
            "assert 'apex' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_logging_packages_checked_before_start(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    code, err = run_main(BASE + ["--tensorboard-dir", "tb"], capsys, 1)
    assert code == 2 and "--tensorboard-dir" in err and "pip install" in err
    code, err = run_main(BASE + ["--wandb-project", "p"], capsys, 1)
    assert code == 2 and "--wandb-project" in err


# ---- --account-for-embedding/loss-in-pipeline-split (Megatron) ------------------------------
EMB, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
PP2 = ["--pipeline-model-parallel-size", "2"]
BAD_ACCOUNT_SPLITS = [
    # 6 + 1 = 7 pipeline layers do not split over PP2 x VPP2.
    (["--num-layers", "6", *PP2, "--num-virtual-stages-per-pipeline-rank", "2", LOSS,
      "--global-batch-size", "8"], [LOSS, "--num-layers (6) + 1 = 7", "virtual stages (2)"]),
    # VPP counted on L' = 8: 8 / (2 x 3) is not whole.
    (["--num-layers", "6", *PP2, "--num-layers-per-virtual-pipeline-stage", "3", EMB, LOSS,
      "--global-batch-size", "8"], [EMB, LOSS, "= 8", "--num-layers-per-virtual-pipeline-stage (3)"]),
    (["--num-layers", "6", *PP2, "--decoder-first-pipeline-num-layers", "2", EMB],
     [EMB, "--decoder-first/last-pipeline-num-layers"]),
    (["--num-layers", "6", EMB, LOSS], [EMB, LOSS, "--pipeline-model-parallel-size > 1"]),
]


@pytest.mark.parametrize("extra,words", BAD_ACCOUNT_SPLITS)
def test_account_for_split_bad_input_is_one_line(extra, words, capsys):
    code, err = run_main(BASE + extra, capsys, 8)
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("megalite: error:"), err
    for w in words:
        assert w in err, (w, err)


def test_account_for_split_flags_parse_and_count_in_vpp(capsys):
    cfg = parse_args(["--world-size", "8", *BASE, "--num-layers", "6", *PP2,
                      "--num-layers-per-virtual-pipeline-stage", "2", EMB, LOSS,
                      "--global-batch-size", "8", "--dry-run"])
    p = cfg.parallel
    assert p.account_for_embedding_in_pipeline_split and p.account_for_loss_in_pipeline_split
    assert p.pipeline_slots(6) == 8 and p.virtual_stages(6) == 2   # 8 / (PP2 x 2 per stage)
    assert not parse_args(BASE).parallel.account_for_loss_in_pipeline_split
    assert pretrain_main(["--world-size", "8", *BASE, "--num-layers", "6", *PP2,
                          "--num-virtual-stages-per-pipeline-rank", "2", EMB, LOSS,
                          "--global-batch-size", "8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "0: 0 | 3-4; 1: 1-2 | 5 (embedding and loss each counted" in out
    # One slot per virtual stage (Llama 3's split): the first chunk holds only the
    # embedding, the last only the loss.
    assert pretrain_main(["--world-size", "8", *BASE, "--num-layers", "6", *PP2,
                          "--num-virtual-stages-per-pipeline-rank", "4", EMB, LOSS,
                          "--global-batch-size", "8", "--dry-run"]) == 0
    assert "0: embedding | 1 | 3 | 5; 1: 0 | 2 | 4 | loss" in capsys.readouterr().out


def test_no_compat_flag_shadows_a_config_field():
    """A Megatron flag that became a real setting is a config field only: its entry in
    compat_flags (accepted without effect) must go, or the docs would call it pending."""
    from megalite.cli import compat_flags
    from megalite.config import all_fields, field_flag

    real = {s for _, f in all_fields() for s in (field_flag(f), *f.metadata.get("aliases", ()))}
    assert not [c.flag for c in compat_flags.ALL if c.flag in real]


def test_activation_is_one_choice_megatron_switches_spell_it(capsys):
    """--activation NAME and Megatron's switch select the same entry; two different
    choices are one line naming both flags (exit 2), not the first switch winning."""
    assert activation_of(parse_args(BASE).model).name == "gelu"
    for name, a in ACTIVATIONS.items():
        chosen = parse_args(BASE + ["--activation", name]).model
        assert activation_of(chosen) is a
        if a.flag:
            switch = "--" + a.flag.replace("_", "-")
            assert activation_of(parse_args(BASE + [switch]).model) is a
            parse_args(BASE + [switch, "--activation", name])       # the same choice twice
    code, err = run_main(BASE + ["--activation", "gelu", "--swiglu"], capsys, world=1)
    assert code == 2 and "\n" not in err
    assert "--activation gelu and --swiglu" in err and "--activation " in err
