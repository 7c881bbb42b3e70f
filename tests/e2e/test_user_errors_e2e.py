"""User mistakes as a user meets them: one line on stderr, exit status 2, printed once however
many ranks, the launcher's summary naming it as the root cause; a partial checkpoint cleaned
up and the newest complete one named; a bug still shows its traceback (issue 24).

Each test is one subprocess run of pretrain_gpt.py (under torchrun where ranks matter).
"""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
ENV.pop("MEGALITE_DEBUG", None)
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "1e-3",
        "--global-batch-size", "4", "--micro-batch-size", "1", "--eval-iters", "0",
        "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
HOOKS = os.path.join(ROOT, "tests", "e2e", "user_error_hooks.py")


def _torchrun(n, *args):
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
            "--max-restarts", "0", *args]


def _run(cmd, cwd, env=None, timeout=240):
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env or ENV,
                       timeout=timeout)
    return p, time.monotonic() - t0


def _printed_errors(p) -> list:
    """Lines a worker printed as its error (torchrun's summary quotes it once more, indented
    after 'traceback :')."""
    return [l for l in (p.stdout + p.stderr).splitlines() if l.startswith("megalite: error:")]


def _root_cause(p) -> str:
    text = p.stderr
    root = text[text.find("Root Cause"):]
    match = re.search(r"exitcode\s*:\s*(-?\d+).*?traceback\s*:\s*(.*)", root, re.S)
    assert match, text[-3000:]
    return match.group(1) + " " + match.group(2).splitlines()[0]


def test_validation_error_under_torchrun_is_one_line_and_the_root_cause(tmp_path):
    p, _ = _run(_torchrun(2, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "2",
                          "--eval-interval", "0"), tmp_path)
    want = "megalite: error: --eval-interval must be a positive integer, got 0"
    assert _printed_errors(p) == [want], p.stdout[-2000:] + p.stderr[-3000:]
    assert _root_cause(p) == "2 " + want
    assert "Traceback" not in p.stdout and "ZeroDivisionError" not in p.stderr


@pytest.mark.parametrize("rank,own_store", [(1, False), (0, True)])
def test_one_rank_user_error_after_start_ends_every_rank_with_one_line(tmp_path, rank,
                                                                      own_store):
    """One rank fails mid-run while its peer waits in a collective: one line (the failing
    rank's), every rank exits 2 promptly, no traceback from the rank whose collective broke.
    ``own_store``: rank 0 hosts the store itself (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the
    sbatch script sets), so it must outlive its process groups for the peer to read the line."""
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if own_store else ENV
    p, took = _run(_torchrun(2, HOOKS, f"rank{rank}-data-error", *TINY, "--train-iters", "4"),
                   tmp_path, env=env)
    lines = _printed_errors(p)
    assert lines == ["megalite: error: injected: corpus.bin: token id 512 at position 7 is "
                     "outside the vocabulary (size 100)"], p.stderr[-3000:]
    assert "Traceback (most recent call last)" not in p.stdout
    assert "error, ending every rank" not in p.stderr, p.stderr[-3000:]
    assert re.findall(r"exitcode\s*:\s*(-?\d+)", p.stderr) and \
        set(re.findall(r"exitcode\s*:\s*(-?\d+)", p.stderr)) == {"2"}, p.stderr[-3000:]
    assert took < 90, took


def _mount_tmpfs(path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_disk_at_save_is_one_line_and_leaves_no_partial_folder(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "800k"):     # one checkpoint of the tiny model (~520 kB) fits
        pytest.skip("needs root and mount to make a small filesystem (tmpfs)")
    try:
        save = disk / "ckpt"
        p, _ = _run(_torchrun(2, os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
                              "--train-iters", "4", "--save", str(save),
                              "--save-interval", "1"), tmp_path)
        lines = _printed_errors(p)
        assert len(lines) == 1, p.stdout[-2000:] + p.stderr[-3000:]
        assert re.fullmatch(r"megalite: error: --save: writing the checkpoint of iteration (\d) "
                            r"to .*ckpt failed on rank\(s\) \[[01, ]+\]: No space left on device( \(errno 28\))?; removed "
                            r"the partial folder .*iter_000000\1; newest complete checkpoint: "
                            r".*iter_000000\d; free space or point --save elsewhere", lines[0]), \
            lines[0]
        failed = int(re.search(r"iteration (\d)", lines[0]).group(1))
        kept = sorted(os.listdir(save))
        assert f"iter_{failed:07d}" not in kept, kept
        marker = (save / "latest_checkpointed_iteration.txt").read_text().strip()
        assert int(marker) == failed - 1 and f"iter_{failed - 1:07d}" in kept
        assert "inline_container" not in p.stderr and "Traceback" not in p.stdout
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_ctrl_c_during_a_save_says_what_was_kept(tmp_path):
    save = tmp_path / "ckpt"
    p, _ = _run([PY, HOOKS, "sigint-in-save", *TINY, "--train-iters", "4", "--save", str(save),
                 "--save-interval", "1"], tmp_path)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert _printed_errors(p) == [
        f"megalite: error: interrupted by Ctrl-C while saving iteration 2: removed the partial "
        f"folder {save}/iter_0000002; newest complete checkpoint: {save}/iter_0000001"], p.stderr
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_ctrl_c_in_training_and_a_bug_and_debug_mode(tmp_path):
    """Ctrl-C outside a save is one line with the iteration; MEGALITE_DEBUG=1 adds the
    traceback; a bug (not a user error) keeps its traceback and is not exit status 2."""
    save = tmp_path / "ckpt"
    p, _ = _run([PY, HOOKS, "sigint-in-train", *TINY, "--train-iters", "5", "--save", str(save),
                 "--save-interval", "1"], tmp_path)
    assert p.returncode == 2 and _printed_errors(p) == [
        f"megalite: error: interrupted by Ctrl-C at iteration 2; newest complete checkpoint: "
        f"{save}/iter_0000002"], p.stderr[-2000:]
    bug, _ = _run([PY, HOOKS, "bug-at-iteration-2", *TINY, "--train-iters", "3"], tmp_path)
    assert bug.returncode == 1 and "Traceback (most recent call last)" in bug.stderr
    assert "RuntimeError: injected bug" in bug.stderr and not _printed_errors(bug)
    debug, _ = _run([PY, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "2",
                     "--log-interval", "0"], tmp_path, env={**ENV, "MEGALITE_DEBUG": "1"})
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr
    assert _printed_errors(debug) == [
        "megalite: error: --log-interval must be a positive integer, got 0"]


def test_resume_with_another_schedule_is_refused_unless_told(tmp_path):
    save = str(tmp_path / "ckpt")
    first, _ = _run([PY, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "2",
                     "--save", save], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"> saved checkpoint at iteration 2 to {save}/iter_0000002 in " in first.stdout
    assert "> number of parameters: " in first.stdout
    again = [PY, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "3",
             "--load", save]
    p, _ = _run(again, tmp_path)
    assert p.returncode == 2 and _printed_errors(p) == [
        f"megalite: error: --train-iters 3 changes the schedule of the checkpoint in {save} "
        f"(decay steps 12 samples, the checkpoint's 8 samples; it was trained with "
        f"--train-iters 2): give the checkpoint's value, or --override-opt_param-scheduler to "
        f"use the new schedule, or --use-checkpoint-opt_param-scheduler to keep the "
        f"checkpoint's"], p.stderr
    ok, _ = _run(again + ["--override-opt_param-scheduler"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert re.search(rf"> loaded checkpoint {save}/iter_0000002 \(iteration 2\) in [\d.]+ s "
                     r"\([\d.]+ kB\)", ok.stdout), ok.stdout[-2000:]


# ---- the newcomer mistakes of issue 38, one line each (append further cases here) ----------
CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
CONVERT_HOOKS = os.path.join(ROOT, "tests", "e2e", "convert_hooks.py")
TO_MEGALITE = ["--source-format", "hf", "--target-format", "megalite", "--load-dir"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A corpus prefix, a tiny Hugging Face Llama folder, a copy of it with the weights
    truncated, and the megalite checkpoint converted from it."""
    import numpy as np
    import torch
    import transformers

    from megalite.data.indexed_dataset import write_documents

    d = tmp_path_factory.mktemp("mistakes")
    rng = np.random.default_rng(0)
    corpus = write_documents(str(d / "corpus"), [list(rng.integers(3, 90, size=40))
                                                 for _ in range(100)], np.int32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ).save_pretrained(str(d / "hf"))
    (d / "cut").mkdir()
    shutil.copy(d / "hf" / "config.json", d / "cut" / "config.json")
    weights = (d / "hf" / "model.safetensors").read_bytes()
    (d / "cut" / "model.safetensors").write_bytes(weights[:len(weights) // 3])
    p, _ = _run([PY, CONVERT, *TO_MEGALITE, str(d / "hf"), "--save-dir", str(d / "mg")], d)
    assert p.returncode == 0, p.stderr[-2000:]
    return {"corpus": corpus, "hf": str(d / "hf"), "cut": str(d / "cut"), "mg": str(d / "mg"),
            "out": str(d / "out")}


PRETRAIN = [PY, os.path.join(ROOT, "pretrain_gpt.py")]
# (case, command, the one line on stderr): {name} are the fixture's files
MISTAKES = [
    ("odd-blend", PRETRAIN + [*TINY, "--train-iters", "1", "--data-path", "0.5", "{corpus}",
                              "0.5"],
     "megalite: error: --data-path '0.5 {corpus} 0.5': 3 items, neither prefixes only nor "
     "weight/prefix pairs; give 'prefA prefB' or '0.3 prefA 0.7 prefB'"),
    ("truncated-safetensors", [PY, CONVERT, *TO_MEGALITE, "{cut}", "--save-dir", "{out}"],
     "convert.py: error: '{cut}/model.safetensors' is not a readable safetensors file (Error "
     "while deserializing header: incomplete metadata, file not fully covered); it is "
     "probably truncated: download or copy it again"),
    ("ctrl-c-convert-read", [PY, CONVERT_HOOKS, "sigint-in-read", *TO_MEGALITE, "{hf}",
                             "--save-dir", "{out}"],
     "convert.py: error: interrupted by Ctrl-C while converting {hf}; nothing was written "
     "to {out}"),
    ("ctrl-c-convert-write", [PY, CONVERT_HOOKS, "sigint-in-write", *TO_MEGALITE, "{hf}",
                              "--save-dir", "{out}"],
     "convert.py: error: interrupted by Ctrl-C while converting {hf}; nothing was written "
     "to {out}"),
    ("ctrl-c-export-write", [PY, CONVERT_HOOKS, "sigint-in-write", "--source-format",
                             "megalite", "--target-format", "hf", "--load-dir", "{mg}",
                             "--save-dir", "{out}"],
     "convert.py: error: interrupted by Ctrl-C while converting {mg}; nothing was written "
     "to {out}"),
    ("load-hf-folder", PRETRAIN + ["--load", "{hf}", "--skip-train", "--mock-data"],
     "megalite: error: --load: '{hf}' is a Hugging Face checkpoint (config.json + "
     "safetensors), not a megalite one; convert it first: python tools/checkpoint/convert.py "
     "--source-format hf --target-format megalite --load-dir {hf} --save-dir {hf}-megalite, "
     "then --load {hf}-megalite --use-checkpoint-args"),
    ("warmup-beyond-decay", PRETRAIN + [*TINY, "--train-iters", "10", "--lr-warmup-iters",
                                        "20"],
     "megalite: error: --lr-warmup-iters (20) must be smaller than the iterations the lr "
     "decays over (10, --train-iters), as Megatron-LM requires"),
    ("schedule-and-rampup", PRETRAIN + [*TINY, "--train-iters", "2", "--rampup-batch-size",
                                        "2", "2", "8", "--step-batch-size-schedule", "0:2",
                                        "64:4"],
     "megalite: error: --step-batch-size-schedule replaces --rampup-batch-size (Megatron-LM "
     "deprecated the ramp for it); give only one of them"),
    ("after-start-up-megalite-launch",
     [PY, "-m", "megalite.elastic.launch", "--standalone", "--nproc-per-node", "2", HOOKS,
      "rank1-data-error", *TINY, "--train-iters", "4"],
     "megalite: error: injected: corpus.bin: token id 512 at position 7 is outside the "
     "vocabulary (size 100)"),
]


@pytest.mark.parametrize("case,cmd,line", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_newcomer_mistake_is_one_line(case, cmd, line, files, tmp_path):
    """Exactly one line on stderr (nothing else), exit status 2, and no output left."""
    out = str(tmp_path / "out")
    names = dict(files, out=out)
    p, _ = _run([c.format(**names) for c in cmd], ROOT)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [line.format(**names)], p.stderr[-3000:]
    assert not os.path.exists(out)          # nothing partial of a conversion


def test_frictions_closed_pipe_blend_note_generate_help_eval_only(files, tmp_path):
    """``convert.py | head -1`` ends quietly; weights that do not sum to 1 are normalized
    with a note; ``megalite.generate --help`` describes its flags; an evaluation-only run
    does not say "optimizer starts fresh"."""
    cmd = f"{PY} {CONVERT} {' '.join(TO_MEGALITE)} {files['hf']} --save-dir {tmp_path}/mg " \
          "| head -1"
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True,
                       text=True, cwd=ROOT, env=ENV, timeout=240)
    assert p.stdout.startswith("wrote megalite checkpoint") and p.stderr == "", p.stderr
    assert p.returncode in (0, 141)     # 141: the pipe closed before convert.py's last line
    real_data = [t for t in TINY if t != "--mock-data"]
    note, _ = _run(PRETRAIN + [*real_data, "--train-iters", "1", "--tokenizer-type",
                               "NullTokenizer", "--data-path", "0.3", files["corpus"], "0.3",
                               files["corpus"]], tmp_path)
    assert note.returncode == 0, note.stderr[-3000:]
    assert "> note: --data-path weights sum to 0.6, not 1: normalized to 0.5 0.5 (as " \
           "Megatron-LM does)" in note.stdout
    helped, _ = _run([PY, "-m", "megalite.generate", "--help"], ROOT)
    assert "tokens to sample after the prompt" in helped.stdout
    assert "seed of the sampling generator" in helped.stdout
    evaluated, _ = _run(PRETRAIN + ["--load", files["mg"], "--use-checkpoint-args",
                                    "--skip-train", "--mock-data", "--eval-iters", "1",
                                    "--micro-batch-size", "1", "--seq-length", "16"], tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "optimizer starts fresh" not in evaluated.stdout


@pytest.mark.parametrize("flags,want", [
    (["--pipeline-model-parallel-size", "2", "--world-size", "2", "--pipeline-schedule",
      "zero-bubble", "--num-experts", "2", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--dry-run"],
     "--pipeline-schedule zero-bubble with a recomputed MoE layer"),
    (["--multi-latent-attention", "--position-embedding-type", "rope", "--add-qkv-bias"],
     "--add-qkv-bias does not apply to --multi-latent-attention"),
    (["--use-torch-fsdp2", "--check-collectives", "--dry-run"],
     "--check-collectives does not cover --use-torch-fsdp2"),
], ids=["zero-bubble-recomputed-moe", "mla-qkv-bias", "check-collectives-fsdp2"])
def test_rule_engine_refusals_are_one_line_exit_2(tmp_path, flags, want):
    """Rules that moved into the engine (megalite/cli/features.py) refuse as a user sees it."""
    p, _ = _run([PY, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "1",
                 "--device", "cpu", *flags], tmp_path)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    lines = _printed_errors(p)
    assert len(lines) == 1 and lines[0].startswith("megalite: error: " + want), lines
    assert "Traceback" not in p.stderr
