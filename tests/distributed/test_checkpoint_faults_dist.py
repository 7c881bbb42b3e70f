"""Damaged checkpoints, failed saves and ``--async-save`` on two real processes (issue 15);
the one-process cases are in tests/unit/test_checkpoint_safety.py.

* Rank 1's shard of the newest checkpoint missing, truncated or with a flipped byte: every
  rank falls back to the previous complete checkpoint (rank 0 names the file), all load the
  same iteration, and continue exactly as the uninterrupted run.  With no complete
  checkpoint left, every rank raises the same one line naming the files.
* ENOSPC on one rank only -- rank 1's shard write, rank 0's metadata.json, rank 0's marker,
  and rank 1's shard write under ``--async-save`` -- raises the same error on every rank
  promptly (no rank waits out the timeout), never moves the marker, and the previous
  checkpoint still resumes exactly.
* ``--async-save`` every 2 iterations while training goes on (rank 1's writer is held back so
  the background save overlaps the next steps' collectives): both checkpoints are complete
  and the resumed run reproduces the uninterrupted losses bit for bit.

All in one 2-process launch; the run uses DP2 with the distributed optimizer, so both ranks
write shards of their own (rank 1: its half of the Adam states and fp32 masters).
"""
import contextlib
import errno
import io
import os
import shutil
import time

import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp

from cpu_trainer import build_cpu_trainer, train_steps  # noqa: E402  (tests/ is on sys.path)
from megalite.checkpointing import manifest as mf
from megalite.checkpointing import checkpoint as ckpt_mod

WORLD = 2
FLAGS = ["--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--mock-data", "--vocab-size",
         "100", "--lr", "3e-3", "--train-iters", "6", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--eval-iters", "0", "--lr-warmup-iters", "1",
         "--global-batch-size", "4", "--micro-batch-size", "1", "--use-distributed-optimizer"]
DAMAGES = ("missing", "truncated", "flipped")
FAILURES = ("rank1_shard", "rank0_metadata", "rank0_marker", "rank1_shard_async")


def _trainer(*extra):
    return build_cpu_trainer([*FLAGS, *extra], WORLD)


def _printed(fn):
    """(fn()'s result, or its error as 'Type: line'; what fn printed)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the error is the result
            result = f"{type(exc).__name__}: {exc}"
    return result, buf.getvalue()


def _damage(path, how):
    if how == "missing":
        os.remove(path)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) - 64)
    else:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))


def _damaged_copy(src, name, damage_by_iteration):
    """A copy of ``src`` whose rank-1 shards are damaged (rank 0 does it; all wait)."""
    dst = f"{src}_{name}"
    if torch_dist.get_rank() == 0:
        shutil.copytree(src, dst)
        for it, how in damage_by_iteration.items():
            _damage(os.path.join(mf.iteration_dir(dst, it), "__1_0.distcp"), how)
    torch_dist.barrier()
    return dst


@contextlib.contextmanager
def _patched(obj, name, replacement, on_rank):
    original = getattr(obj, name)
    if torch_dist.get_rank() == on_rank:
        setattr(obj, name, replacement)
    try:
        yield
    finally:
        setattr(obj, name, original)


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _failing_save(trainer, failure):
    """Save with ENOSPC injected on one rank: (error line, seconds until it arrived)."""
    if failure.startswith("rank1_shard"):
        patch = _patched(dcp.FileSystemWriter, "write_data", _no_space, on_rank=1)
    else:
        suffix = "metadata.json" if failure == "rank0_metadata" else mf.MARKER
        real = mf.atomic_write
        patch = _patched(mf, "atomic_write", lambda path, text: _no_space() if
                         path.endswith(suffix) else real(path, text), on_rank=0)
    t0 = time.monotonic()
    with patch:
        error, _ = _printed(lambda: (trainer.save(), trainer.finish_saves()))
    return error, time.monotonic() - t0


def _faults(root):
    rank = torch_dist.get_rank()
    ck = f"{root}/ck"
    out = {"straight": train_steps(_trainer("--save", ck), 6, save_every=2)}
    if rank == 0:   # keep iterations 2 and 4 only: the run below saves 6 again
        shutil.rmtree(mf.iteration_dir(ck, 6))
        mf.write_marker(ck, 4)
    torch_dist.barrier()

    for how in DAMAGES:        # the newest is damaged: fall back to iteration 2
        path = _damaged_copy(ck, how, {4: how})
        trainer, printed = _printed(lambda: _trainer("--load", path))
        out[how] = (trainer.iteration, printed, train_steps(trainer, 2))
    path = _damaged_copy(ck, "none", {4: "truncated", 2: "missing"})
    out["none_complete"] = _printed(lambda: _trainer("--load", path))[0]

    trainer = _trainer("--load", ck, "--save", ck)
    async_trainer = _trainer("--load", ck, "--save", ck, "--async-save")
    train_steps(trainer, 2)
    train_steps(async_trainer, 2)
    for failure in FAILURES:
        t = async_trainer if failure.endswith("async") else trainer
        out[failure] = (*_failing_save(t, failure), mf.read_marker(ck)[0])
    resumed, _ = _printed(lambda: _trainer("--load", ck))
    out["after_failures"] = resumed if isinstance(resumed, str) else \
        (resumed.iteration, train_steps(resumed, 2))

    # --async-save every 2 iterations; rank 1's writer starts late, so the save overlaps
    # the training steps that follow it
    real_save = ckpt_mod.save_chunked
    alive = []

    def late(*args, **kwargs):
        time.sleep(0.5)
        return real_save(*args, **kwargs)
    with _patched(ckpt_mod, "save_chunked", late, on_rank=1):
        trainer = _trainer("--save", f"{root}/as", "--async-save")
        train_steps(trainer, 4, save_every=2,
               after_save=lambda t: alive.append(t.pending_save.thread.is_alive()))
        trainer.finish_saves()
    intact = [mf.verify_iteration(mf.iteration_dir(f"{root}/as", i)) for i in (2, 4)]
    resumed = _trainer("--load", f"{root}/as")
    out["async"] = (alive, intact, mf.read_marker(f"{root}/as")[0], resumed.iteration,
                    train_steps(resumed, 2))
    return out


def test_damage_enospc_and_async_save_on_two_ranks(dist, tmp_path):
    out = dist.run(WORLD, _faults, str(tmp_path))
    straight = out[0]["straight"]
    assert all(r["straight"] == straight for r in out)
    for how in DAMAGES:
        assert [r[how][0] for r in out] == [2, 2], how          # every rank fell back
        printed = out[0][how][1]
        assert "iter_0000004/__1_0.distcp: " in printed, (how, printed)
        assert "falling back to the newest complete checkpoint" in printed, printed
        for r in out:                                  # and continues as the straight run
            assert r[how][2] == straight[2:4], (how, r[how][2], straight)

    errors = {r["none_complete"] for r in out}          # the same one line on every rank
    (error,) = errors
    assert error.startswith("CheckpointError: --load: no complete checkpoint in ") and \
        "\n" not in error
    assert "iter_0000004/__1_0.distcp: " in error and "iter_0000002/__1_0.distcp: missing" \
        in error, error

    for failure in FAILURES:
        errors = [r[failure][0] for r in out]
        assert all(isinstance(e, str) and "No space left on device" in e for e in errors), \
            (failure, errors)
        assert len(set(errors)) == 1 and "\n" not in errors[0], (failure, errors)
        failing_rank = 1 if failure.startswith("rank1") else 0
        assert f"failed on rank(s) [{failing_rank}]" in errors[0], errors[0]
        assert all(r[failure][1] < 30 for r in out), (failure, [r[failure][1] for r in out])
        assert all(r[failure][2] == 4 for r in out), failure     # the marker never moved
    for r in out:
        assert r["after_failures"] == (4, straight[4:6]), r["after_failures"]

    for r in out:
        alive, intact, marker, iteration, losses = r["async"]
        assert intact == [None, None] and marker == 4 and iteration == 4, r["async"]
        assert losses == straight[4:6], (losses, straight)
    assert out[1]["async"][0] == [True, True]     # rank 1's save was still running
