"""Communication: what each parallel dimension sends, on which link, and how long it takes.

``events`` lists every collective of one iteration on one rank in megalite.comm's
accounting convention (elements = the all-reduced tensor, the gathered output, the
reduce-scattered input, the all-to-all input, the p2p message), so the same list gives
``predict_comm_volume`` (to check against ``megalite.comm.counter``) and the time model.

Costs are alpha-beta with ring bandwidth terms (Thakur et al. 2005; NCCL's "bus bandwidth"):
  all-reduce      2(n-1)/n * S / B + 2*ceil(log2 n) * alpha
  all-gather / reduce-scatter  (n-1)/n * S / B + ceil(log2 n) * alpha
  all-to-all      (n-1)/n * S / B + (n-1) * alpha
  p2p             S / B + alpha
where B is the intra-node link when the group fits in a node; across nodes, ring
collectives get the NICs of the group's members in one node together (NCCL runs one ring
per NIC), capped by NVLink, while p2p and all-to-all get the rank's own NIC.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List

from megalite.config import MegaliteConfig, ModelConfig
from megalite.moe.loss_names import extra_loss_names
from megalite.parallel_state import shard_group_names
from megalite.planner import linear_attention_cost as lac
from megalite.planner import model_spec as ms
from megalite.planner.hardware import Cluster
from megalite.planner.layout import Layout, layout_from_config
from megalite.planner.moe_cost import dispatch_fanout


@dataclass(frozen=True)
class Event:
    group: str
    op: str           # all_reduce | all_gather | reduce_scatter | all_to_all | send | recv
    elements: int     # per call, megalite.comm convention
    calls: float      # per iteration on this rank
    dtype_bytes: int = 2
    kind: str = "tp"  # which time bucket: tp, cp, ep, pp, dp, embedding
    # op "dispatch" (DeepEP / HybridEP): copies of each element over the network and over
    # NVLink (moe_cost.dispatch_fanout)
    fanout: tuple = ()


def group_geometry(L: Layout, group: str) -> tuple:
    """(size, stride) of a group in the tp-cp-ep-dp-pp rank order."""
    S, E = L.dense_shards, L.expert_shards
    return {"tp": (L.tp, 1), "cp": (L.cp, L.tp), "dp": (L.dp, L.tp * L.cp),
            "dp-cp": (L.dp * L.cp, L.tp), "ep": (L.ep, L.etp), "expert-tp": (L.etp, 1),
            "expert-dp": (L.edp, L.etp * L.ep),
            # --num-distributed-optimizer-instances: an instance is S neighbouring DP x CP
            # ranks; the same shard's ranks in the R instances are S x TP apart
            "dp-cp-shard": (S, L.tp), "dp-cp-replicate": (L.instances, L.tp * S),
            "expert-dp-shard": (E, L.etp * L.ep),
            "expert-dp-replicate": (L.instances, L.etp * L.ep * E)}[group]


def link_of(cluster: Cluster, size: int, stride: int) -> tuple:
    """(bytes/s, alpha) for a group of ``size`` ranks ``stride`` apart; "node" here is the
    NVLink domain (an NVL72 rack's 72 GPUs, not its trays of 4)."""
    gpn = cluster.nvlink_domain
    if stride * (size - 1) < gpn and (stride * size <= gpn):
        return cluster.link(stride * size)
    per_node = max(1, min(size, gpn // stride)) if stride < gpn else 1
    inter_bw, alpha = cluster.link(gpn + 1)
    intra_bw, _ = cluster.link(1)
    return min(intra_bw, inter_bw * per_node), alpha


def leaves_node(L: Layout, cluster: Cluster, group: str) -> bool:
    """Whether the ranks of ``group`` span more than one NVLink domain (so its traffic
    uses NICs)."""
    size, stride = group_geometry(L, group)
    return stride * size > cluster.nvlink_domain


def collective_time(op: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    if n <= 1:
        return 0.0
    steps = math.ceil(math.log2(n))
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * steps * alpha
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / bw + steps * alpha
    if op == "all_to_all":
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    return nbytes / bw + alpha                       # send / recv


# ---- what is sent ---------------------------------------------------------------------

def events(m: ModelConfig, L: Layout, seq: int, pp_rank: int, grad_bytes: int = 4,
           sp_regather: bool = True, dtype_bytes: int = 2, *, fsdp_reshard: bool = True,
           param_gather_bytes: int | None = None, dispatcher: str = "alltoall",
           dispatch_node: int = 8) -> List[Event]:
    """Every collective rank ``pp_rank`` of the pipeline issues in one iteration.

    ``dtype_bytes``: an activation or weight element (2 under bf16, 4 in fp32 training).
    ``fsdp_reshard=False``: ZeRO-3 keeps the gathered weights from forward to backward
    (with PP it always does: one gather and one reduction per step, ``fsdp_events``).
    ``param_gather_bytes``: ZeRO's parameter gathers in another dtype (1 with FP8 weights).
    ``dispatcher``: the EP token dispatch (moe_cost.DISPATCHERS), ``dispatch_node`` the
    ranks it counts as one node.
    """
    out: List[Event] = []
    a = dtype_bytes
    mbs, t = L.num_micro_batches, L.tp
    T = (seq // L.cp) * L.micro_batch
    h = m.hidden_size
    first, last = pp_rank == 0, pp_rank == L.output_rank
    # the MTP layers (on the last stage) communicate like the model's last layer
    n_dense, n_moe = ms.with_mtp_layers(
        m, ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split), last)
    n_layers = n_dense + n_moe
    depths = (m.mtp_num_layers or 0) if last else 0
    full = L.recompute == "full"
    # Tensor parallel: an entry (f) and exit (g) collective around attention and each MLP.
    # f: forward identity / SP all-gather, backward all-reduce / reduce-scatter; g: the
    # reverse.  With SP a column-parallel linear saves only its input's sequence shard and
    # all-gathers it again in backward for the weight gradient (Megatron's and megalite's
    # layers alike; ``sp_regather=False`` models an implementation that keeps the gathered
    # input instead).  Backward's f-side reduction runs behind the weight-gradient GEMM
    # (Megatron's async TP) and SP's re-gather behind the input-grad GEMM, so they are
    # "tp_hidden".  Full recomputation repeats the forward's collectives except
    # each layer's last exit, whose output no saved tensor needs (non-reentrant
    # checkpointing stops early).  MLA's entries are its column-parallel up projections'
    # inputs (the latents; ``model_spec.mla_projections``) and the shared rope key, which
    # is gathered from the sequence shards (or copied into the TP region without SP).
    if t > 1:
        # MoE layers: only the shared expert is a TP MLP (experts use expert-TP)
        mlp_tp = n_dense + (n_moe if m.moe_shared_expert_intermediate_size else 0)
        exits = n_layers + mlp_tp                       # blocks with a TP entry/exit pair
        if m.multi_latent_attention:
            entries = [(i, n_layers) for _, i, _, how in ms.mla_projections(m)
                       if how == "column"]
        else:
            entries = [(h, n_layers)]
        entries = [(T * w, n) for w, n in entries + [(h, mlp_tp)] if n]
        rope = T * m.qk_pos_emb_head_dim if m.multi_latent_attention else 0
        rec = 1 if full else 0
        rec_out = exits - n_layers if full else 0
        # (kind "tp_fwd": the forward pass's own collectives, which PyTorch's async TP
        # overlaps; recomputation's and backward's are "tp")
        if L.sp:
            for size, n in entries:
                out += [Event("tp", "all_gather", size, mbs * n, a, kind="tp_fwd"),
                        Event("tp", "all_gather", size, mbs * n * rec, a),
                        Event("tp", "reduce_scatter", size, mbs * n, a, kind="tp_hidden")]
                if sp_regather:
                    out.append(Event("tp", "all_gather", size, mbs * n, a, kind="tp_hidden"))
            out += [Event("tp", "reduce_scatter", T * h, mbs * exits, a, kind="tp_fwd"),
                    Event("tp", "all_gather", T * h, mbs * exits, a),
                    Event("tp", "reduce_scatter", T * h, mbs * rec_out, a)]
            if rope:
                out += [Event("tp", "all_gather", rope, mbs * n_layers, a, kind="tp_fwd"),
                        Event("tp", "all_gather", rope, mbs * n_layers * rec, a),
                        Event("tp", "reduce_scatter", rope, mbs * n_layers, a)]
        else:
            out += [Event("tp", "all_reduce", size, mbs * n, a, kind="tp_hidden")
                    for size, n in entries]
            out += [Event("tp", "all_reduce", T * h, mbs * exits, a, kind="tp_fwd"),
                    Event("tp", "all_reduce", T * h, mbs * rec_out, a)]
            if rope:
                out.append(Event("tp", "all_reduce", rope, mbs * n_layers, a))
        # vocab-parallel embedding: reduce (SP: scatter), whose backward (SP) gathers the
        # gradient again -- on the first stage, and for each MTP depth's shifted tokens
        embeds = (1 if first else 0) + depths
        out.append(Event("tp", "reduce_scatter" if L.sp else "all_reduce", T * h,
                         mbs * embeds, a))
        if L.sp:
            out.append(Event("tp", "all_gather", T * h, mbs * embeds, a))
        if depths:
            # MTP's eh_proj: column-parallel on [embedding ; hidden] (2h), its output
            # gathered to the full hidden size (then split to SP's shard, whose backward
            # gathers again)
            if L.sp:
                out += [Event("tp", "all_gather", 2 * T * h, mbs * depths, a, kind="tp_fwd"),
                        Event("tp", "reduce_scatter", 2 * T * h, mbs * depths, a,
                              kind="tp_hidden"),
                        Event("tp", "all_gather", T * h, mbs * depths, a)]
                if sp_regather:
                    out.append(Event("tp", "all_gather", 2 * T * h, mbs * depths, a,
                                     kind="tp_hidden"))
            else:
                out.append(Event("tp", "all_reduce", 2 * T * h, mbs * depths, a,
                                 kind="tp_hidden"))
            out.append(Event("tp", "all_gather", T * h, mbs * depths, a, kind="tp_fwd"))
        if last:                      # the output layer + loss, once more per MTP depth
            heads = mbs * (1 + depths)
            op = ("all_gather", "reduce_scatter") if L.sp else (None, "all_reduce")
            if op[0]:
                out.append(Event("tp", op[0], T * h, heads, a))
            out.append(Event("tp", op[1], T * h, heads, a))
            if L.sp and sp_regather:  # the output layer is column-parallel too: re-gather
                out.append(Event("tp", "all_gather", T * h, heads, a, kind="tp_hidden"))
            # vocab-parallel cross entropy: the max, then (target logit, sum of exp)
            out += [Event("tp", "all_reduce", T, heads, dtype_bytes=4),
                    Event("tp", "all_reduce", 2 * T, heads, dtype_bytes=4)]
    # Context parallel, per attention (context_parallel/ring.py, a2a.py).  Recomputation
    # (full, or selective: its default module is core attention) repeats the forward's up
    # to the last tensor backward needs (non-reentrant checkpointing stops there).
    if L.cp > 1:
        fwd = 2 if L.recompute in ("full", "selective") else 1
        state, sends = lac.cp_state_sends(m, L, pp_rank)  # Gated DeltaNet: the state walk
        if sends:
            out += [Event("cp", op, state, sends, 4, kind="cp") for op in ("send", "recv")]
        n_attn = n_layers - sum(lac.linear_layer_counts(m, L, pp_rank).values())
        a_q, g, d, dv = ms.attention_head_dims(m)     # MLA: expanded heads, v narrower
        if L.cp_comm == "a2a":
            # q|k|v in and the output back, forward; the same two on the gradients backward.
            # Recomputing core attention alone stops after attention, before the output's
            # all-to-all (which saves nothing); a full-layer recompute runs it too.
            qkv = T * (a_q * d + g * (d + dv)) // t
            ctx = T * a_q * dv // t
            out += [Event("cp", "all_to_all", qkv, n_attn * mbs * (fwd + 1), a, kind="cp"),
                    Event("cp", "all_to_all", ctx, n_attn * mbs * (3 if full else 2), a,
                          kind="cp")]
        elif L.cp_comm == "allgather":
            # Llama 3's CP (and Megatron's --cp-comm-type allgather): all-gather K/V before
            # attention (again when recomputing), reduce-scatter dK/dV after its backward.
            # Planner-only: megalite runs p2p and a2a.
            kv = 2 * T * g * d // t * L.cp                 # the gathered K and V
            out += [Event("cp", "all_gather", kv, n_attn * mbs * (fwd + 1), a, kind="cp"),
                    Event("cp", "reduce_scatter", kv, n_attn * mbs, a, kind="cp")]
        else:
            # ring: CP-1 K/V transfers forward; backward CP-1 K/V and CP dK/dV transfers
            kv = T * g * (d + dv) // t
            steps = n_attn * mbs * ((L.cp - 1) * (fwd + 1) + L.cp)
            out += [Event("cp", "send", kv, steps, a, kind="cp"),
                    Event("cp", "recv", kv, steps, a, kind="cp")]
    # Expert parallel: dispatch + combine forward, the same backward.
    # (this rank sends its pairs and receives as many on average: the EP group's mean is
    # exact, a single rank's depends on routing); the per-expert counts are all-gathered
    # (int64) before each dispatch.
    fwd = n_moe * mbs * (2 if full else 1)
    if L.ep > 1 and n_moe:
        copies = T // (t if L.sp else 1) * m.moe_router_topk
        calls = n_moe * mbs * ((4 if full else 2) + 2)
        if dispatcher == "alltoall":
            out.append(Event("ep", "all_to_all", copies * h, calls, a, kind="ep"))
        else:                              # once per destination node / GPU, not per copy
            fan = dispatch_fanout(m, L, dispatcher, dispatch_node)
            out.append(Event("ep", "dispatch", T // (t if L.sp else 1) * h, calls, a,
                             kind="ep", fanout=fan))
        out.append(Event("ep", "all_gather", L.ep * m.num_experts, fwd, 8, kind="ep"))
    if L.etp > 1 and n_moe:
        out.append(Event("expert-tp", "all_gather", L.etp * m.num_experts, fwd, 8, kind="ep"))
    # The router's statistics under SP: summed over TP (forward all-reduces, fp32).
    if L.sp and t > 1 and n_moe:
        E, lb = m.num_experts, m.moe_router_load_balancing_type
        stats = [E]                                                   # expert counts
        if lb != "none" and m.moe_aux_loss_coeff:
            stats += [E] if lb == "aux_loss" else [L.micro_batch * E, L.micro_batch * E]
        if m.moe_z_loss_coeff:
            stats.append(1)
        for n in stats:
            out.append(Event("tp", "all_reduce", n, fwd, 4))
    # Pipeline: one activation forward and one gradient backward per micro-batch and chunk.
    if L.pp > 1:
        msg = T * h // t            # SP shard, or Megatron's scatter/gather split over TP
        sends = mbs * L.vpp * 2 - (mbs if first else 0) - (mbs if last else 0)
        out += [Event("pp", "send", msg, sends, a, kind="pp"),
                Event("pp", "recv", msg, sends, a, kind="pp")]
    # Data parallel: gradients (and parameters for ZeRO >= 1).
    params = L.stage_params(m, pp_rank, tp=t)
    w = param_gather_bytes or a
    if L.zero == 3:
        out += fsdp_events(m, L, params, pp_rank, grad_bytes, w, fsdp_reshard)
    else:
        out += _dp_events(params.dense, "dp-cp", L, grad_bytes, w)
        if params.expert:
            out += _dp_events(params.expert, "expert-dp", L, grad_bytes, w)
    if L.sp and t > 1:          # params that saw a sequence shard: norms, row-parallel
        per_norm = h * (2 if m.normalization == "LayerNorm" else 1)     # biases, positions
        # two norms a layer, the final norm; per MTP depth its enorm, hnorm and final norm
        n = (2 * n_layers + (1 if last else 0) + 3 * depths) * per_norm
        if m.multi_latent_attention:    # MLA's duplicated down projections, latent norms
            n += n_layers * (sum(i * o for _, i, o, how in ms.mla_projections(m)
                                 if how == "duplicated") + ms.mla_latent_norm_params(m))
        mlp_rows = n_dense + (n_moe if m.moe_shared_expert_intermediate_size else 0)
        n += (n_layers + mlp_rows) * h if m.add_bias_linear else 0     # (experts: no bias)
        n += n_moe * m.num_experts * h if m.num_experts else 0         # MoE routers
        if first and m.position_embedding_type == "learned_absolute":
            n += ms.max_positions(m) * h
        out.append(Event("tp", "all_reduce", n, 1, dtype_bytes=grad_bytes, kind="dp"))
    # tied output layer, or MTP's copy of the embedding on the last stage
    if L.pp > 1 and (not m.untie_embeddings_and_output_weights or m.mtp_num_layers) and \
            (first or last):
        out.append(Event("embedding", "all_reduce", m.padded_vocab_size(t) * h // t, 1,
                         dtype_bytes=grad_bytes, kind="dp"))
        # after the step the owner (first stage) broadcasts its updated copy: replicas stay
        # bit-identical whatever the update's rounding (megalite/distributed/replicas.py)
        out.append(Event("embedding", "broadcast", m.padded_vocab_size(t) * h // t, 1,
                         dtype_bytes=a, kind="dp"))
    # Bookkeeping scalars (fp64 token count and loss over dp-cp, fp32 grad norm over the
    # model-parallel group, experts' over expert-mp -- and, with sharded grads, first over
    # their DP group): bytes are nothing, but they are collectives the run makes.
    if L.dp * L.cp > 1:
        out.append(Event("dp-cp", "all_reduce", 1, 2, 8, kind="misc"))
    if L.zero >= 1:             # the squares of sharded gradients, over their shard group
        dense, expert = sharded_groups(L, "dense")[0], sharded_groups(L, "expert")[0]
        if L.dense_shards > 1:
            out.append(Event(dense, "all_reduce", 1, 1, 4, kind="misc"))
        experts_here = params.expert or (L.zero == 3 and m.num_experts)   # FSDP2: per class
        if experts_here and L.expert_shards > 1 and not fsdp_experts_with_dense(L):
            out.append(Event(expert, "all_reduce", 1, 1, 4, kind="misc"))
    # The extra-loss sums (the loop: the MoE terms, one loss per MTP depth) and the MoE
    # layers' statistics (moe/metrics.py; MTP's MoE layers among them), over dp-cp, then pp
    extra, table = m.mtp_num_layers or 0, 0
    if m.num_experts:
        extra += len(extra_loss_names(m))
        table = sum(1 for n in range(m.num_transformer_layers()) if m.is_moe_layer(n)) * \
            (m.num_experts + 3)
    for group, size in (("dp-cp", L.dp * L.cp), ("pp", L.pp)):
        if size > 1:
            out += [Event(group, "all_reduce", extra, 1, 8, kind="misc"),
                    Event(group, "all_reduce", table, 1, 8, kind="misc")]
    if L.tp * L.pp > 1:
        out.append(Event("mp", "all_reduce", 1, 1, 4, kind="misc"))
    if m.num_experts and L.etp * L.ep * L.pp > 1:     # expert squares: expert-TP x EP x PP
        out.append(Event("expert-mp", "all_reduce", 1, 1, 4, kind="misc"))
    return [e for e in out if e.calls > 0 and e.elements > 0]


def sharded_groups(L: Layout, grid: str) -> tuple:
    """(shard group, replicate group or None) of a grid's ZeRO >= 1 buffers or FSDP2 mesh."""
    return shard_group_names(grid, L.instances)


def fsdp_experts_with_dense(L: Layout) -> bool:
    """FSDP2 gives routed experts a mesh of their own only when it spans other ranks than
    the dense one (``distributed.fsdp2.fsdp_meshes`` compares the ranks); expert-DP and
    DP x CP are the same ranks exactly when EP = 1 and expert-TP = TP (the expert grid folds
    CP into expert-DP; tested against ``RankGrid``), and then experts are one unit with their
    layer."""
    return L.ep == 1 and L.etp == L.tp


def _dp_events(n: int, group: str, L: Layout, grad_bytes: int, w: int = 2) -> List[Event]:
    grid = "expert" if group == "expert-dp" else "dense"
    size = L.expert_shards if grid == "expert" else L.dense_shards
    shard, replicate = sharded_groups(L, grid) if L.zero >= 1 else (group, None)
    if L.zero == 0:
        size = L.dp * L.cp if grid == "dense" else L.edp
        return [Event(group, "all_reduce", n, 1, grad_bytes, "dp")] if size > 1 else []
    m = L.num_micro_batches
    n = -(-n // size) * size                  # sharded flat buffers are padded to d | n
    reduces = 1 if L.zero == 1 else m
    out = [Event(shard, "reduce_scatter", n, reduces, grad_bytes, "dp"),
           Event(shard, "all_gather", n, 1, w, "dp")] if size > 1 else []
    if replicate is not None:                 # the reduced shard, across the instances
        out.append(Event(replicate, "all_reduce", n // size, reduces, grad_bytes, "dp"))
    return out


def fsdp_events(m: ModelConfig, L: Layout, params, pp_rank: int, grad_bytes: int,
                w: int = 2, reshard: bool = True) -> List[Event]:
    """FSDP2 (``--use-torch-fsdp2``; ``distributed.fsdp2``), per unit as it runs.  Without
    PP every micro-batch gathers each unit for forward and again for backward -- the root
    (what no unit holds: the final norm, and the tied embedding) only once, it stays
    gathered -- and reduce-scatters every gradient.  With PP a chunk keeps its units
    gathered until its last backward and reduces once (``pipeline_parallel.fsdp_sync``):
    one all-gather and one reduce-scatter per parameter per step.  HSDP all-reduces each
    reduced shard across the instances.  One collective per unit and pass (calls); the
    elements are the totals (parameters are not padded here: FSDP2 pads dim 0 of each to
    the shard count).  ``reshard=False`` without PP: units stay gathered from forward to
    backward (torchtitan's "never"), one gather per unit and micro-batch."""
    out: List[Event] = []
    mbs = 1 if L.pp > 1 else L.num_micro_batches
    together = fsdp_experts_with_dense(L)
    n_dense, n_moe = ms.stage_layer_kinds(m, L.pp, pp_rank, L.vpp, *L.stage_split)
    untied = m.untie_embeddings_and_output_weights
    root = fsdp_root_params(m, L, pp_rank)
    # units of the stage (all its chunks): layers, an untied embedding / output layer; the
    # roots that hold parameters (the last stage's final norm; a tied embedding at PP = 1)
    units = n_dense + n_moe + (pp_rank == 0 and untied) + (pp_rank == L.output_rank and untied)
    roots = 1 if root else 0
    parts = [("dense", params.dense + (params.expert if together else 0), units, roots),
             ("expert", 0 if together else params.expert, n_moe, 0)]
    for grid, n, k, r in parts:
        size = L.dense_shards if grid == "dense" else L.expert_shards
        shard, replicate = sharded_groups(L, grid)
        if not n:
            continue
        once = L.pp > 1 or not reshard
        gathered = n if once else 2 * n - (root if grid == "dense" else 0)
        gathers = k + r if once else 2 * k + r        # per micro-batch (PP: per step)
        reduces = k + r
        if size > 1:
            out += [Event(shard, "all_gather", gathered / gathers, mbs * gathers, w, "dp"),
                    Event(shard, "reduce_scatter", n / reduces, mbs * reduces, grad_bytes,
                          "dp")]
        if replicate is not None:
            out.append(Event(replicate, "all_reduce", -(-n // size) / reduces, mbs * reduces,
                             grad_bytes, "dp"))
    return out


def fsdp_root_params(m: ModelConfig, L: Layout, pp_rank: int) -> int:
    """Parameters of a chunk's FSDP2 root (no unit of their own): the final norm on the last
    stage, and at PP = 1 the tied embedding (shared with the output layer).  Only matters
    without PP: there the root is gathered once per micro-batch, the units twice."""
    n = 0
    output = m.padded_vocab_size(L.tp) * m.hidden_size // L.tp
    if pp_rank == L.output_rank:  # head_params at PP = 1: the norm (+ an untied output layer)
        n += ms.head_params(m, L.tp, 1) - (output if m.untie_embeddings_and_output_weights
                                           else 0)
    if not m.untie_embeddings_and_output_weights and L.pp == 1:
        n += ms.embedding_params(m, L.tp)
    return n


def volume(evts: List[Event]) -> Dict[str, dict]:
    acc = defaultdict(lambda: {"calls": 0.0, "elements": 0.0, "bytes": 0.0})
    for e in evts:
        row = acc[f"{e.group}/{e.op}"]
        row["calls"] += e.calls
        row["elements"] += e.elements * e.calls
        row["bytes"] += e.elements * e.calls * e.dtype_bytes
    return {k: {kk: int(round(vv)) for kk, vv in v.items()} for k, v in sorted(acc.items())}


def predict_comm_volume(cfg: MegaliteConfig, rank: int = 0, *, grad_bytes: int = 4,
                        zero: int | None = None, sp_regather: bool = True
                        ) -> Dict[str, dict]:
    """Per-iteration ``{"group/op": {"calls", "elements", "bytes"}}`` for global ``rank``.

    Same keys and convention as ``megalite.comm.counter.snapshot()``; calls on groups of
    size 1 are skipped there and absent here.  ``sp_regather``: SP's backward re-gather of
    column-parallel inputs (megalite's local layers and Megatron / Transformer Engine's
    all do it; False models layers that keep the gathered input).  Without --bf16
    everything is fp32.
    """
    L = layout_from_config(cfg, zero)
    pp_rank = L.pp_rank_of(rank)
    bf16 = cfg.optimizer.bf16 or cfg.optimizer.fp16     # fp16: the same bytes as bf16
    return volume(events(cfg.model, L, cfg.model.seq_length, pp_rank,
                         grad_bytes if bf16 else 4, sp_regather, 2 if bf16 else 4))


# ---- how long it takes -----------------------------------------------------------------

def event_seconds(e: Event, L: Layout, cluster: Cluster) -> float:
    """Total time of an event over the iteration (all its calls).

    An all-to-all whose group leaves the node sends the share bound for the other nodes
    over the rank's own NIC while the in-node share takes NVLink at the same time."""
    if e.op == "dispatch":                           # DeepEP / HybridEP: NIC and NVLink
        size, stride = group_geometry(L, e.group)     # at once, each its own copies
        nic, alpha = cluster.link(cluster.num_gpus + 1)
        nvl, _ = cluster.link(1)
        nbytes = e.elements * e.dtype_bytes
        net, local = e.fanout
        t = max(nbytes * net / nic, nbytes * local / nvl)
        return e.calls * (t + (size - 1) * (alpha if net else cluster.eff.intra_latency_s))
    if e.group in ("pp", "embedding"):               # stage neighbours: other nodes unless
        size = 2                                      # the whole job fits in one node
        bw, alpha = cluster.link(L.world)
    elif e.group == "cp" and e.op in ("send", "recv"):  # ring steps: p2p, one NIC when
        size = 2                                          # the group leaves the node
        bw, alpha = cluster.link(L.cp * L.tp)
    else:
        size, stride = group_geometry(L, e.group)
        bw, alpha = link_of(cluster, size, stride)
        gpn = cluster.nvlink_domain
        if e.op == "all_to_all" and leaves_node(L, cluster, e.group):
            nic, alpha = cluster.link(stride * size)
            nvl, _ = cluster.link(1)
            local = max(1, min(size, gpn // max(1, stride)))   # group members in one node
            nbytes = e.elements * e.dtype_bytes
            t = max(nbytes * (size - local) / size / nic, nbytes * (local - 1) / size / nvl)
            return e.calls * (t + (size - 1) * alpha)
    return e.calls * collective_time(e.op, e.elements * e.dtype_bytes, size, bw, alpha)


def comm_seconds(evts: List[Event], L: Layout, cluster: Cluster,
                 ep_load: float = 1.0) -> Dict[str, float]:
    """Seconds per iteration by kind (before any overlap is subtracted).

    p2p sends and receives happen at once on a full-duplex link, so only sends count;
    bookkeeping scalars ("misc") cost latency only, well inside the noise.  ``ep_load``:
    the most loaded EP rank's share of the token copies over the mean
    (moe_cost.routing_imbalance) -- the dispatch / combine all-to-alls finish with it.
    """
    out: Dict[str, float] = defaultdict(float)
    for e in evts:
        if e.op == "recv" or e.kind == "misc":
            continue
        scale = ep_load if (e.group == "ep" and e.op in ("all_to_all", "dispatch")) else 1.0
        out[e.kind] += scale * event_seconds(e, L, cluster)
    return dict(out)
