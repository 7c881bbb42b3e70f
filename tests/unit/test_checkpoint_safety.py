"""Checkpoints that cannot be poisoned or half-written (issue 15), on one process:

* loading never unpickles: a crafted pickle in DCP's metadata or in a legacy optimizer file
  is refused and its payload never runs;
* a damaged checkpoint (missing shard, truncated file, flipped bytes, wrong shape, bad
  marker) is one line naming the file, and ``--load`` falls back to the newest complete
  checkpoint and says so;
* a failed save (disk full) never moves the marker; an unwritable ``--save`` fails before
  training; keep-last-N prunes; the marker is written last.
"""
import errno
import json
import os
import pickle

import pytest
import torch

from cpu_trainer import build_cpu_trainer, train_steps  # noqa: E402  (tests/ is on sys.path)
from megalite.cli.arguments import parse_args
from megalite.checkpointing import manifest as mf
from megalite.config import ConfigError
from megalite.errors import CheckpointError, StorageError
from megalite.parallel_state import ParallelState, RankGrid
from megalite.training.loop import Trainer

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
        "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--eval-iters", "0", "--global-batch-size", "2", "--micro-batch-size", "1"]


def _trainer(*flags):
    return build_cpu_trainer([*BASE, *flags], 1)


@pytest.fixture
def two_saves(tmp_path):
    """A directory with complete checkpoints at iterations 2 and 4."""
    root = str(tmp_path / "ckpt")
    train_steps(_trainer("--save", root), 4, save_every=2)
    return root


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PWNED']}",))


def test_malicious_pickle_never_runs(two_saves, tmp_path, monkeypatch):
    flag = tmp_path / "pwned"
    monkeypatch.setenv("PWNED", str(flag))
    meta = os.path.join(mf.iteration_dir(two_saves, 4), ".metadata")
    with open(meta, "wb") as f:
        pickle.dump(Payload(), f)
    for name in os.listdir(two_saves):       # no fallback: the only checkpoint is poisoned
        if name.startswith("iter_") and name != "iter_0000004":
            os.system(f"rm -rf {os.path.join(two_saves, name)}")
    with open(os.path.join(mf.iteration_dir(two_saves, 4), mf.MANIFEST)) as f:
        man = json.load(f)
    man["files"][".metadata"] = list(mf.file_digest(meta))   # a consistent forgery
    mf.write_manifest(mf.iteration_dir(two_saves, 4), man["files"])
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata: refusing to unpickle "
                                                     r"'posix\.system'"):
        _trainer("--load", two_saves)
    assert not flag.exists()

    # a legacy (pre-DCP) checkpoint's optimizer file is read with weights_only=True
    legacy = tmp_path / "legacy"
    t = _trainer()
    from megalite.checkpointing.model_io import save_model_shards
    from megalite.checkpointing.train_state import run_layout
    save_model_shards(str(legacy), 0, t.model_chunks, t.cfg, t.state,
                      {"consumed_samples": 0, "layout": run_layout(t.cfg)})
    os.makedirs(legacy / "iter_0000000" / "optim")
    torch.save({"optimizer": Payload(), "rng": {}}, legacy / "iter_0000000" / "optim" /
               "rank_00000.pt")
    with pytest.raises(ValueError, match="rank_00000.pt: refused to load"):
        _trainer("--load", str(legacy))
    assert not flag.exists()


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "no_manifest",
                                    "bad_marker"])
def test_damaged_latest_is_named_and_skipped(two_saves, damage, capsys):
    it4 = mf.iteration_dir(two_saves, 4)
    shard = os.path.join(it4, "__0_0.distcp")
    if damage == "missing":
        os.remove(shard)
    elif damage == "truncated":
        os.truncate(shard, os.path.getsize(shard) - 100)
    elif damage == "flipped":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    elif damage == "no_manifest":        # killed before the manifest: incomplete
        os.remove(os.path.join(it4, mf.MANIFEST))
    else:
        with open(os.path.join(two_saves, mf.MARKER), "w") as f:
            f.write("garbage\n")
    expected = {"missing": "__0_0.distcp: missing shard file",
                "truncated": "__0_0.distcp: .* bytes, the manifest records",
                "flipped": "__0_0.distcp: checksum mismatch",
                "no_manifest": "manifest.json: missing",
                "bad_marker": "latest_checkpointed_iteration.txt: bad marker"}[damage]
    err = mf.verify_iteration(it4) if damage != "bad_marker" else mf.read_marker(two_saves)[1]
    assert err is not None and len(err.splitlines()) == 1
    import re
    assert re.search(expected, err), err
    t = _trainer("--load", two_saves)
    out = capsys.readouterr().out
    if damage == "bad_marker":          # the marker is untrusted; iteration 4 is intact
        assert t.iteration == 4 and "bad marker" in out
    else:
        assert t.iteration == 2, out
        assert re.search(expected, out) and "falling back to the newest complete" in out


def test_nothing_complete_is_one_error_line(two_saves):
    for it in (2, 4):
        os.remove(os.path.join(mf.iteration_dir(two_saves, it), "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*__0_0.distcp: missing"):
        _trainer("--load", two_saves)


def test_wrong_shape_names_file_and_tensor(two_saves):
    # the flags meet the checkpoint's model first, before any process group ...
    with pytest.raises(ConfigError, match="^--ffn-hidden-size: this run has 64, .* has 128"):
        _trainer("--load", two_saves, "--ffn-hidden-size", "64")
    # ... and the load still names the file and tensor for a config that skipped that check
    cfg = parse_args(["--world-size", "1", *BASE, "--load", two_saves, "--ffn-hidden-size", "64"],
                     validate_config=False)
    t = Trainer(cfg, ParallelState.build(RankGrid(1), 0, create_groups=False), "cpu")
    with pytest.raises(CheckpointError, match=r"iter_0000004/\.metadata: 'model\..*' has shape"):
        t.setup()


def test_failed_save_never_moves_the_marker(two_saves, monkeypatch):
    t = _trainer("--load", two_saves, "--save", two_saves)
    train_steps(t, 2)
    import torch.distributed.checkpoint as dcp

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", full_disk)
    with pytest.raises(StorageError, match=r"iteration 6 .*failed on rank\(s\) \[0\]: No space left "
                       r"on device \(errno 28\); "
                       r"removed the partial folder .*iter_0000006; newest complete checkpoint: "
                       r".*iter_0000004"):
        t.save()
    assert not os.path.exists(mf.iteration_dir(two_saves, 6))     # no partial folder left
    assert mf.read_marker(two_saves)[0] == 4
    assert mf.find_loadable(two_saves)[0] == 4
    monkeypatch.undo()
    assert _trainer("--load", two_saves).iteration == 4


def test_unwritable_save_fails_before_training(tmp_path):
    blocker = tmp_path / "a_file"          # --save below a regular file: cannot be created
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--save: cannot create .*a_file/ckpt'.*a_file' is "
                       "not a writable folder"):
        parse_args(["--world-size", "1", *BASE, "--save", str(blocker / "ckpt")])


def test_keep_last_n_and_marker_last(tmp_path):
    root = str(tmp_path / "c")
    train_steps(_trainer("--save", root, "--keep-last-n-checkpoints", "2"), 6, save_every=2)
    assert mf.saved_iterations(root) == [6, 4]
    assert mf.read_marker(root) == (6, None)
    assert mf.verify_iteration(mf.iteration_dir(root, 6)) is None


def test_auto_resume_from_own_save_dir(tmp_path):
    root = str(tmp_path / "auto")
    t = _trainer("--save", root, "--load", root)      # nothing there yet: from scratch
    assert t.iteration == 0
    train_steps(t, 2)
    t.save()
    assert _trainer("--save", root, "--load", root).iteration == 2


def test_legacy_checkpoint_still_resumes_exactly(tmp_path):
    """A pre-DCP checkpoint (model shards + per-rank optimizer/RNG file, as the interim
    format wrote them) resumes at the same layout bit for bit, read with weights_only."""
    from megalite.checkpointing.model_io import save_model_shards
    from megalite.checkpointing.train_state import run_layout

    t = _trainer()
    train_steps(t, 2)
    root = tmp_path / "legacy"
    save_model_shards(str(root), 2, t.model_chunks, t.cfg, t.state,
                      {"consumed_samples": t.consumed_samples, "layout": run_layout(t.cfg)})
    os.makedirs(root / "iter_0000002" / "optim")
    torch.save({"optimizer": t.optimizer.state_dict(),
                "rng": {"cpu": torch.get_rng_state(),
                        "trackers": [c.rng_tracker.get_states() for c in t.model_chunks]}},
               root / "iter_0000002" / "optim" / "rank_00000.pt")
    straight = train_steps(t, 2)
    resumed = _trainer("--load", str(root))
    assert resumed.iteration == 2 and resumed.consumed_samples == 4
    assert train_steps(resumed, 2) == straight
