"""TensorBoard/W&B series carry Megatron-LM's names (and "vs samples"); megalite's extras
live under "megalite/"; the metrics file holds one run."""
import json

from megalite.training.metrics import eval_scalars, open_metrics_file, train_scalars


def test_train_and_eval_tags_are_megatrons():
    rec = {"iteration": 3, "train_iters": 10, "consumed_samples": 24, "lm_loss": 2.5,
           "lr": 1e-3, "grad_norm": 0.7, "tokens_per_sec": 100.0, "mfu": 0.2,
           "load_balancing_loss": 0.01}
    tags = {tag: (value, step) for tag, value, step in train_scalars(rec, 8)}
    assert tags["lm loss"] == (2.5, 3) and tags["lm loss vs samples"] == (2.5, 24)
    assert tags["learning-rate"] == (1e-3, 3) and tags["grad-norm vs samples"] == (0.7, 24)
    assert tags["batch-size"] == (8, 3)
    assert tags["megalite/tokens-per-sec"] == (100.0, 3) and "megalite/mfu" in tags
    assert "megalite/load-balancing-loss" in tags
    assert not any(t.startswith("train/") for t in tags)
    ev = {tag: (v, s) for tag, v, s in eval_scalars(2.0, 7.39, "valid", 3, 24)}
    assert ev["lm loss validation"] == (2.0, 3) and ev["lm loss validation vs samples"] == (2.0, 24)
    assert ev["lm loss validation ppl"] == (7.39, 3)


def test_metrics_file_fresh_per_run_and_continued_on_resume(tmp_path):
    path = str(tmp_path / "m.jsonl")
    for _ in range(2):                       # two fresh runs: the second replaces the first
        with open_metrics_file(path, 0) as f:
            for it in (1, 2, 3, 4):
                f.write(json.dumps({"iteration": it}) + "\n")
    assert [json.loads(x)["iteration"] for x in open(path)] == [1, 2, 3, 4]
    with open_metrics_file(path, 2) as f:    # resumed from iteration 2: continue from there
        f.write(json.dumps({"iteration": 3}) + "\n")
    assert [json.loads(x)["iteration"] for x in open(path)] == [1, 2, 3]


def test_mfu_never_exceeds_one():
    from megalite.training.flops import model_flops_utilization

    assert model_flops_utilization(2.07e12, 1e12) == 1.0
    assert model_flops_utilization(5e11, 1e12) == 0.5


def test_plan_hf_config_reads_rope_parameters(tmp_path):
    """transformers >= 5 stores the RoPE base under rope_parameters."""
    from megalite.planner.model_spec import from_hf_config

    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100, "intermediate_size": 128,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert from_hf_config(str(path)).rotary_base == 500000
