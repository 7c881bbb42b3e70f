"""``megalite plan --validate-run``: run one iteration of a small layout on N CPU gloo
processes and hold the planner's per-rank predictions to what the run really holds and sends.

The planner is only worth trusting at scale if, where it can be checked, it is right:
weights, gradients and optimizer states must match byte for byte, activations (a model of
the kernels) within 10%, and communication per group and op within 1%.

MoE runs: a rank's all-to-all bytes depend on the routing; they are compared as the mean over
its EP group, which the planner's uniform share equals exactly (``ep_group_means``).

Activations are the *peak* bytes held for backward during the iteration (so with PP this
is the in-flight peak of the schedule): every tensor autograd saves, followed live through
``saved_tensors_hooks`` and deduplicated by storage, plus tensors custom autograd Functions
keep on ``ctx`` (the vocab-parallel cross entropy keeps its fp32 exp(logits) there, out of
the hooks' sight).  Parameters are not activations and are skipped.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as torch_dist

from megalite import comm
from megalite.cli.arguments import OneLineErrorParser, parse_args
from megalite.config import ConfigError
from megalite.parallel_state import ParallelState, RankGrid, pick_device_and_backend
from megalite.planner import model_spec as ms
from megalite.planner.comm_model import predict_comm_volume
from megalite.planner.layout import layout_from_config
from megalite.planner.memory import Precision, layout_state_bytes, predict_rank_memory
from megalite.testing import DistributedTestError, WorkerPool
from megalite.transformer.attention_kernels import attention_kernel_of
from megalite.training.loop import Trainer

MEMORY_ROWS = ("weights", "grads", "optimizer", "activations")
ACT_TOL, COMM_TOL = 0.10, 0.01


# ---- measuring (runs on every rank) ---------------------------------------------------

def _local(t):
    """A DTensor's (FSDP2 shard's) local tensor; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_parameter(t) -> bool:
    """A parameter or a view of one (FSDP2's gathered parameters are fresh ``Parameter``s,
    saved by the layers that use them): not an activation."""
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None),
                                                           torch.nn.Parameter)


class LiveSaved:
    """Bytes of activations alive now and at the peak, each storage counted once."""

    def __init__(self, params):
        self.skip = {_local(p).untyped_storage().data_ptr() for p in params}
        self.refs: Dict[int, list] = {}
        self.live = self.peak = 0
        self._ctx_seen: Dict[int, weakref.ref] = {}

    def acquire(self, storage) -> Optional[int]:
        ptr = storage.data_ptr()
        if ptr in self.skip or storage.nbytes() == 0:
            return None
        row = self.refs.setdefault(ptr, [0, storage.nbytes()])
        if row[0] == 0:
            self.live += row[1]
            self.peak = max(self.peak, self.live)
        row[0] += 1
        return ptr

    def release(self, ptr: int):
        row = self.refs[ptr]
        row[0] -= 1
        if row[0] == 0:
            self.live -= row[1]
            del self.refs[ptr]

    # saved_tensors_hooks: a holder per saved tensor, released when autograd drops it
    def pack(self, t):
        if _is_parameter(t):
            return t
        ptr = self.acquire(t.untyped_storage())
        return t if ptr is None else _Holder(t.detach(), ptr, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Holder) else h

    def note_ctx_tensors(self, output):
        """Tensors custom Functions stored on ctx in ``output``'s graph (not seen by hooks)."""
        todo, seen = [getattr(output, "grad_fn", None)], set()
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            todo += [n for n, _ in node.next_functions]
            if not isinstance(node, torch.autograd.function.BackwardCFunction):
                continue
            for v in vars(node).values():
                if isinstance(v, torch.Tensor) and not _is_parameter(v) and \
                        not self._known(v):
                    ptr = self.acquire(v.untyped_storage())
                    if ptr is not None:
                        weakref.finalize(v, self.release, ptr)

    def _known(self, t) -> bool:
        ref = self._ctx_seen.get(id(t))
        if ref is not None and ref() is t:
            return True
        self._ctx_seen[id(t)] = weakref.ref(t)
        return False


class _Holder:
    __slots__ = ("t", "ptr", "owner")

    def __init__(self, t, ptr, owner):
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self):
        self.owner.release(self.ptr)


def _storages_bytes(tensors, skip=()) -> int:
    seen = {_local(s).untyped_storage().data_ptr() for s in skip}
    total = 0
    for t in tensors:
        t = _local(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def measure_rank(argv: List[str]) -> dict:
    """One training iteration on this rank: model-state bytes, peak activations, comm."""
    warnings.filterwarnings("ignore", category=FutureWarning)   # torch's c10d renames
    cfg = parse_args(argv)
    state = ParallelState.build(RankGrid.from_config(cfg), torch_dist.get_rank())
    trainer = Trainer(cfg, state, "cpu")
    trainer.setup()
    params = [p for c in trainer.model_chunks for p in c.parameters()]
    opt = trainer.optimizer
    live = LiveSaved(params)
    for chunk in trainer.model_chunks:            # ctx tensors of each micro-batch's graph
        def fwd(*a, _f=chunk.forward, **k):
            out = _f(*a, **k)
            live.note_ctx_tensors(out)
            return out
        chunk.forward = fwd
    iterator = trainer.data_iterator(trainer.train_ds, 0)
    comm.counter.reset()
    with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
        trainer.train_step(iterator)
    volume = comm.counter.snapshot()
    grads = [opt.grad(p) for p in opt.params]
    moments = [v for s in opt.inner.state.values() for k, v in s.items()
               if k in ("exp_avg", "exp_avg_sq")]
    return {"weights": _storages_bytes(params), "grads": _storages_bytes(grads),
            "optimizer": _storages_bytes(list(opt.masters) + moments, skip=params),
            "activations": live.peak, "comm": volume}


# ---- predicting and comparing (the launching process) ---------------------------------

def predict(cfg, rank: int) -> dict:
    # the kernel the run's attention takes (CPU SDPA with dropout: its math path)
    device, _ = pick_device_and_backend(cfg.training.device, cfg.parallel.distributed_backend)
    mem = predict_rank_memory(cfg, rank, attention_kernel=attention_kernel_of(cfg, device))
    # Full recomputation's re-materialised layer lives inside checkpoint's own hooks, out of
    # the measurement's sight: compare what the forward stores.
    mem["activations"] -= mem["recompute_working"]
    # measured after the step: the states kept between steps (FSDP2's gathered units and
    # unsharded gradients live only inside the step)
    mem.update(kept_state_bytes(cfg, rank))
    return {**{k: mem[k] for k in MEMORY_ROWS}, "comm": predict_comm_volume(cfg, rank)}


def kept_state_bytes(cfg, rank: int) -> dict:
    """Weights / grads / optimizer bytes rank ``rank`` keeps between steps."""
    L = layout_from_config(cfg)
    half = cfg.optimizer.bf16 or cfg.optimizer.fp16
    params = L.stage_params(cfg.model, L.pp_rank_of(rank))
    return layout_state_bytes(params, L, Precision.bf16() if half else Precision.fp32())


def compare(pred: dict, meas: dict) -> List[dict]:
    """One row per memory kind and per group/op, each with ``ok``."""
    rows = []
    for k in MEMORY_ROWS:
        p, m = pred[k], meas[k]
        tol = ACT_TOL if k == "activations" else 0.0
        rows.append(dict(what=k, pred=p, meas=m, ok=abs(m - p) <= tol * p))
    zero = {"calls": 0, "bytes": 0}
    for key in sorted(set(pred["comm"]) | set(meas["comm"])):
        p, m = pred["comm"].get(key, zero), meas["comm"].get(key, zero)
        rows.append(dict(what=key, pred=p["bytes"], meas=m["bytes"], calls=(p["calls"],
                         m["calls"]), ok=abs(m["bytes"] - p["bytes"]) <= COMM_TOL * p["bytes"]))
    return rows


def _diff(p: int, m: int) -> str:
    if p == m:
        return "0"
    return f"{(m - p) / p:+.1%}" if p else "new"


def format_table(per_rank: List[List[dict]]) -> str:
    """Ranks with identical rows share one block ("ranks 0,1")."""
    blocks: Dict[str, List[int]] = {}
    for r, rows in enumerate(per_rank):
        blocks.setdefault(repr([(x["what"], x["pred"], x["meas"]) for x in rows]), []).append(r)
    lines = [f"{'ranks':<8} {'what':<22} {'predicted':>12} {'measured':>12} {'diff':>8} "
             f"{'calls p/m':>10}  ok"]
    for ranks in blocks.values():
        label = ",".join(map(str, ranks))
        for x in per_rank[ranks[0]]:
            calls = "{}/{}".format(*x["calls"]) if "calls" in x else ""
            lines.append(f"{label:<8} {x['what']:<22} {x['pred']:>12,} {x['meas']:>12,} "
                         f"{_diff(x['pred'], x['meas']):>8} {calls:>10}  "
                         f"{'yes' if x['ok'] else 'NO'}")
            label = ""
    return "\n".join(lines)


def run_argv(flags: List[str], nproc: int) -> List[str]:
    """pretrain_gpt.py flags for a one-iteration mock-data run on ``nproc`` ranks."""
    argv = ["--world-size", str(nproc), *flags]
    if "--data-path" not in flags and "--mock-data" not in flags:
        argv.append("--mock-data")
    for flag, value in (("--train-iters", "1"), ("--lr", "1e-4")):   # required, irrelevant
        if flag not in flags:
            argv += [flag, value]
    return argv + ["--eval-iters", "0"]


def validate(flags: List[str], nproc: int, pool=None) -> tuple:
    """(per-rank comparison rows, all ok); ``pool``: a megalite.testing.PoolManager to reuse."""
    argv = run_argv(flags, nproc)
    cfg = parse_args(argv)
    preds = [predict(cfg, r) for r in range(nproc)]
    if pool is None:
        pool = WorkerPool(nproc, timeout_s=300)
        try:
            measured = pool.run(measure_rank, argv)
        finally:
            pool.close()
    else:
        measured = pool.run(nproc, measure_rank, argv)
    measured = ep_group_means(cfg, measured)
    rows = [compare(p, m) for p, m in zip(preds, measured)]
    return rows, all(x["ok"] for r in rows for x in r)


def ep_group_means(cfg, measured: List[dict]) -> List[dict]:
    """MoE: what one rank's all-to-alls carry depends on where its tokens were routed (it
    sends its pairs, it receives what the others chose to send it); the planner predicts
    the uniform share, which is exactly the mean over the EP group.  So those bytes are
    compared as the EP group's mean (calls are per rank and stay as measured)."""
    if not cfg.model.num_experts or cfg.parallel.ep == 1:
        return measured

    grid = RankGrid.from_config(cfg)
    key = "ep/all_to_all"
    out = [dict(m, comm={k: dict(v) for k, v in m["comm"].items()}) for m in measured]
    for r, m in enumerate(out):
        if key in m["comm"]:
            members = grid.group_of("ep", r)
            m["comm"][key]["bytes"] = sum(measured[q]["comm"][key]["bytes"]
                                          for q in members) // len(members)
    return out


USAGE = """usage: megalite plan --validate-run --nproc N [pretrain_gpt.py flags]

Runs one iteration of the layout on N CPU gloo processes (mock data unless --data-path) and
prints, per rank, predicted vs measured bytes of weights, gradients, optimizer states, peak
activations held for backward, and communication per group/op.  Exit 0 when model states
match exactly, activations within 10% and communication within 1%; else 1."""


def header(cfg) -> str:
    L = layout_from_config(cfg)
    rc = f", recompute {L.recompute}" if L.recompute != "none" else ""
    return (f"{L.short()}: {L.num_micro_batches} micro-batch(es) of {L.micro_batch} x "
            f"{cfg.model.seq_length} tokens per DP rank, {'bf16' if cfg.optimizer.bf16 else 'fp32'}"
            f"{rc}; activations = peak held for backward in iteration 1")


def main(argv: Optional[List[str]] = None, out=sys.stdout) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE, file=out)
        return 0
    ap = OneLineErrorParser(prog="megalite plan --validate-run", add_help=False,
                            allow_abbrev=False, help_hint="megalite plan --help")
    ap.add_argument("--validate-run", action="store_true")
    ap.add_argument("--nproc", type=int, default=1)
    args, flags = ap.parse_known_args(argv)
    if args.nproc < 1:
        raise ConfigError("--nproc must be a positive integer")
    cfg = parse_args(run_argv(flags, args.nproc))

    try:
        rows, ok = validate(flags, args.nproc)
    except DistributedTestError as exc:            # the run itself broke: show its traceback
        print(f"megalite: the run failed: {exc}", file=sys.stderr)
        return 1
    print(header(cfg) + "\n\n" + format_table(rows), file=out)
    bad = sorted({x["what"] for r in rows for x in r if not x["ok"]})
    print(f"\n{'PASS' if ok else 'FAIL'}: weights/grads/optimizer exact, activations within "
          f"{ACT_TOL:.0%}, communication within {COMM_TOL:.0%}"
          + ("" if ok else f"; missed: {', '.join(bad)}"), file=out)
    if "activations" in bad and cfg.optimizer.bf16 and cfg.model.attention_dropout:
        print("note: on CPU, attention with dropout runs SDPA's math path, which computes "
              "bf16 in fp32; validate bf16 with --attention-dropout 0", file=out)
    if {"weights", "grads", "optimizer"} & set(bad) and cfg.parallel.use_distributed_optimizer:
        print("note: with --use-distributed-optimizer weights and grads live in flat buffers "
              "padded to a multiple of DP x CP, and each rank keeps 1/(DP x CP) of the fp32 "
              "masters and Adam states (docs/distributed_optimizer.md)", file=out)
    return 0 if ok else 1
