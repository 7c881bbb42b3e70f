"""Save / resume a training run on torch.distributed.checkpoint, at any layout: the I/O
policy around the training state.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     written last, atomically, after a barrier
    DIR/iter_0000100/.metadata, __<rank>_0.distcp   DCP: every rank writes its own shards
    DIR/iter_0000100/metadata.json            iteration, consumed samples, layout, args, ...
    DIR/iter_0000100/manifest.json            size + SHA-256 of every file above

What is saved is the composition of Stateful parts (``checkpointing/train_state.py``: model,
optimizer, schedule, loss scaler, data position, RNG, expert biases, each kept by its
owner), taken once (``capture_training_state``) and restored once
(``restore_training_state``) -- the same two calls an in-memory snapshot makes.  Tensors
are global shapes + this rank's chunks, so DCP reshards on load at any
TP/PP/VPP/DP/CP/EP; the parts' JSON values go to metadata.json.  This module owns the rest:
the marker and manifest, a failure on any rank as one line on every rank, --async-save,
keep-last-N, the fallback to the newest complete iteration, and which parts a load takes
(--finetune, --no-load-optim, --no-load-rng).

Its two entry points take what they save, never the training loop:
``save(TrainState, CheckpointConfig, iteration)`` and ``load(TrainState, CheckpointConfig)``;
a ``TrainState`` carries its parallel state, the run's description and the save preparation.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import threading
import time
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megalite import comm
from megalite.checkpointing import manifest as mf
from megalite.state_format.dcp_format import (CheckpointIOError, ChunkedTensor, load_chunked,
                                               save_chunked, saved_tensors)
from megalite.checkpointing.model_io import DCP_FORMAT as FORMAT
from megalite.state_format.sharded_state import layout_chunks
from megalite.config import CheckpointConfig, ModelConfig
from megalite.errors import CheckpointError, StorageError
from megalite.checkpointing import checkpoint_io_policy as policy
from megalite.checkpointing.legacy_checkpoint import load_legacy_checkpoint
from megalite.models.gpt import parameter_specs
from megalite.moe.moe_layer import split_expert_bias
from megalite.checkpointing.train_state import (TrainState, check_against, from_metadata, merge,
                                           single_process, tensors_of, to_metadata)


def _single(ts: TrainState) -> bool:
    return single_process(ts.parallel)


def _gather(obj, single: bool = False, handle=None) -> list:
    if single or not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    return comm.all_gather_object(obj, comm.world_group(handle))


def _broadcast(obj, single: bool = False):
    if single or not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    return comm.broadcast_object(obj, 0, comm.world_group())


def _agree(error: Optional[str], what: str, single: bool, handle=None) -> None:
    """Collective (it is also the barrier): every rank learns whether any rank failed and
    raises the same one line, so a failure on one rank (rank 0's metadata, manifest or
    marker write hitting ENOSPC) never leaves its peers waiting out the timeout."""
    failed = [(r, e) for r, e in enumerate(_gather(error, single, handle)) if e]
    if failed:
        raise CheckpointIOError(f"{what} failed on rank(s) {[r for r, _ in failed]}: "
                              f"{failed[0][1]}")


def _os_error(fn, *args) -> Optional[str]:
    """``fn(*args)``; its OSError (full disk, permissions) as one line instead."""
    try:
        fn(*args)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _print0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


# -- save ------------------------------------------------------------------------------

def preflight_save_dir(root: str) -> None:
    """Create ``--save`` and prove it is writable before training starts (every rank: each
    may sit on its own node)."""
    probe = os.path.join(root, f".write_test.{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"megalite")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as exc:
        raise StorageError(f"--save {root} is not writable: {exc.strerror or exc}; choose a "
                           "folder this job may write") from None


def capture_training_state(ts: TrainState, every_rank_meta: bool = False):
    """(this rank's tensors as global-shape chunks, the run's JSON metadata): what a disk
    checkpoint and an in-memory snapshot hold alike -- the composition of the parts
    (``train_state.training_state``) taken once and split into the format's tensors and
    metadata.  Collective over the world (the RNG coordinates are gathered, the expert
    biases over PP).  The metadata is rank 0's alone unless ``every_rank_meta`` (a
    snapshot: every rank keeps it, any may survive)."""
    sd = ts.state_dict()
    meta = None
    if every_rank_meta or ts.parallel.rank == 0:
        meta = merge(copy.deepcopy(ts.description), to_metadata(sd))
    return tensors_of(sd), meta


def save(ts: TrainState, ckpt: CheckpointConfig, iteration: int
         ) -> Tuple[str, Optional["AsyncSave"]]:
    """Save ``ts`` at ``iteration`` to ``ckpt.save``: (the iteration folder, the background
    write of ``--async-save`` or None).  Collective over the world.  The marker moves only
    after every rank's files, the metadata and the manifest are on disk; any rank's failure
    (ENOSPC, ...) raises on every rank and leaves the previous checkpoint the latest.

    With ``--async-save`` the caller stalls only while this rank's chunks are copied; the
    files, the manifest and the marker are written by a background thread over a process
    group of its own (so its collectives never interleave with training's).  The caller
    waits for it (``AsyncSave.wait``) before the next save and at the end of training."""
    state = ts.parallel
    root = ckpt.save
    it_dir = mf.iteration_dir(root, iteration)
    if mf.read_marker(root)[0] == iteration and mf.verify_iteration(it_dir) is None:
        return it_dir, None                # already saved (interval save at the last step)
    started = time.perf_counter()
    _print0(f"> saving checkpoint at iteration {iteration} to {root}")
    ts.before_save()
    single = _single(ts)
    stale = state.rank == 0 and os.path.isdir(it_dir)   # leftovers of an interrupted save
    _agree(_os_error(shutil.rmtree, it_dir) if stale else None, f"clearing {it_dir}", single)
    sd, meta = capture_training_state(ts)
    write = functools.partial(_write_guarded, it_dir=it_dir, root=root, meta=meta,
                              rank=state.rank, single=single,
                              keep=ckpt.keep_last_n_checkpoints, iteration=iteration,
                              started=started)
    if not ckpt.async_save:
        with policy.interruptible_save():
            write(sd, group=None)
        return it_dir, None
    staged = {k: ChunkedTensor(v.global_shape, [(o, t.clone()) for o, t in v.chunks]
                               if v.writer else [], v.writer) for k, v in sd.items()}
    group = None if single else state.background_group().handle
    return it_dir, AsyncSave(functools.partial(write, staged, group=group))


def _write_guarded(sd, group, *, it_dir, root, meta, rank, single, keep, iteration,
                   started) -> None:
    """``_write``; a full disk, a quota or an interruption becomes one user-error line on
    every rank, with the partial folder removed and the newest complete checkpoint named
    (the marker never moved).  Any other failure is a bug and keeps its traceback."""
    try:
        _write(sd, it_dir, root, meta, rank, single, keep, group)
    except KeyboardInterrupt as exc:
        raise policy.save_interrupted(root, iteration, rank,
                                      policy.interruption_name(exc)) from None
    except (CheckpointIOError, OSError, RuntimeError) as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):     # DCP caught it on some rank
            raise policy.save_interrupted(root, iteration, rank,
                                          policy.interruption_name(exc.__cause__)) from None
        cause = policy.storage_cause(exc)
        if cause is None:
            raise
        where = policy.cleanup_phrase(root, iteration, rank)
        if isinstance(exc, CheckpointIOError):  # failed on every rank alike: say rank 0's words
            where = _gather(where, single, group)[0]
        raise policy.save_failed(root, iteration, cause, where, str(exc)) from exc
    if rank == 0:
        print(policy.saved_line(iteration, it_dir, started), flush=True)


def _write(sd, it_dir, root, meta, rank, single, keep, group) -> None:
    """Every rank's files, then (rank 0) metadata, manifest and -- last -- the marker."""
    save_chunked(sd, it_dir, single, group)   # raises on every rank if any rank failed
    mine = [n for n in os.listdir(it_dir) if n.startswith(f"__{rank}_")]
    files = {}
    for part in _gather(mf.digest_files(it_dir, mine), single, group):
        files.update(part)
    error = None
    if rank == 0:          # the marker moves last, only if everything before it was written
        error = _os_error(_finish_iteration, it_dir, root, meta, files, keep)
    _agree(error, f"saving {it_dir}", single, group)


def _finish_iteration(it_dir, root, meta, files, keep) -> None:
    mf.atomic_write(os.path.join(it_dir, "metadata.json"),
                    json.dumps(meta, indent=1, sort_keys=True))
    files.update(mf.digest_files(it_dir, [".metadata", "metadata.json"]))
    mf.write_manifest(it_dir, files, {"format": FORMAT, "iteration": meta["iteration"]})
    mf.write_marker(root, meta["iteration"])
    _prune(root, keep, meta["iteration"])


class AsyncSave:
    """One checkpoint being written by a background thread; ``wait()`` re-raises its
    error on the caller's thread."""

    def __init__(self, job):
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                       name="megalite-async-save")
        self.thread.start()

    def _run(self, job) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001  (handed to the training thread)
            self.error = exc

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def save_model_checkpoint(root: str, model_cfg: dict, full_sd: Dict[str, torch.Tensor],
                          sizes: Dict[str, int], iteration: int = 0,
                          info: Optional[dict] = None) -> str:
    """Write full (logical) model tensors as a training checkpoint -- the same DCP files,
    metadata.json, manifest and marker ``save`` writes, weights only -- from one process
    (what ``tools/checkpoint/convert.py`` writes).

    Each tensor is cut into the chunks the ranks of the layout ``sizes`` ({"tp", "ep",
    "expert-tp": size}) hold, so a run at that layout reads exactly its own pieces; DCP
    reshards for any other layout.  ``info``: metadata entries to add (``args``, ``extra``,
    where the weights came from).  A failed write removes its folder."""
    m = ModelConfig(**model_cfg)
    specs = parameter_specs(m)
    # router expert biases are buffers: JSON metadata, as a training save keeps them
    full_sd, bias = split_expert_bias(full_sd, m.num_layers, m.num_layers + (m.mtp_num_layers or 0))
    missing = sorted(set(specs) - set(full_sd))
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
    unknown = sorted(set(full_sd) - set(specs))
    if unknown:     # refuse, never drop: a tensor the model has no place for
        raise KeyError(f"state dict has {len(unknown)} tensors this model has no parameter "
                       f"for, e.g. {unknown[:3]}")
    sd = {}
    for name, spec in specs.items():
        full = full_sd[name].detach().float().contiguous()
        if tuple(full.shape) != spec.full_shape:
            raise ValueError(f"'{name}' has shape {tuple(full.shape)}, the model expects "
                             f"{spec.full_shape}")
        sd[f"model.{name}"] = ChunkedTensor(spec.full_shape, layout_chunks(spec, full, sizes))
    it_dir = mf.iteration_dir(root, iteration)
    if os.path.isdir(it_dir):               # an earlier conversion to the same iteration
        shutil.rmtree(it_dir)
    layout = {"tp": sizes.get("tp", 1), "ep": sizes.get("ep", 1),
              "expert_tp": sizes.get("expert-tp", 1), "pp": sizes.get("pp", 1),
              "vpp": sizes.get("vpp", 1)}
    info = dict(info or {})
    extra = {"consumed_samples": 0, "layout": layout, "loop_state": None,
             **info.pop("extra", {})}
    if bias:
        extra["moe_expert_bias"] = bias
    meta = {"format": FORMAT, "iteration": iteration,
            "consumed_samples": extra["consumed_samples"], "optimizer_step": None,
            "layout": layout, "rng_ranks": [], "tensor_model_parallel_size": layout["tp"],
            "pipeline_model_parallel_size": layout["pp"], "model": dict(model_cfg),
            "extra": extra, "args": {"model": dict(model_cfg)}, **info}
    try:
        save_chunked(sd, it_dir, single=True)
        files = mf.digest_files(it_dir, [n for n in os.listdir(it_dir) if n.endswith(".distcp")])
        _finish_iteration(it_dir, root, meta, files, None)
    except BaseException:
        shutil.rmtree(it_dir, ignore_errors=True)
        raise
    return it_dir


def _prune(root: str, keep: Optional[int], current: int) -> None:
    if not keep:
        return
    for it in mf.saved_iterations(root)[keep:]:
        if it != current:
            shutil.rmtree(mf.iteration_dir(root, it), ignore_errors=True)


# -- load ------------------------------------------------------------------------------

def select_checkpoint(root: str, single: bool = False, wanted: Optional[int] = None
                      ) -> Optional[int]:
    """The iteration every rank will load (rank 0 verifies, then broadcasts), saying so
    when it falls back past a broken one; None when ``root`` holds no checkpoint at all.
    ``wanted`` (``--ckpt-step``): that iteration or a one-line error, no fallback."""
    verdict = None
    if single or not dist.is_initialized() or dist.get_rank() == 0:
        verdict = mf.find_loadable(root) if wanted is None else \
            (wanted, [mf.verify_iteration(mf.iteration_dir(root, wanted))])
    it, problems = _broadcast(verdict, single)
    if wanted is not None:
        if problems[0]:
            raise CheckpointError(f"--ckpt-step {wanted}: {problems[0]}; choose a complete "
                                  f"iteration of {root} (saved: {mf.saved_iterations(root)[:5]})")
        return wanted
    if it is None:
        if problems:
            raise CheckpointError(f"--load: no complete checkpoint in '{root}': "
                                  + "; ".join(problems) + "; restore the damaged files, or "
                                  "start without --load")
        return None
    for p in problems:
        _print0(f"> WARNING: {p}")
    if problems:
        _print0(f"> falling back to the newest complete checkpoint: "
                f"{mf.iteration_dir(root, it)}")
    return it


def load(ts: TrainState, ckpt: CheckpointConfig) -> None:
    """Bring ``ts`` to the checkpoint ``ckpt.load`` names (the newest complete one, or
    ``--ckpt-step``), DCP or pre-DCP, at any layout.  Collective over the world."""
    root = ckpt.load
    started = time.perf_counter()
    if not os.path.isdir(root) and root == ckpt.save:
        _print0(f"> no checkpoint in {root} yet: starting from scratch")
        return
    if not os.path.isdir(root):
        raise CheckpointError(f"--load: '{root}' does not exist; give the folder a run saved "
                              "with --save")
    if not os.path.isfile(os.path.join(root, mf.MARKER)) and not mf.saved_iterations(root):
        if root == ckpt.save:
            _print0(f"> no checkpoint in {root} yet: starting from scratch")
            return
        raise CheckpointError(f"--load: '{root}' holds no checkpoint (no {mf.MARKER}, no "
                              "iter_* folder); give the folder a run saved with --save")
    iteration = _legacy_iteration(root)
    if iteration is not None:
        load_legacy_checkpoint(ts, ckpt, root, iteration)
    else:
        iteration = select_checkpoint(root, _single(ts), ckpt.ckpt_step)
        if iteration is None:
            raise CheckpointError(f"--load: no checkpoint found in '{root}'")
        _load_dcp(ts, ckpt, mf.iteration_dir(root, iteration))
    position = ts.part("data")
    seen = set(map(tuple, _gather([iteration, position.iteration, position.consumed["train"]],
                                  _single(ts))))
    if len(seen) != 1:
        raise RuntimeError(f"ranks loaded different checkpoints from {root}: {sorted(seen)}")
    _print0(policy.loaded_line(iteration, mf.iteration_dir(root, iteration), started))


def _legacy_iteration(root: str) -> Optional[int]:
    """The iteration of a pre-DCP checkpoint (metadata.json without a manifest) under the
    marker, or None."""
    it, _ = mf.read_marker(root)
    d = mf.iteration_dir(root, it) if it is not None else None
    if d and os.path.isfile(os.path.join(d, "metadata.json")) and \
            not os.path.isfile(os.path.join(d, mf.MANIFEST)) and \
            not os.path.isfile(os.path.join(d, ".metadata")):
        return it
    return None


def _load_dcp(ts: TrainState, ckpt: CheckpointConfig, it_dir: str) -> None:
    with open(os.path.join(it_dir, "metadata.json")) as f:
        meta = json.load(f)
    restore_training_state(ts, ckpt, meta, saved_tensors(it_dir), it_dir,
                           lambda sd: load_chunked(sd, it_dir, _single(ts)))


def restore_training_state(ts: TrainState, ckpt: CheckpointConfig, meta: dict, saved,
                           where: str, fill) -> None:
    """Bring ``ts`` to the state ``capture_training_state`` took: ``saved`` is the
    index of what the source holds ({key: DCP tensor metadata}: global size, dtype),
    ``where`` names the source in messages, and ``fill(sd)`` writes the source's values
    into the target tensors of ``sd`` in place, resharded to this rank's layout (DCP for a
    checkpoint folder, the peers' exchange for a snapshot).  Collective over the world.

    The policy is the checkpointer's: which parts load (``--finetune``: the weights
    only; ``--no-load-optim`` / ``--no-load-rng``; a source without optimizer state) and
    what is said about the rest; the parts do the rest."""
    c, everything = ckpt, ts
    values = from_metadata(meta)
    skip = set()
    if c.finetune:
        skip = {n for n in everything.names() if n not in ("model", "moe_expert_bias")}
    if c.no_load_optim or values.get("optimizer", {}).get("step") is None:
        skip.add("optimizer")
        if not c.finetune and not c.no_load_optim and ts.trains:
            _print0(f"> {where} holds no optimizer state: optimizer starts fresh")
    if c.no_load_rng:
        skip.add("rng")
    parts = everything.subset(n for n in everything.names() if n not in skip)
    # a checkpoint of another model says so before any other part finds its tensors missing
    check_against(everything.subset(["model"]).load_targets(saved, values), saved, where)
    targets = parts.load_targets(saved, values)
    check_against(targets, saved, where)
    with torch.no_grad():
        fill(tensors_of(targets))
    parts.load_state_dict({n: {**values.get(n, {}), **targets.get(n, {})}
                           for n in parts.names()})
    if "rng" in skip or targets.get("rng"):
        return
    if not meta.get("rng_ranks"):
        _print0(f"> {where} holds no RNG state (weights only): generators keep their "
                f"seeded state")
    else:
        _print0(f"> RNG state not loaded: no rank of {where} had this rank's TP/PP/CP/VPP "
                f"coordinates ({ts.description.get('layout')}); generators keep their "
                f"seeded state")
