"""``megalite plan`` as a user runs it: flags that pretrain_gpt.py accepts, errors as one line."""
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from megalite.cli.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def megalite_cmd():
    exe = shutil.which("megalite", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "megalite.cli"]


def run(*args, cmd=None):
    return subprocess.run((cmd or megalite_cmd()) + list(args), capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


LLAMA_8B = ["plan", "--recipe", "llama3-8b", "--num-gpus", "64", "--gpu", "h100-80gb",
            "--seq-length", "8192", "--global-batch-tokens", "4194304"]


def winner_flags(stdout):
    lines = stdout.splitlines()
    return shlex.split(lines[lines.index("best layout as pretrain_gpt.py flags:") + 1])


def test_plan_prints_flags_that_pretrain_gpt_accepts():
    p = run(*LLAMA_8B, "--explain", "--top", "5")
    assert p.returncode == 0, p.stderr
    assert "TFLOP/s" in p.stdout and "dominated by" in p.stdout
    flags = winner_flags(p.stdout)
    cfg = parse_args(flags + ["--dry-run", "--world-size", "64", "--mock-data"])
    assert cfg.model.num_layers == 32 and cfg.model.num_query_groups == 8
    assert cfg.training.global_batch_size * cfg.model.seq_length == 4194304
    # and the real entry point agrees
    d = subprocess.run([sys.executable, "pretrain_gpt.py", *flags, "--dry-run", "--world-size",
                        "64", "--mock-data"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert d.returncode == 0, d.stderr


def test_python_dash_m_planner_and_json():
    p = run("--recipe", "gpt-1.7b", "--num-gpus", "32", "--gpu", "a100-80gb",
            "--global-batch-size", "512", "--json", "--top", "3",
            cmd=[sys.executable, "-m", "megalite.planner"])
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["candidates"]) == 3
    best = out["candidates"][0]
    assert best["fits"] and best["memory_bytes"]["total"] <= best["capacity_bytes"]
    assert best["command"].startswith("pretrain_gpt.py ")


@pytest.mark.parametrize("args,needle", [
    (["plan", "--recipe", "nope", "--num-gpus", "8", "--global-batch-size", "8"], "unknown model"),
    (["plan", "--recipe", "llama3-8b", "--num-gpus", "12", "--global-batch-size", "12"],
     "not divisible by --gpus-per-node"),
    (["plan", "--recipe", "llama3-8b", "--num-gpus", "8"], "--global-batch-size"),
    (["plan", "--recipe", "llama3-8b", "--num-gpus", "8", "--global-batch-size", "8",
      "--global-batch-tokens", "8192"], "only one of"),
    (["plan", "--recipe", "llama3-8b", "--num-gpus", "8", "--global-batch-tokens", "1000"],
     "not a multiple"),
    (["plan", "--recipe", "llama3-8b", "--num-gpus", "8", "--global-batch-size", "8",
      "--gpu", "tpu"], "unknown preset"),
    (["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
      "--vocab-size", "100", "--seq-length", "32", "--num-gpus", "8", "--global-batch-size", "8",
      "--tensor-model-parallel-size", "2"], "not a model flag"),
    (["plan", "--recipe", "llama3-405b", "--num-gpus", "8", "--global-batch-size", "8"],
     "no layout fits"),
    (["plan", "--recipe", "llama3-8b", "--hf-config", "x.json", "--num-gpus", "8",
      "--global-batch-size", "8"], "exactly one model"),
    (["fly"], "unknown command"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    p = run(*args)
    assert p.returncode == 2
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_usage_without_command():
    p = run()
    assert p.returncode == 0 and "plan" in p.stdout


def test_model_flags_and_explicit_gpu(tmp_path):
    from megalite.commands.plan import plan
    import io
    buf = io.StringIO()
    plan(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
          "--ffn-hidden-size", "1024", "--vocab-size", "1000", "--seq-length", "512",
          "--swiglu", "--num-gpus", "16", "--gpus-per-node", "4", "--gpu-memory-gb", "16",
          "--peak-tflops", "100", "--intra-node-bandwidth-gbps", "100",
          "--inter-node-bandwidth-gbps", "10", "--global-batch-size", "64", "--top", "2"],
         out=buf)
    flags = winner_flags(buf.getvalue())
    assert "--swiglu" in flags
    parse_args(flags + ["--dry-run", "--world-size", "16", "--mock-data"])


def test_hf_config_llama_and_mixtral(tmp_path):
    from megalite.planner import model_spec as ms
    llama = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama))
    m = ms.from_hf_config(str(tmp_path))
    assert ms.total_params(m) == ms.total_params(ms.recipe("llama3-8b"))
    mix = dict(llama, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
               rope_theta=1e6, max_position_embeddings=32768)
    path.write_text(json.dumps(mix))
    mm = ms.from_hf_config(str(path))
    assert mm.num_experts == 8 and ms.total_params(mm) == ms.total_params(ms.recipe("mixtral-8x7b"))
    assert round(ms.total_params(mm) / 1e9, 1) == 46.7


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    p = run("plan", "--recipe", "gpt-1.7b", "--num-gpus", "16", "--gpu", "a100-80gb",
            "--global-batch-size", "256", "--plot", str(out), "--top", "3",
            "--schedules", "1f1b")                 # the sweep searches 4x less
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 10_000


def test_planner_imports_no_torch():
    code = ("import sys, megalite.planner, megalite.commands.plan, megalite.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_hf_config_qwen_moe_families(tmp_path):
    """Qwen2-MoE's gated shared expert and sparse-layer rule, read as the HF adapter reads
    them; the planner's count is the published Qwen1.5-MoE-A2.7B size (14.3B)."""
    from megalite.planner import model_spec as ms
    qwen15 = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
              "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
              "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
              "decoder_sparse_step": 1, "norm_topk_prob": False, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen15))
    m = ms.from_hf_config(str(path))
    assert m.moe_shared_expert_gate and m.moe_router_pre_softmax
    assert round(ms.total_params(m) / 1e9, 1) == 14.3      # without q/k/v biases (kB)
    path.write_text(json.dumps(dict(qwen15, decoder_sparse_step=2, mlp_only_layers=[3])))
    m2 = ms.from_hf_config(str(path))
    assert [m2.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
