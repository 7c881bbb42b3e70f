"""The runnable CPU twins as a user launches them (launch/run_local.sh picks the process count)
train to the single-process losses of the same model (docs/launching.md, "Recipes").

The Llama-3 405B twin runs on the two-node SLURM cluster in test_slurm_e2e.py; the GPT-3 175B
twin (TP2 PP2, full recomputation), the Qwen3-235B-A22B twin (TP2 + SP, PP2 x VPP2 with
embedding and loss counted, EP2, full recomputation, distributed optimizer) and the
DeepSeek-V3 twin (MLA + MTP, EP2 x PP2, the distributed optimizer, full recomputation) and the
gpt-oss twin (sinks, window, biased experts: TP2 + SP, PP2, EP2) run here
(tests/unit/test_recipes.py dry-runs every recipe).
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWIN = "launch/recipes/twins/gpt3-175b.yaml"
QWEN3_TWIN = "launch/recipes/twins/qwen3-235b-a22b.yaml"


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, **kw)
    assert p.returncode == 0, f"{cmd}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}"
    return p.stdout


def _losses(path, key="lm_loss"):
    records = [json.loads(line) for line in open(path)]
    return [r[key] for r in records if "split" not in r]     # training lines only


def test_gpt3_twin_with_run_local_matches_one_process(tmp_path):
    env = dict(os.environ, MEGALITE_PYTHON=sys.executable)
    out = _run(["bash", "launch/run_local.sh", TWIN, "--train-iters", "3",
                "--metrics-file", str(tmp_path / "twin.jsonl")], env=env)
    assert "[run_local] 4 process(es)" in out
    _run([sys.executable, "pretrain_gpt.py", "--config", TWIN, "--train-iters", "3",
          "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
          "--metrics-file", str(tmp_path / "one.jsonl")])
    twin, one = _losses(tmp_path / "twin.jsonl"), _losses(tmp_path / "one.jsonl")
    assert len(twin) == len(one) == 3
    assert abs(twin[0] - one[0]) <= 1e-5 * abs(one[0]), (twin[0], one[0])
    for a, b in zip(twin, one):
        assert abs(a - b) <= 1e-4 * abs(b), (twin, one)


def test_qwen3_moe_twin_with_run_local_matches_one_process(tmp_path):
    import yaml

    SHORT = ["--global-batch-size", "4"]     # 4 micro-batches through PP2 x VPP2

    env = dict(os.environ, MEGALITE_PYTHON=sys.executable)
    out = _run(["bash", "launch/run_local.sh", QWEN3_TWIN, "--train-iters", "3", *SHORT,
                "--metrics-file", str(tmp_path / "twin.jsonl")], env=env)
    assert "[run_local] 4 process(es)" in out
    one = yaml.safe_load(open(os.path.join(ROOT, QWEN3_TWIN)))
    one.pop("parallel")                     # the same model and run on one process
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    _run([sys.executable, "pretrain_gpt.py", "--config", str(tmp_path / "one.yaml"),
          "--train-iters", "3", "--world-size", "1", *SHORT,
          "--metrics-file", str(tmp_path / "one.jsonl")])
    for key in ("lm_loss", "moe_aux_loss"):
        twin, ref = _losses(tmp_path / "twin.jsonl", key), _losses(tmp_path / "one.jsonl", key)
        assert len(twin) == len(ref) == 3 and ref[0] > 0
        assert abs(twin[0] - ref[0]) <= 1e-5 * abs(ref[0]), (key, twin, ref)
        assert abs(twin[1] - ref[1]) <= 1e-4 * abs(ref[1]), (key, twin, ref)


def test_deepseek_v3_twin_trains_with_its_extra_losses_logged(tmp_path):
    """MLA + MTP + EP2 + PP2 on 4 CPU processes: the MTP, aux and z losses of every step are
    on the console line and in the metrics file (tests/distributed/test_mla_mtp_dist.py holds
    the same structure to the one-process losses)."""
    env = dict(os.environ, MEGALITE_PYTHON=sys.executable)
    metrics = tmp_path / "twin.jsonl"
    out = _run(["bash", "launch/run_local.sh", "launch/recipes/twins/deepseek-v3.yaml",
                "--train-iters", "3", "--metrics-file", str(metrics)], env=env)
    assert "[run_local] 4 process(es)" in out and "layers per pipeline rank" not in out
    lines = [ln for ln in out.splitlines() if " iteration " in ln and "lm loss" in ln]
    assert len(lines) == 3
    for ln in lines:
        assert "mtp_1 loss: " in ln and "moe aux loss: " in ln and "moe z loss: " in ln
    records = [json.loads(line) for line in open(metrics) if "split" not in line]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["mtp_1_loss"] > 0 and r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0
        # the MTP module's MoE layer (global number 3 of 3 decoder layers) reports too
        assert "moe_layer_3_tokens_per_expert" in r


def _twin_matches_one_process(tmp_path, twin_path, extra=()):
    """The twin launched with run_local.sh on 4 processes, then the same model and run on one
    process (its ``parallel`` block dropped): the same losses."""
    import yaml

    env = dict(os.environ, MEGALITE_PYTHON=sys.executable)
    out = _run(["bash", "launch/run_local.sh", twin_path, "--train-iters", "3", *extra,
                "--metrics-file", str(tmp_path / "twin.jsonl")], env=env)
    assert "[run_local] 4 process(es)" in out
    one = yaml.safe_load(open(os.path.join(ROOT, twin_path)))
    one.pop("parallel")
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    _run([sys.executable, "pretrain_gpt.py", "--config", str(tmp_path / "one.yaml"),
          "--train-iters", "3", "--world-size", "1", *extra,
          "--metrics-file", str(tmp_path / "one.jsonl")])
    twin, ref = _losses(tmp_path / "twin.jsonl"), _losses(tmp_path / "one.jsonl")
    assert len(twin) == len(ref) == 3 and len(set(ref)) == 3
    assert abs(twin[0] - ref[0]) <= 1e-5 * abs(ref[0]), (twin, ref)
    for a, b in zip(twin, ref):
        assert abs(a - b) <= 1e-4 * abs(b), (twin, ref)


def test_gemma3_twin_with_run_local_matches_one_process(tmp_path):
    """Gemma 3's pieces (GeGLU, (1 + w) sandwich and q/k norms, scaled embedding, softmax
    scale, a window shorter than the sequence with its own RoPE base, linear RoPE, the fused
    loss) at TP2 x PP2 on 4 CPU processes, as a user launches the twin: one process's losses."""
    _twin_matches_one_process(tmp_path, "launch/recipes/twins/gemma-3-27b.yaml")


def test_gpt_oss_twin_with_run_local_matches_one_process(tmp_path):
    """gpt-oss's twin (sinks, the 7-token window on alternate layers, biased experts, the
    clamped quick-GeGLU) at TP2 + SP, PP2, EP2 with expert-TP 1 and the distributed optimizer
    on 4 CPU processes gives the one-process losses."""
    _twin_matches_one_process(tmp_path, "launch/recipes/twins/gpt-oss-120b.yaml",
                              ["--global-batch-size", "4"])


def test_llama4_and_glm45_twins_train_side_by_side(tmp_path):
    """Llama 4 Scout (TP2 SP EP2 expert-TP2), Maverick (EP4) and GLM-4.5-Air (PP2 uneven, EP2,
    MTP) twins launched together with run_local.sh (on the fewest processes each layout
    spans): each trains three steps with finite, moving losses (tests/distributed/test_document_mask_dist.py and
    test_hf_families_dist.py hold the same features to the one-process and transformers'
    losses)."""
    import math

    from megalite.cli.recipes import min_world

    env = dict(os.environ, MEGALITE_PYTHON=sys.executable)
    twins = {name: min_world(os.path.join(ROOT, f"launch/recipes/twins/{name}.yaml"))
             for name in ("llama-4-scout", "llama-4-maverick", "glm-4.5-air")}
    procs = {name: subprocess.Popen(
        ["bash", "launch/run_local.sh", f"launch/recipes/twins/{name}.yaml", "--train-iters",
         "3", "--metrics-file", str(tmp_path / f"{name}.jsonl")], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in twins}
    for name, p in procs.items():
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, f"{name}\n{out[-3000:]}"
        assert f"[run_local] {twins[name]} process(es)" in out
        losses = _losses(tmp_path / f"{name}.jsonl")
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (name, losses)
        assert len(set(losses)) == 3, (name, losses)
