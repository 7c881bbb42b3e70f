"""Schedules share one contract, so the training loop never cares which one runs:

``fn(forward_step, batches, model_chunks, state, cfg, forward_only=False, events=None)
-> list[dict]``

``forward_step(batch, model) -> (output, loss_func)``; ``loss_func(output) -> (loss,
report)`` where ``loss`` is what backward starts from and ``report`` holds detached sums
for logging.  ``batches`` is the list of this rank's micro-batches for the iteration.
With pipelining only the last stage computes losses, so only it returns reports; the
other stages return ``[]`` (the loop sums reports and all-reduces over dp-cp, and its
writer rank sits on the last stage).  ``events``, when a list, receives the pipelined
schedules' ``(op, wall start, wall end)`` records; schedules issue no collective besides
their p2p exchanges (the loop hands the events to ``timeline.record_iteration``).

What a schedule needs of a model chunk: ``set_input_tensor(x)`` on non-first chunks,
``pre_process`` and, for zero bubble on the first chunk, ``register_stage_input_hook``.

Pipelined schedules do not hand-code their order: ``pipeline_schedules.plan`` builds the per-rank
program (F / BW / B / W ops and blocking p2p batches) and ``PipelineExecutor`` walks it,
so the simulator's bubble and deadlock analysis is about exactly what runs.

The schedules are ``pipeline_schedules.SCHEDULES`` (1F1B, interleaved 1F1B, zero bubble ZB-H1,
DualPipeV, ZB-V); a registered schedule needs nothing here: ``PipelinedSchedule(name)`` runs it,
splitting backward into B (input grads) and W (weight grads, ``weight_grad.py``) when the
entry says ``split_backward``.  A message whose producer and consumer are chunks of this
rank (the bottom of the V: DualPipeV, ZB-V) is handed over without p2p.
"""
from __future__ import annotations

import time
from typing import List

import torch
from torch.autograd.graph import get_gradient_edge

from megalite.comm import overlap
from megalite.comm.flight_recorder import site
from megalite.config import pipeline_program, pipeline_schedules
from megalite.config.pipeline_program import stage_index
from megalite.pipeline_parallel import fsdp_sync
from megalite.pipeline_parallel.p2p import StageLink, activation_shape
from megalite.pipeline_parallel.weight_grad import backward_input


def forward_backward_no_pipelining(forward_step, batches, model_chunks, state, cfg,
                                   forward_only: bool = False, events=None):
    """Gradient accumulation: forward and backward each micro-batch in turn.  ``events``,
    when a list, receives each F and BW with wall-clock times (the DP overlap timeline).
    ``cfg`` None: a bare step (no run configuration, so no overlapped pairs)."""
    (model,) = model_chunks
    paired = cfg is not None and cfg.parallel.overlap_moe_expert_parallel_comm
    if paired and not forward_only and len(batches) > 1:
        return _no_pipelining_paired(forward_step, batches, model, events)
    reports = []
    for i, batch in enumerate(batches):
        t0 = time.time()
        site.step = forward = pipeline_program.Op("F", i)        # the flight recorder's call site
        output, loss_func = forward_step(batch, model)
        loss, report = loss_func(output)
        t1 = time.time()
        if not forward_only:
            site.step = backward = pipeline_program.Op("BW", i)
            loss.backward()
        if events is not None:
            events += [(forward, t0, t1)] + (
                [] if forward_only else [(backward, t1, time.time())])
        reports.append(report)
    site.step = None
    return reports


def _no_pipelining_paired(forward_step, batches, model, events):
    """PP = 1 with ``--overlap-moe-expert-parallel-comm`` (Megatron's combined 1F1B without
    pipelining): F0, then F(i) beside BW(i-1) as an overlapped pair (``comm/overlap.py``),
    then the last BW -- one more micro-batch's activations held than plain accumulation."""
    losses, reports, log = {}, [], []

    def forward(i):
        t0 = time.time()
        site.step = op = pipeline_program.Op("F", i, paired=True)
        output, loss_func = forward_step(batches[i], model)
        losses[i], report = loss_func(output)
        reports.append(report)
        log.append((op, t0, time.time()))

    def backward(i):
        t0 = time.time()
        site.step = op = pipeline_program.Op("BW", i, paired=True)
        losses.pop(i).backward()
        log.append((op, t0, time.time()))

    forward(0)
    for i in range(1, len(batches)):
        overlap.run_pair(lambda i=i: forward(i), lambda i=i: backward(i - 1))
    backward(len(batches) - 1)
    site.step = None
    if events is not None:
        events += log
    return reports


class PipelineExecutor:
    """Runs one rank's program; keeps stored activations, messages and a wall-clock log."""

    def __init__(self, forward_step, batches, model_chunks, state, cfg, forward_only: bool,
                 split_backward: bool = False, vshape: bool = False,
                 async_p2p: bool = False, overlap: bool = False):
        self.forward_step, self.batches, self.chunks = forward_step, batches, model_chunks
        self.state, self.forward_only = state, forward_only
        self.split_backward = split_backward and not forward_only
        self.p, self.v, self.rank = state.pp.size, len(model_chunks), state.pp.rank
        self.vshape = vshape
        # --overlap-moe-expert-parallel-comm: F&B pairs run as two cooperative halves
        self.overlap, self.pair_switches = overlap and not forward_only, 0
        # asynchronous p2p: each message posted on its own at its batch, a receive waited
        # for only by the op that reads it, the sends at the next batch (they hold memory)
        self.async_p2p, self.arriving, self.sending = async_p2p, {}, []
        self.p2p_wait_s = 0.0   # time spent waiting for messages (exposed p2p)
        ref = next(model_chunks[0].parameters())
        self.link = StageLink(state, activation_shape(cfg, state), ref.dtype, ref.device)
        self.received, self.to_send = {}, {}
        self.stash = {}      # (mb, chunk) -> (stage input or None, output edge / loss)
        self.pending_w = {}  # (mb, chunk) -> PendingWeightGrad
        self.reports: List[dict] = []
        self.events = []     # (op, wall start, wall end)
        self.max_in_flight = 0
        self._wall0, self._perf0 = time.time(), time.perf_counter()

    def _now(self) -> float:
        return self._wall0 + (time.perf_counter() - self._perf0)

    def run(self, program) -> "PipelineExecutor":
        program = list(program)
        fsdp = fsdp_sync.fsdp_chunks(self.chunks)
        # FSDP2 chunks: one gradient reduction each, after their last backward op
        last_grad_op = {}
        if fsdp and not self.forward_only:
            for chunk in fsdp:
                fsdp_sync.defer_gradient_sync(chunk)
            for i, op in enumerate(program):
                if op.kind in ("BW", "B", "W") and self.chunks[op.chunk] in fsdp:
                    last_grad_op[op.chunk] = i
        reduce_after = {i: c for c, i in last_grad_op.items()}
        i = 0
        while i < len(program):
            halves = self._pair_at(program, i) if self.overlap else None
            if halves is None:
                op, t0 = program[i], self._now()
                site.step = op                 # the flight recorder's call site
                getattr(self, "_" + op.kind)(op)
                self.events.append((op, t0, self._now()))
                done = [i]
            else:
                self._run_pair(*halves)
                done = list(range(i, i + len(halves[0]) + len(halves[1])))
            for j in done:
                if j in reduce_after:
                    fsdp_sync.reduce_gradients(self.chunks[reduce_after[j]])
            self.max_in_flight = max(self.max_in_flight, len(self.stash) + len(self.pending_w))
            i = done[-1] + 1
        site.step = None
        self._finish_sends()
        if self.forward_only:
            for chunk in fsdp:
                fsdp_sync.reshard(chunk)
        if self.stash or self.pending_w or self.to_send or self.received or self.arriving:
            raise RuntimeError("pipeline program ended with work left over")
        return self

    # -- overlapped F&B pairs (comm/overlap.py) ---------------------------------------------
    @staticmethod
    def _pair_at(program, i):
        """([F], [B or BW, W?]) when ``program[i]`` opens an F&B pair, else None."""
        op = program[i]
        if not (op.paired and op.kind == "F" and i + 1 < len(program)):
            return None
        b = program[i + 1]
        if not (b.paired and b.kind in ("B", "BW")):
            return None
        back = [b]
        w = program[i + 2] if i + 2 < len(program) else None
        if w is not None and w.paired and w.kind == "W" and (w.mb, w.chunk) == (b.mb, b.chunk):
            back.append(w)
        return [op], back

    def _run_pair(self, forward_ops, backward_ops):
        """The two halves side by side: each half's MoE all-to-alls are issued async and the
        other half computes meanwhile.  Each op is logged with its own start and end (the
        two halves' intervals overlap)."""
        def half(ops):
            def run():
                for op in ops:
                    t0 = self._now()
                    site.step = op
                    getattr(self, "_" + op.kind)(op)
                    self.events.append((op, t0, self._now()))
            return run
        record = overlap.run_pair(half(forward_ops), half(backward_ops))
        self.pair_switches += record.switches

    def _is_last(self, op) -> bool:
        return stage_index(self.rank, op.chunk, self.p, self.vshape) == self.p * self.v - 1

    def _needs(self, op):
        return pipeline_program.needs(op, self.rank, self.p, self.v, self.vshape)

    def _deliver(self, op, tensor) -> None:
        """What ``op`` produced: to the next p2p batch, or straight to this rank's other
        chunk when it consumes it (detached, as a received message would be)."""
        msg, dst = pipeline_program.produces(op, self.rank, self.p, self.v, self.vshape)
        if dst == self.rank:
            self.received[msg] = None if tensor is None else tensor.detach()
        else:
            self.to_send[msg] = tensor

    # -- compute ---------------------------------------------------------------------------
    def _F(self, op):
        model = self.chunks[op.chunk]
        need = self._needs(op)
        x = None
        if need:
            x = self._take(need[0])
            if not self.forward_only:
                x.requires_grad_(True)
            model.set_input_tensor(x)
        captured, hook = {}, None
        if self.split_backward and model.pre_process and x is None:
            # Zero bubble on the first stage: split B/W where the model says its input is.
            hook = model.register_stage_input_hook(lambda out: captured.setdefault("x", out))
        try:
            output, loss_func = self.forward_step(self.batches[op.mb], model)
        finally:
            if hook is not None:
                hook.remove()
            if x is not None:
                model.set_input_tensor(None)   # don't hold the last input across iterations
        if self._is_last(op):
            output, report = loss_func(output)
            self.reports.append(report)
        else:
            self._deliver(op, output)
            if not self.forward_only:
                # Keep only the graph edge: the activation itself is freed once sent.
                output = get_gradient_edge(output)
        if not self.forward_only:
            self.stash[(op.mb, op.chunk)] = (x if x is not None else captured.get("x"), output)

    def _BW(self, op):
        x, out = self.stash.pop((op.mb, op.chunk))
        need = self._needs(op)
        grad = self._take(need[0]) if need else None
        if op.kind == "BW":
            torch.autograd.backward([out], None if grad is None else [grad])
            gx = x.grad if x is not None and x.is_leaf else None
        else:   # the chunk's parameters now: FSDP2 registers its gathered ones in forward;
            # in the V the last chunk's tied output layer reads chunk 0's embedding, so
            # every chunk's (``backward_input`` skips those this graph does not reach)
            chunks = self.chunks if self.vshape else [self.chunks[op.chunk]]
            params = list({id(p): p for c in chunks for p in c.parameters()
                           if p.requires_grad}.values())
            grads, pending = backward_input([out], [grad], [x], params)
            self.pending_w[(op.mb, op.chunk)] = pending
            gx = grads[0] if x is not None and x.is_leaf else None
        if pipeline_program.produces(op, self.rank, self.p, self.v, self.vshape):
            self._deliver(op, gx)

    _B = _BW  # input-gradient half (zero bubble): same bookkeeping, split inside

    def _W(self, op):
        self.pending_w.pop((op.mb, op.chunk)).run()

    # -- communication ---------------------------------------------------------------------
    def _comm(self, op):
        sends = [(msg, self.to_send.pop(msg), peer) for msg, peer in op.sends]
        if not self.async_p2p:
            t0 = time.perf_counter()
            self.received.update(self.link.exchange(sends, list(op.recvs)))
            self.p2p_wait_s += time.perf_counter() - t0
            return
        self._finish_sends()
        # one message a call, in the batch's order: FIFO per rank pair as in one batch
        for send in sends:
            self.sending.append(self.link.exchange_async([send], [])[1])
        for recv in op.recvs:
            buffers, pending = self.link.exchange_async([], [recv])
            self.received.update(buffers)
            self.arriving[recv[0]] = pending

    def _take(self, msg):
        """A received message, waiting for it only now (asynchronous p2p)."""
        pending = self.arriving.pop(msg, None)
        if pending is not None:
            t0 = time.perf_counter()
            pending.wait()
            self.p2p_wait_s += time.perf_counter() - t0
        return self.received.pop(msg)

    def _finish_sends(self):
        t0 = time.perf_counter()
        for pending in self.sending:
            pending.wait()
        self.sending = []
        self.p2p_wait_s += time.perf_counter() - t0


NO_PIPELINING = "no-pipelining"     # PP = 1: the name the timeline records


def pipeline_schedule_name(cfg, state) -> str:
    """The registered schedule this rank runs (``pipeline_schedules.resolve_schedule``)."""
    return pipeline_schedules.resolve_schedule(cfg.parallel.pipeline_schedule, state.vpp_size).name


def run_schedule(schedule: str, forward_step, batches, model_chunks, state, cfg,
                 forward_only: bool = False, async_p2p=None,
                 overlap=None) -> PipelineExecutor:
    """Walk this rank's program of ``schedule``; returns the executor (reports, events,
    peak in-flight micro-batches, p2p wait, pair switches) -- tests and benchmarks read it.
    ``async_p2p``: None = what the schedule's entry says (always on when overlapping);
    ``overlap``: None = ``--overlap-moe-expert-parallel-comm`` (with
    ``--delay-wgrad-compute`` splitting the paired backwards)."""
    if len(model_chunks) != max(state.vpp_size, 1):
        raise ValueError(f"{len(model_chunks)} model chunks for VPP={state.vpp_size}")
    par = cfg.parallel
    if overlap is None:
        overlap = bool(par.overlap_moe_expert_parallel_comm)
    delay = overlap and bool(par.delay_wgrad_compute)
    program = pipeline_schedules.plan(schedule, state.pp.size, len(batches), len(model_chunks),
                                      forward_only, overlap, delay)[state.pp.rank]
    spec = pipeline_schedules.get_schedule(schedule)
    if async_p2p is None:
        async_p2p = spec.async_p2p or overlap
    ex = PipelineExecutor(forward_step, batches, model_chunks, state, cfg, forward_only,
                          split_backward=spec.split_backward or delay, vshape=spec.vshape,
                          async_p2p=async_p2p, overlap=overlap)
    return ex.run(program)


class PipelinedSchedule:
    """The schedule contract (module docstring) for one registered pipeline schedule."""

    def __init__(self, name: str):
        self.name = pipeline_schedules.get_schedule(name).name

    def __call__(self, forward_step, batches, model_chunks, state, cfg,
                 forward_only: bool = False, events=None):
        ex = run_schedule(self.name, forward_step, batches, model_chunks, state, cfg,
                          forward_only)
        if events is not None:
            events.extend(ex.events)
        return ex.reports

    def __repr__(self):
        return f"PipelinedSchedule({self.name!r})"


def get_forward_backward_func(cfg, state):
    """PP = 1: no pipelining; otherwise the schedule ``--pipeline-schedule`` resolves to
    (``auto``: interleaved with virtual stages, else 1F1B)."""
    if state.pp.size == 1:
        return forward_backward_no_pipelining
    return PipelinedSchedule(pipeline_schedule_name(cfg, state))
