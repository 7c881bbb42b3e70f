"""How many operators one Megatron-Core transformer layer dispatches, forward and backward:
the host-side work behind the planner's launch model (docs/planner.md, "Where the 2026
rows are off"; ``planner/kernels.py``'s KERNELS_PER_LAYER is an assumption of 16 dense /
30 MoE kernels a forward).

The layer is Megatron-Core's own (its local spec: no Transformer Engine, so norms, RoPE and
attention run unfused and count more than TE's fused kernels would; the MoE router, the
token permutation and the experts run the same Python on a GPU), built and run on CPU in one
gloo process (EP 1, the all-to-all dispatcher).  Every ATen operator that is not a view or an
allocation is one kernel on a GPU.  Forward operators are attributed to the submodule that
issued them (attention, router, dispatcher + permutation, experts, the rest).  The host's
time per operator is the layer's wall time at a size where the CPU's kernels cost next to
nothing, divided by the count.

    python benchmarks/megatron_layer_ops.py [--local-experts 4 8 16]

Needs megatron-core (``launch/setup_env.sh`` installs it for the parity tests).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import types

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# views and allocations: no kernel on a GPU
NO_KERNEL = {"view", "_unsafe_view", "expand", "t", "transpose", "permute", "reshape", "slice",
             "select", "unsqueeze", "squeeze", "detach", "alias", "as_strided", "split",
             "split_with_sizes", "unbind", "narrow", "lift_fresh", "empty", "empty_like",
             "new_empty", "empty_strided", "new_empty_strided", "sym_size", "sym_stride",
             "is_same_size", "_reshape_alias"}
SCOPES = (("self_attention", "attention"), ("router", "router"),
          ("token_dispatcher", "dispatch"), ("experts", "experts"))


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return "unknown CPU"


class _Stream:
    """Megatron's dispatcher keeps a device-to-host stream; on CPU it has nothing to do."""
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return types.SimpleNamespace(wait=lambda *a: None, synchronize=lambda: None)


def _cpu_stand_ins():
    """What Megatron-Core asks of CUDA at build and run time, answered for CPU."""
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.tensor_parallel as mtp
    import megatron.core.tensor_parallel.random as mrand
    import megatron.core.transformer.attention as mattn
    import megatron.core.transformer.moe.moe_utils as mmu
    tracker = types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext(),
                                    is_initialized=lambda: True)
    for mod in (mrand, mtp, mattn):
        mod.get_cuda_rng_tracker = lambda *a, **k: tracker
    mmu.te_general_gemm = None                      # the router's TE GEMM path


class Count(TorchDispatchMode):
    """Kernels by scope: the innermost scoped submodule running when each op is issued."""
    def __init__(self):
        super().__init__()
        self.by_scope = collections.Counter()
        self.scope = ["rest"]

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_KERNEL:
            self.by_scope[self.scope[-1]] += 1
        return func(*args, **(kwargs or {}))


def _scoped(mode: Count, scope: str, fn):
    def run(*args, **kwargs):
        mode.scope.append(scope)
        try:
            return fn(*args, **kwargs)
        finally:
            mode.scope.pop()
    return run


def _layer(local_experts):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe = dict(num_moe_experts=local_experts, moe_router_topk=min(8, local_experts),
               moe_ffn_hidden_size=32, moe_token_dispatcher_type="alltoall",
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3) \
        if local_experts else {}
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8,
                            num_query_groups=2, kv_channels=8, ffn_hidden_size=128,
                            qk_layernorm=True, normalization="RMSNorm", gated_linear_unit=True,
                            add_bias_linear=False, params_dtype=torch.float32,
                            use_cpu_initialization=True, moe_grouped_gemm=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            persist_layer_norm=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, **moe)
    spec = get_gpt_layer_local_spec(num_experts=local_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=True)
    return build_module(spec, config=cfg, layer_number=1)


def count(local_experts: int, seq: int = 256) -> dict:
    """Kernels of one layer's forward (by scope) and backward; 0 experts: a dense layer."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    layer = _layer(local_experts)
    mode = Count()

    def leave(module, args, output):
        mode.scope.pop()           # returns None: the output stays the module's

    for name, module in layer.named_modules():
        scope = next((s for key, s in SCOPES if name.split(".")[-1] == key), None)
        if scope is not None:
            module.register_forward_pre_hook(lambda m, a, s=scope: mode.scope.append(s))
            module.register_forward_hook(leave)
        dispatcher = getattr(module, "token_dispatcher", None)    # not an nn.Module
        for attr in dir(dispatcher) if dispatcher is not None else ():
            if attr.startswith(("dispatch_", "token_", "combine_")):
                setattr(dispatcher, attr, _scoped(mode, "dispatch", getattr(dispatcher, attr)))
    x = torch.randn(seq, 1, 64, requires_grad=True)
    mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(seq)
    with mode:
        out = layer(x, attention_mask=mask, rotary_pos_emb=rope)
    out = out[0] if isinstance(out, tuple) else out
    backward = Count()
    with backward:
        out.backward(torch.randn_like(out))
    return dict(forward=dict(mode.by_scope), backward=sum(backward.by_scope.values()))


def host_seconds(local_experts: int, seq: int = 8, reps: int = 50) -> tuple:
    """Median wall seconds of one layer's forward and backward at a size where the CPU's
    kernels cost next to nothing (hidden 64, 8 tokens, one thread): the host's share of
    each operator -- Megatron's Python, autograd and ATen dispatch -- which a GPU run pays
    before each launch (the CUDA launch call itself comes on top)."""
    import time
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    layer = _layer(local_experts)
    x = torch.randn(seq, 1, 64, requires_grad=True)
    mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)(seq)
    fwd, bwd = [], []
    for i in range(reps + 10):                       # 10 to warm up
        t0 = time.perf_counter()
        out = layer(x, attention_mask=mask, rotary_pos_emb=rope)
        out = out[0] if isinstance(out, tuple) else out
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        if i >= 10:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--local-experts", type=int, nargs="+", default=[4, 8, 16])
    a = ap.parse_args(argv)
    try:
        import megatron.core  # noqa: F401  (optional dependency: the reference)
    except ImportError:
        print("megatron-core is not installed: pip install --no-deps megatron-core einops",
              file=sys.stderr)
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29561"),
                      RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    _cpu_stand_ins()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    print(f"Megatron-Core {megatron.core.__version__}, local spec on CPU: kernels "
          "(non-view ATen operators) of one layer")
    torch.set_num_threads(1)
    cols = ("attention", "router", "dispatch", "experts", "rest")
    print("| layer | local experts | forward | " + " | ".join(cols) + " | backward | "
          "host ms fwd / bwd | us per kernel fwd / bwd |")
    print("|---|---|---|" + "---|" * len(cols) + "---|---|---|")
    for e in [0] + a.local_experts:
        c = count(e)
        fwd = c["forward"]
        n_f, n_b = sum(fwd.values()), c["backward"]
        h_f, h_b = host_seconds(e)
        print(f"| {'MoE' if e else 'dense'} | {e or '-'} | {n_f} | "
              + " | ".join(str(fwd.get(k, 0)) for k in cols) + f" | {n_b} | "
              f"{1e3 * h_f:.2f} / {1e3 * h_b:.2f} | {1e6 * h_f / n_f:.1f} / "
              f"{1e6 * h_b / n_b:.1f} |")
    print(f"(host times on this machine: {_cpu_name()}, one thread)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
