"""Peer snapshots restore what a disk checkpoint restores, at another layout: 4 gloo ranks
standing for two nodes of two (a snapshot folder each) train TP2 x DP2 with the distributed
optimizer, save a checkpoint and take a snapshot at the same iteration.  Then

- on the same 4 ranks at TP1 x DP4 (plain optimizer), an ``--elastic`` start resumes from
  the snapshot (every rank's own file; the chunks resharded by ``peer_fill``): its next
  losses equal, bit for bit, those of a start from the disk checkpoint at that layout, and
  the uninterrupted run's to fp32 tolerance;
- on 2 ranks at TP2 x DP1 with only the first node's folder (the second node lost), the
  shards of old ranks 2 and 3 come from the replicas: again bit for bit the disk restore.
"""
import os

import torch.distributed as torch_dist

from cpu_trainer import build_cpu_trainer, train_steps  # noqa: E402  (tests/ on sys.path)

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--lr", "3e-3",
        "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--eval-iters", "0", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
        "--global-batch-size", "8", "--micro-batch-size", "1"]
TP2 = ["--tensor-model-parallel-size", "2"]


def _node_folder(root, node):
    os.environ["MEGALITE_SNAPSHOT_DIR"] = f"{root}/node{node}"


def _four(root):
    from megalite.elastic.snapshot import Snapshotter, list_snapshots

    rank = torch_dist.get_rank()
    _node_folder(root, rank // 2)
    t = build_cpu_trainer([*BASE, *TP2, "--use-distributed-optimizer",
                           "--save", f"{root}/ckpt"], 4)
    train_steps(t, 2)
    t.save()
    snap = Snapshotter(t, 1)
    snap.maybe_take()
    snap.wait()
    straight = train_steps(t, 2)
    torch_dist.barrier()
    held = sorted((p["rank"], p["kind"]) for p in list_snapshots(snap.folder))
    from_snapshot = build_cpu_trainer([*BASE, "--elastic", "--save", f"{root}/none"], 4)
    at = (from_snapshot.iteration, from_snapshot.consumed_samples)
    resumed = train_steps(from_snapshot, 2)
    from_disk = build_cpu_trainer([*BASE, "--load", f"{root}/ckpt"], 4)
    disk = train_steps(from_disk, 2)
    return {"straight": straight, "snapshot": resumed, "disk": disk, "at": at, "held": held}


def _two(root):
    from megalite.elastic.snapshot_restore import find_snapshot

    _node_folder(root, 0)                     # node 1 is gone: only node 0's memory
    t = build_cpu_trainer([*BASE, *TP2, "--elastic", "--save", f"{root}/none"], 2)
    plan = find_snapshot(t.cfg, -1)
    at = (t.iteration, t.consumed_samples)
    resumed = train_steps(t, 2)
    disk = train_steps(build_cpu_trainer([*BASE, *TP2, "--load", f"{root}/ckpt"], 2), 2)
    return {"snapshot": resumed, "disk": disk, "at": at,
            "plan": (plan.iteration, plan.old_world, plan.from_replicas)}


def _loss(out, key):
    return next(r[key] for r in reversed(out) if all(r[key]))


def test_snapshot_restores_like_a_checkpoint_at_other_layouts_and_from_replicas(dist, tmp_path):
    four = dist.run(4, _four, str(tmp_path))
    # each node's folder: its ranks' own files and the other node's replicas
    assert four[0]["held"] == [(0, "own"), (1, "own"), (2, "replica"), (3, "replica")]
    assert four[2]["held"] == [(0, "replica"), (1, "replica"), (2, "own"), (3, "own")]
    assert all(r["at"] == (2, 16) for r in four)
    assert _loss(four, "snapshot") == _loss(four, "disk"), four
    straight, resumed = _loss(four, "straight"), _loss(four, "snapshot")
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, straight)) <= 1e-5
    two = dist.run(2, _two, str(tmp_path))
    assert two[0]["plan"] == (2, 4, 2), two[0]["plan"]
    assert all(r["at"] == (2, 16) for r in two)
    assert _loss(two, "snapshot") == _loss(two, "disk"), two
