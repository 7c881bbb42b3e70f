"""``megalite plan`` with training's overlap flags (--overlap-moe-expert-parallel-comm,
--delay-wgrad-compute), as a user runs it, and what the planner prices for them."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIXTRAL_16 = ("--recipe", "mixtral-8x7b", "--num-gpus", "16", "--global-batch-size", "64",
              "--tp", "2", "--pp", "1", "--ep", "8")


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "megalite.planner", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def _best(out):
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["candidates"][0]


def test_plan_takes_pretrain_gpts_overlap_flags():
    """The flags pretrain_gpt.py takes change the predicted step of a MoE run; the planner's
    old --ep-overlap is the same switch; --delay-wgrad-compute alone is training's one-line
    refusal (its ``requires=``), exit status 2."""
    off = _best(_plan(*MIXTRAL_16, "--json"))
    on = _best(_plan(*MIXTRAL_16, "--json", "--overlap-moe-expert-parallel-comm"))
    assert on["layout"] == off["layout"]
    assert on["times_s"]["ep"] < off["times_s"]["ep"]
    assert on["times_s"]["step"] < off["times_s"]["step"]
    assert on["times_s"]["compute"] == off["times_s"]["compute"]
    alias = _best(_plan(*MIXTRAL_16, "--json", "--ep-overlap"))
    assert alias["times_s"] == on["times_s"]
    bad = _plan(*MIXTRAL_16, "--delay-wgrad-compute")
    assert bad.returncode == 2 and bad.stdout == ""
    line, = bad.stderr.strip().splitlines()
    assert "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm" in line
