"""Save / resume a training run on torch.distributed.checkpoint, at any layout.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt     written last, atomically, after a barrier
    DIR/iter_0000100/.metadata, __<rank>_0.distcp   DCP: every rank writes its own shards
    DIR/iter_0000100/metadata.json            iteration, consumed samples, layout, args, ...
    DIR/iter_0000100/manifest.json            size + SHA-256 of every file above

Every tensor is saved as its global shape and this rank's chunks at global offsets
(``checkpointing.sharded_state``), so DCP reshards on load: weights, fp32 masters, Adam
moments (plain or distributed optimizer, FSDP2 pieces), at any TP/PP/VPP/DP/CP/EP.  The
optimizer step and the iteration are JSON; RNG states are per-rank uint8 tensors restored
where the rank's model coordinates exist in the checkpoint.  Loading verifies the manifest,
falls back to the newest complete iteration, and checks that every rank loaded the same one.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import threading
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megalite import comm
from megalite.checkpointing import manifest as mf
from megalite.checkpointing.dcp_format import (CheckpointIOError, ChunkedTensor, load_chunked,
                                               save_chunked, saved_tensors)
from megalite.checkpointing.model_io import DCP_FORMAT as FORMAT
from megalite.checkpointing.sharded_state import (fsdp_piece, master_pieces,
                                                  model_sharded_state_dict,
                                                  optimizer_sharded_state_dict, spec_chunks)
from megalite.distributed.replicas import check_replicas
from megalite.errors import CheckpointError
from megalite.training import checkpoint_io_policy as policy
from megalite.moe.moe_layer import expert_bias_state, load_expert_bias_state
from megalite.parallel_state import Group
from megalite.param_spec import group_coords, param_table
from megalite.training.legacy_checkpoint import load_legacy_checkpoint

STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq")


def run_layout(trainer) -> dict:
    p = trainer.cfg.parallel
    out = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "world_size": trainer.cfg.world_size,
           "vpp": trainer.state.vpp_size, "bf16": trainer.cfg.optimizer.bf16}
    if p.use_distributed_optimizer:
        out["distributed_optimizer"] = True
    return out


def _rng_coords(trainer) -> dict:
    """Where this rank's generators belong: equal coordinates draw the same streams."""
    s = trainer.state
    return {"tp": [s.tp.rank, s.tp.size], "pp": [s.pp.rank, s.pp.size],
            "cp": [s["cp"].rank, s["cp"].size], "dp": [s["dp"].rank, s["dp"].size],
            "vpp": s.vpp_size, "cuda": trainer.device == "cuda"}


def _single(trainer) -> bool:
    """A one-rank run (tests run those inside a larger process group): no collectives."""
    return trainer.state.grid.world_size == 1 or not dist.is_initialized()


def _world(handle=None) -> Group:
    """The world (or a group over all of it) as a ``comm`` group."""
    return Group("world", list(range(dist.get_world_size())), handle, dist.get_rank())


def _gather(obj, single: bool = False, handle=None) -> list:
    if single or not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    return comm.all_gather_object(obj, _world(handle))


def _broadcast(obj, single: bool = False):
    if single or not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    return comm.broadcast_object(obj, 0, _world())


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
        from megalite.errors import StorageError

        raise StorageError(f"--save {root} is not writable: {exc.strerror or exc}; choose a "
                           "folder this job may write") from None


def _rng_tensors(trainer) -> Dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if trainer.device == "cuda":
        out["cuda"] = torch.cuda.get_rng_state()
    for c, chunk in enumerate(trainer.model_chunks):
        for name, st in chunk.rng_tracker.get_states().items():
            for dev, t in st.items():
                out[f"tracker{c}.{name}.{dev}"] = t
    return out


def _training_state_dict(trainer):
    """(DCP state dict, optimizer step or None) of this rank."""
    sd = dict(model_sharded_state_dict(trainer.model_chunks, trainer.state))
    sd.update(optimizer_sharded_state_dict(trainer.optimizer, trainer.model_chunks,
                                           trainer.state))
    step = sd.pop("optimizer.step", None)
    step = float(step.chunks[0][1]) if step is not None else None
    out = {k: ChunkedTensor(v.global_shape, v.chunks, v.writer) for k, v in sd.items()}
    for k, t in _rng_tensors(trainer).items():
        out[f"rng.rank{trainer.state.rank}.{k}"] = ChunkedTensor(t.shape, [((0,), t)])
    return out, step


def _metadata(trainer, step, rng_ranks) -> dict:
    """What metadata.json says (JSON only; readers of the interim format find ``model``,
    the TP/PP sizes and ``extra`` where they always were)."""
    cfg, d = trainer.cfg, trainer.cfg.data
    tokenizer = {"tokenizer_type": d.tokenizer_type,
                 "tokenizer_model": os.path.abspath(d.tokenizer_model)
                 if d.tokenizer_model else None, "vocab_size": cfg.model.vocab_size}
    return {"format": FORMAT, "iteration": trainer.iteration,
            "consumed_samples": trainer.consumed_samples, "optimizer_step": step,
            "layout": run_layout(trainer), "rng_ranks": rng_ranks,
            "tensor_model_parallel_size": cfg.parallel.tp,
            "pipeline_model_parallel_size": cfg.parallel.pp,
            "model": dataclasses.asdict(cfg.model),
            "extra": {"consumed_samples": trainer.consumed_samples,
                      "layout": run_layout(trainer), "tokenizer": tokenizer,
                      "loop_state": trainer.loop_state()},    # fp16 scaler, skipped steps
            "args": json.loads(json.dumps(dataclasses.asdict(cfg), default=str))}


def capture_training_state(trainer, every_rank_meta: bool = False):
    """(this rank's tensors as global-shape chunks, the run's JSON metadata): what a disk
    checkpoint and an in-memory snapshot hold alike.  Collective over the world (the RNG
    coordinates are gathered, the expert biases reduced over PP).  The metadata is rank 0's
    alone unless ``every_rank_meta`` (a snapshot: every rank keeps it, any may survive)."""
    sd, step = _training_state_dict(trainer)
    rng_ranks = _gather(_rng_coords(trainer), _single(trainer))
    bias = (expert_bias_state(trainer.model_chunks, trainer.state)       # collective over pp
            if trainer.cfg.model.moe_router_enable_expert_bias else None)
    meta = None
    if every_rank_meta or trainer.state.rank == 0:
        meta = _metadata(trainer, step, rng_ranks)
        if bias is not None:        # a router buffer, not a parameter: JSON
            meta["extra"]["moe_expert_bias"] = bias
    return sd, meta


def save_training_checkpoint(trainer) -> str:
    """Collective over the world.  The marker moves only after every rank's files, the
    metadata and the manifest are on disk; any rank's failure (ENOSPC, ...) raises on every
    rank and leaves the previous checkpoint the latest.

    With ``--async-save`` the loop stalls only while this rank's chunks are copied; the
    files, the manifest and the marker are written by a background thread over a process
    group of its own (so its collectives never interleave with training's), and the next
    save -- or the end of training -- waits for it first."""
    cfg, state = trainer.cfg, trainer.state
    finish_pending_save(trainer)
    root = cfg.checkpoint.save
    it_dir = mf.iteration_dir(root, trainer.iteration)
    if mf.read_marker(root)[0] == trainer.iteration and mf.verify_iteration(it_dir) is None:
        return it_dir                      # already saved (interval save at the last step)
    started = time.perf_counter()
    _print0(f"> saving checkpoint at iteration {trainer.iteration} to {root}")
    trainer.strategy.wait_param_gathers()         # --overlap-param-gather: gathers in flight
    check_replicas(trainer.model_chunks, state)   # never write drifted copies to disk
    single = _single(trainer)
    stale = state.rank == 0 and os.path.isdir(it_dir)   # leftovers of an interrupted save
    _agree(_os_error(shutil.rmtree, it_dir) if stale else None, f"clearing {it_dir}", single)
    sd, meta = capture_training_state(trainer)
    keep = cfg.checkpoint.keep_last_n_checkpoints
    write = functools.partial(_write_guarded, it_dir=it_dir, root=root, meta=meta,
                              rank=state.rank, single=single, keep=keep,
                              iteration=trainer.iteration, started=started)
    if not cfg.checkpoint.async_save:
        with policy.interruptible_save():
            write(sd, group=None)
        return it_dir
    staged = {k: ChunkedTensor(v.global_shape, [(o, t.clone()) for o, t in v.chunks]
                               if v.writer else [], v.writer) for k, v in sd.items()}
    group = None if single else state.background_group().handle
    trainer.pending_save = AsyncSave(functools.partial(write, staged, group=group))
    return it_dir


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


def finish_pending_save(trainer) -> None:
    """Wait for the background save, if any (before the next save and at exit)."""
    pending = getattr(trainer, "pending_save", None)
    if pending is not None:
        trainer.pending_save = None
        pending.wait()


def save_model_checkpoint(root: str, model_cfg: dict, full_sd: Dict[str, torch.Tensor],
                          sizes: Dict[str, int], iteration: int = 0,
                          info: Optional[dict] = None) -> str:
    """Write full (logical) model tensors as a training checkpoint -- the same DCP files,
    metadata.json, manifest and marker ``save_training_checkpoint`` writes, weights only --
    from one process (what ``tools/checkpoint/convert.py`` writes).

    Each tensor is cut into the chunks the ranks of the layout ``sizes`` ({"tp", "ep",
    "expert-tp": size}) hold, so a run at that layout reads exactly its own pieces; DCP
    reshards for any other layout.  ``info``: metadata entries to add (``args``, ``extra``,
    where the weights came from).  A failed write removes its folder."""
    from megalite.checkpointing.sharded_state import layout_chunks
    from megalite.config import ModelConfig
    from megalite.models.gpt import parameter_specs
    from megalite.moe.moe_layer import split_expert_bias

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


def load_training_checkpoint(trainer) -> None:
    cfg = trainer.cfg
    root = cfg.checkpoint.load
    started = time.perf_counter()
    if not os.path.isdir(root) and root == cfg.checkpoint.save:
        _print0(f"> no checkpoint in {root} yet: starting from scratch")
        return
    if not os.path.isdir(root):
        raise CheckpointError(f"--load: '{root}' does not exist; give the folder a run saved "
                              "with --save")
    if not os.path.isfile(os.path.join(root, mf.MARKER)) and not mf.saved_iterations(root):
        if root == cfg.checkpoint.save:
            _print0(f"> no checkpoint in {root} yet: starting from scratch")
            return
        raise CheckpointError(f"--load: '{root}' holds no checkpoint (no {mf.MARKER}, no "
                              "iter_* folder); give the folder a run saved with --save")
    iteration = _legacy_iteration(root)
    if iteration is not None:
        load_legacy_checkpoint(trainer, root, iteration, run_layout(trainer))
    else:
        iteration = select_checkpoint(root, _single(trainer), cfg.checkpoint.ckpt_step)
        if iteration is None:
            raise CheckpointError(f"--load: no checkpoint found in '{root}'")
        _load_dcp(trainer, mf.iteration_dir(root, iteration))
    seen = set(map(tuple, _gather([iteration, trainer.iteration, trainer.consumed_samples],
                                  _single(trainer))))
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


def _check_shapes(it_dir: str, sd: dict, saved) -> None:
    for key, obj in sd.items():
        if key in saved and tuple(saved[key].size) != tuple(obj.size()):
            raise CheckpointError(f"{os.path.join(it_dir, '.metadata')}: '{key}' has shape "
                             f"{tuple(saved[key].size)}, this run expects {tuple(obj.size())} "
                             f"(a different model, which no layout change can reshard)")


def _load_dcp(trainer, it_dir: str) -> None:
    with open(os.path.join(it_dir, "metadata.json")) as f:
        meta = json.load(f)
    restore_training_state(trainer, meta, saved_tensors(it_dir), it_dir,
                           lambda sd: load_chunked(sd, it_dir, _single(trainer)))


def restore_training_state(trainer, meta: dict, saved, where: str, fill) -> None:
    """Bring ``trainer`` to the state ``capture_training_state`` took: ``saved`` is the
    index of what the source holds ({key: DCP tensor metadata}: global size, dtype),
    ``where`` names the source in messages, and ``fill(sd)`` writes the source's values
    into the target tensors of ``sd`` in place, resharded to this rank's layout (DCP for a
    checkpoint folder, the peers' exchange for a snapshot).  Collective over the world."""
    cfg, state = trainer.cfg, trainer.state
    it_dir = where
    model = {k: ChunkedTensor(v.global_shape, v.chunks)
             for k, v in model_sharded_state_dict(trainer.model_chunks, state).items()}
    missing = [k for k in model if k not in saved]
    if missing:
        raise CheckpointError(f"{os.path.join(it_dir, '.metadata')}: lacks {len(missing)} "
                              f"model tensors, e.g. {missing[:3]} (a checkpoint of another "
                              "model); load the checkpoint of this model")
    sd = dict(model)
    want_optim = not cfg.checkpoint.finetune and not cfg.checkpoint.no_load_optim
    restore_optim = None
    if want_optim:
        if meta.get("optimizer_step") is None:
            _print0(f"> {it_dir} holds no optimizer state: optimizer starts fresh")
        else:
            optim_sd, restore_optim = _optimizer_load_plan(trainer, saved)
            sd.update(optim_sd)
    rng_sd, restore_rng = {}, None
    if not cfg.checkpoint.finetune and not cfg.checkpoint.no_load_rng:
        rng_sd, restore_rng = _rng_load_plan(trainer, meta, saved)
        sd.update(rng_sd)
    _check_shapes(it_dir, sd, saved)
    with torch.no_grad():
        fill(sd)
    trainer.optimizer.reload_model_params()       # masters follow the loaded weights
    load_expert_bias_state(trainer.model_chunks, meta.get("extra", {}).get("moe_expert_bias", {}))
    if cfg.checkpoint.finetune:
        return
    trainer.iteration = meta["iteration"]
    trainer.consumed_samples = meta["consumed_samples"]
    trainer.load_loop_state(meta.get("extra", {}).get("loop_state"))
    if restore_optim is not None:
        restore_optim(meta["optimizer_step"])
    if restore_rng is not None:
        restore_rng()
    elif not cfg.checkpoint.no_load_rng and not meta.get("rng_ranks"):
        _print0(f"> {it_dir} holds no RNG state (weights only): generators keep their "
                f"seeded state")
    elif not cfg.checkpoint.no_load_rng:
        _print0(f"> RNG state not loaded: no rank of {it_dir} had this rank's TP/PP/CP/VPP "
                f"coordinates ({run_layout(trainer)}); generators keep their seeded state")


def _optimizer_load_plan(trainer, saved):
    """(DCP entries to load, a function that installs them into the optimizer).

    Each parameter's state is loaded as its whole TP-local tensor (chunks from the spec),
    so the same code serves the plain optimizer and the distributed one (which then keeps
    its flat range); DCP reshards from whatever layout saved it."""
    opt, state = trainer.optimizer, trainer.state
    coords = group_coords(state)
    names, specs = {}, {}
    for chunk in trainer.model_chunks:
        for name, p, spec in param_table(chunk).named(chunk):
            names[id(p)], specs[id(p)] = name, spec
    keys = [k for k in STATE_KEYS if any(s.startswith(f"optimizer.{k}.") for s in saved)]
    if opt.bf16:
        keys.append("master")
    local: Dict[int, Dict[str, torch.Tensor]] = {}
    sd = {}
    held = opt.params                    # the distributed optimizer: only its ranges' params
    if getattr(opt, "sharded_buffers", ()):
        held = [p for buf in opt.sharded_buffers for p, _, _ in buf.shard_ranges()]
    for p in held:
        local[id(p)] = {}
        piece, at, _ = fsdp_piece(p, state)        # FSDP2: this rank's piece of p
        for k in keys:
            t = torch.zeros(piece.shape, dtype=torch.float32, device=piece.device)
            local[id(p)][k] = t
            sd[f"optimizer.{k}.{names[id(p)]}"] = ChunkedTensor(
                specs[id(p)].full_shape, spec_chunks(specs[id(p)], t, coords, at))
    missing = [k for k in sd if k not in saved]
    if missing:
        raise CheckpointError(f"--load: the checkpoint lacks optimizer tensors, e.g. "
                              f"{missing[:3]}; add --no-load-optim to start the optimizer fresh")
    state_keys = [k for k in keys if k != "master"]

    def restore(step: float) -> None:
        per_tensor = {}          # id(stepped tensor) -> {state key: values}
        with torch.no_grad():
            if getattr(opt, "sharded_buffers", ()):
                pieces = master_pieces(opt)
                for b, (buf, master) in enumerate(zip(opt.sharded_buffers, opt.masters)):
                    index = {id(p): i for i, p in enumerate(buf.params)}
                    for lo_, piece in pieces[b]:
                        per_tensor[id(piece)] = {k: torch.zeros_like(piece) for k in state_keys}
                    for p, lo, hi in buf.shard_ranges():
                        p_lo = buf.start + lo - buf.offsets[index[id(p)]]
                        flat = {k: v.reshape(-1)[p_lo:p_lo + hi - lo]
                                for k, v in local[id(p)].items()}
                        lo_, piece = next((a, t) for a, t in pieces[b]
                                          if a <= lo and hi <= a + t.numel())
                        for k in state_keys:
                            per_tensor[id(piece)][k][lo - lo_:hi - lo_] = flat[k]
                        if opt.bf16:
                            master[lo:hi] = flat["master"]
            else:
                for p, master in zip(opt.params, opt.masters):
                    per_tensor[id(master)] = {k: _like_param(local[id(p)][k].to(master.dtype), p)
                                              for k in state_keys}
                    if opt.bf16:
                        master.copy_(local[id(p)]["master"])
        inner = opt.inner.state_dict()
        flat_params = [t for g in opt.inner.param_groups for t in g["params"]]
        inner["state"] = {i: {"step": torch.tensor(step, dtype=torch.float32),
                              **per_tensor[id(t)]} for i, t in enumerate(flat_params)}
        opt.inner.load_state_dict(inner)
    return sd, restore


def _like_param(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor placed as ``p`` is: a DTensor over p's mesh for FSDP2."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride())


def _rng_load_plan(trainer, meta, saved):
    """(entries, installer) for the generators of the saved rank at this rank's
    coordinates (same DP rank when it exists, else DP rank 0's); ({}, None) if none."""
    mine = _rng_coords(trainer)
    same = lambda c: all(c.get(k) == mine[k] for k in ("tp", "pp", "cp", "vpp", "cuda"))
    ranks = [r for r, c in enumerate(meta.get("rng_ranks") or []) if same(c)]
    if not ranks:
        return {}, None
    src = next((r for r in ranks if meta["rng_ranks"][r]["dp"][0] == mine["dp"][0]), ranks[0])
    prefix = f"rng.rank{src}."
    bufs = {k[len(prefix):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
            for k, v in saved.items() if k.startswith(prefix)}
    sd = {prefix + k: ChunkedTensor(t.shape, [((0,), t)]) for k, t in bufs.items()}

    def restore() -> None:
        torch.set_rng_state(bufs["cpu"])
        if "cuda" in bufs and trainer.device == "cuda":
            torch.cuda.set_rng_state(bufs["cuda"])
        for c, chunk in enumerate(trainer.model_chunks):
            states: Dict[str, dict] = {}
            for k, t in bufs.items():
                parts = k.split(".")
                if parts[0] == f"tracker{c}":
                    states.setdefault(".".join(parts[1:-1]), {})[parts[-1]] = t
            if states:
                chunk.rng_tracker.set_states(states)
    return sd, restore
