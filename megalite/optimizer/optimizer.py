"""AdamW with fp32 master weights and clipping by a given global norm.

Under ``--bf16`` (and ``--fp16``) the model holds half-precision parameters whose gradients
accumulate in fp32 (the data-parallel strategy owns that storage,
``megalite.distributed.data_parallel``); the optimizer steps fp32 master copies, then writes
them back -- apex-free mixed precision.  In fp32 the optimizer steps the parameters
themselves.  ``--fp16`` adds a loss scaler (``grad_scaler.py``), which the strategy applies
before the step.

The optimizer does no communication: where gradients live, how they are reduced, the global
norm and the parameter sync after the step belong to the data-parallel strategy, which hands
the norm to ``step``.  Two layouts share ``MasterWeightOptimizer``: one master per parameter
(``MixedPrecisionOptimizer``, plain DDP) and flat shards of a buffer
(``megalite.distributed.distributed_optimizer.DistributedOptimizer``).  Each layout also
says how its state lies at global shapes for checkpoints (``sharded_state``, and the reader
``sharded_load_targets`` / ``load_sharded_state``; ``optimizer_state.OptimizerState`` is the
Stateful part over them).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from megalite.torch_classes import is_dtensor

from megalite.state_format.dcp_format import ChunkedTensor
from megalite.state_format.sharded_state import fsdp_piece, param_writer, spec_chunks
from megalite.optimizer.lr_schedule import StepSettings
from megalite.optimizer.muon import MuonAdamW, is_muon_param, qkv_split_rows
from megalite.optimizer.muon_layout import MatrixSlot, WholeMatrices
from megalite.param_spec import group_coords

# the per-element state tensors torch's AdamW / SGD keep (checkpoint keys
# ``optimizer.<state>.<param>``; ``master`` is the fp32 copy of a half-precision param)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq")


def has_fp32_masters(optim_config) -> bool:
    """bf16 or fp16 parameters: fp32 main grads and fp32 master weights."""
    return bool(optim_config.bf16 or optim_config.fp16)


def model_dtype(optim_config) -> torch.dtype:
    """The parameters' (and activations') dtype: bf16, fp16 or fp32."""
    if optim_config.bf16:
        return torch.bfloat16
    return torch.float16 if optim_config.fp16 else torch.float32


def uses_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """No weight decay on norms and biases (all 1-D parameters), as Megatron does."""
    return param.ndim > 1 and not name.endswith(".bias")


def clip_coefficient(norm: float, clip_grad: float) -> float:
    """Scale for gradients so their global norm is at most ``clip_grad`` (0 disables)."""
    if clip_grad and clip_grad > 0 and norm > clip_grad:
        return clip_grad / (norm + 1e-6)
    return 1.0


def uses_decoupled_lr(name: str) -> bool:
    """Megatron's ``is_embedding_or_output_parameter``: the word embedding and the output
    layer follow ``--decoupled-lr`` when it is given."""
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def param_groups(decay: list, no_decay: list, o, decoupled_decay=(),
                 decoupled_no_decay=(), muon=()) -> list:
    """The AdamW groups; ``wd_mult`` lets the scheduler set each group's weight decay as
    Megatron does (``wd * wd_mult``).  Under ``--decoupled-lr`` the embedding and output
    parameters form their own groups (``decoupled_lr``); otherwise there are two groups.
    ``--optimizer muon``: the weight matrices ``muon`` form one more group (with decay)."""
    groups = [{"params": decay, "weight_decay": o.weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    if o.decoupled_lr is not None:
        groups += [{"params": list(decoupled_decay), "weight_decay": o.weight_decay,
                    "wd_mult": 1.0, "decoupled_lr": True},
                   {"params": list(decoupled_no_decay), "weight_decay": 0.0, "wd_mult": 0.0,
                    "decoupled_lr": True}]
    else:
        groups[0]["params"] = list(decay) + list(decoupled_decay)
        groups[1]["params"] = list(no_decay) + list(decoupled_no_decay)
    if muon:
        groups.append({"params": list(muon), "weight_decay": o.weight_decay, "wd_mult": 1.0,
                       "muon": True})
    return groups


def make_inner_optimizer(groups: list, o) -> torch.optim.Optimizer:
    """The torch optimizer over ``groups`` (empty groups dropped): fused AdamW, or SGD.

    Fused, not foreach: on CPU (torch 2.13, 2 cores) the baby GPT's 52 parameters step in
    4.8 ms fused against 18.5 ms foreach and 19.9 ms one tensor at a time (docs/performance.md)."""
    groups = [g for g in groups if g["params"]]
    if o.optimizer == "muon":
        return MuonAdamW(groups, o)
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr or 0.0, momentum=0.9)
    kwargs = dict(lr=o.lr or 0.0, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


class MasterWeightOptimizer:
    """What both layouts share: the torch optimizer over fp32 masters, clipping, the lr,
    and the state dict.  A subclass sets ``params``, ``masters`` and ``inner`` and says how
    gradients are scaled and handed to the masters (``_prepare_grads``) and how masters
    reach the model (``_write_back``); ``grad(p)`` is where ``p``'s gradient lives."""

    params: List[torch.nn.Parameter]
    masters: List[torch.Tensor]
    inner: torch.optim.Optimizer

    def __init__(self, optim_config):
        # ``bf16``: the params are half precision (bf16 or fp16) with separate fp32 masters
        self.bf16 = has_fp32_masters(optim_config)
        self.clip_grad = optim_config.clip_grad

    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        raise NotImplementedError

    # -- Muon: the layout's pieces of each weight matrix (optimizer/muon_layout.py) --------
    def use_whole_matrices(self, state, model_cfg, spec_of: Dict[int, object]) -> None:
        """``--optimizer muon``: orthogonalise each matrix whole (this layout's slots);
        ``spec_of``: id(param) -> its ``ParamSpec``."""
        if isinstance(self.inner, MuonAdamW):
            self.inner.orthogonalize = WholeMatrices(self.muon_slots(state, spec_of), state,
                                                     self.inner.o, qkv_split_rows(model_cfg))

    def muon_slots(self, state, spec_of) -> List[MatrixSlot]:
        """Every Muon parameter as this layout holds it, in the same order on every rank
        of the group that holds its other pieces."""
        raise NotImplementedError

    def _state_keys(self, t: torch.Tensor, keys) -> List[str]:
        """The per-element state keys the torch optimizer keeps for stepped tensor ``t``."""
        if isinstance(self.inner, MuonAdamW):
            return MuonAdamW.state_keys(self.inner.is_muon_tensor(t), keys)
        return list(keys)

    def scale_rows(self, p: torch.nn.Parameter, row_scale: torch.Tensor) -> None:
        """Multiply row i of ``p``'s TP-local tensor by ``row_scale[i]`` in every copy this
        rank keeps (QK-clip, optimizer/qk_clip.py)."""
        raise NotImplementedError

    def grads(self) -> List[torch.Tensor]:
        return [self.grad(p) for p in self.params]

    def apply_settings(self, settings: StepSettings) -> None:
        """Write the update's lr and weight decay into every parameter group: the
        ``--decoupled-lr`` groups take the decoupled lr, ``wd_mult`` scales the decay
        (groups of checkpoints from before the tag keep theirs).  The one writer."""
        for group in self.inner.param_groups:
            decoupled = group.get("decoupled_lr") and settings.decoupled_lr is not None
            group["lr"] = settings.decoupled_lr if decoupled else settings.lr
            if settings.weight_decay is not None and "wd_mult" in group:
                group["weight_decay"] = settings.weight_decay * group["wd_mult"]

    def step(self, settings: StepSettings, grad_norm: float) -> float:
        """Clip by ``grad_norm`` (the global norm before clipping, from the strategy), set
        the update's lr and decay, update the masters and the model's copy of them;
        returns ``grad_norm``."""
        coef = clip_coefficient(grad_norm, self.clip_grad)
        self.apply_settings(settings)
        self._prepare_grads(coef)
        self.inner.step()
        with torch.no_grad():
            self._write_back()
        return grad_norm

    def _prepare_grads(self, coef: float) -> None:
        raise NotImplementedError

    def _write_back(self) -> None:
        raise NotImplementedError

    def _model_views(self) -> List[torch.Tensor]:
        """The model-side tensors the masters mirror, one per master."""
        raise NotImplementedError

    # -- checkpoints (per rank, same layout only) ----------------------------------------
    def _check_layout(self, sd: dict) -> None:
        """Raise if ``sd`` was saved by another layout (the sharded optimizer checks)."""

    def state_dict(self) -> dict:
        sd = {"optimizer": self.inner.state_dict()}
        if self.bf16:
            sd["masters"] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, sd: dict):
        self._check_layout(sd)
        self.inner.load_state_dict(sd["optimizer"])
        if self.bf16 and "masters" in sd:
            with torch.no_grad():
                for m, saved, view in zip(self.masters, sd["masters"], self._model_views()):
                    m.copy_(saved)
                    view.copy_(saved)

    def reload_model_params(self):
        """Refresh the fp32 masters from the model after weights were loaded into it, so the
        next step does not write the initial weights back (finetune / --no-load-optim)."""
        if self.bf16:
            with torch.no_grad():
                for m, view in zip(self.masters, self._model_views()):
                    m.copy_(view)

    # -- sharded state (checkpoints and snapshots at any layout) --------------------------
    # ``index``: id(param) -> (canonical name, ParamSpec); keys ``<state>.<canonical name>``.
    # Each layout says how its state lies (``sharded_state``, ``_stepped_state``); loading
    # reads every held parameter's state as its whole TP-local tensor (its FSDP2 piece), so
    # one reader serves both and DCP reshards from whatever layout saved it.
    def sharded_state(self, index, state) -> Tuple[Dict[str, object], Optional[float]]:
        """({key: ChunkedTensor} of this rank's state, the step count or None if the
        optimizer has not stepped)."""
        raise NotImplementedError

    def held_params(self) -> List[torch.nn.Parameter]:
        """The parameters this rank keeps optimizer state for."""
        return self.params

    def sharded_load_targets(self, index, state, keys) -> Tuple[dict, dict]:
        """(``{<key>.<name>: ChunkedTensor}`` to fill, ``{id(param): {key: tensor}}`` the
        same storage by parameter) for ``keys`` of every held parameter."""
        coords, targets, local = group_coords(state), {}, {}
        for p in self.held_params():
            name, spec = index[id(p)]
            piece, at, _ = fsdp_piece(p, state)        # FSDP2: this rank's piece of p
            local[id(p)] = {k: torch.zeros(piece.shape, dtype=torch.float32,
                                           device=piece.device)
                            for k in self._param_keys(name, p, keys)}
            for k, t in local[id(p)].items():
                targets[f"{k}.{name}"] = ChunkedTensor(spec.full_shape,
                                                       spec_chunks(spec, t, coords, at))
        return targets, local

    def _param_keys(self, name: str, p: torch.Tensor, keys) -> List[str]:
        """The state keys parameter ``name`` has: Muon's matrices a momentum, the rest
        AdamW's moments (any optimizer: the fp32 ``master`` under half precision)."""
        if isinstance(self.inner, MuonAdamW):
            return MuonAdamW.state_keys(is_muon_param(name, p.dim()), keys)
        return list(keys)

    def load_sharded_state(self, local: dict, step: float) -> None:
        """Install ``local`` (``sharded_load_targets``' tensors, filled) and ``step``: the
        fp32 masters, and the torch optimizer's state of every tensor it steps."""
        keys = sorted({k for st in local.values() for k in st if k != "master"})
        with torch.no_grad():
            per_tensor = self._stepped_state(local, keys)
        inner = self.inner.state_dict()
        stepped = [t for g in self.inner.param_groups for t in g["params"]]
        inner["state"] = {i: {"step": torch.tensor(step, dtype=torch.float32),
                              **per_tensor[id(t)]} for i, t in enumerate(stepped)}
        self.inner.load_state_dict(inner)

    def _stepped_state(self, local: dict, keys) -> Dict[int, dict]:
        """{id(stepped tensor): {key: values}} from ``local``; writes the masters."""
        raise NotImplementedError

    @staticmethod
    def _tensor_state(st: dict, like: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """The per-element state tensors (shaped like the stepped tensor) of one entry."""
        return [(k, v.detach()) for k, v in sorted(st.items())
                if isinstance(v, torch.Tensor) and v.shape == like.shape and v.dim() > 0]

    @staticmethod
    def _one_step(steps: List[float]) -> Optional[float]:
        if len(set(steps)) > 1:
            raise ValueError(f"optimizer step counts differ between parameters: {set(steps)}")
        return steps[0] if steps else None


class MixedPrecisionOptimizer(MasterWeightOptimizer):
    """One master per parameter (the parameter itself in fp32); ``grad_of(p)`` is where
    the strategy keeps ``p``'s (reduced) gradient."""

    def __init__(self, named_params: Iterable, optim_config,
                 grad_of: Callable[[torch.nn.Parameter], torch.Tensor]):
        super().__init__(optim_config)
        o = optim_config
        self._grad_of = grad_of
        self.params: List[torch.nn.Parameter] = []
        names = []
        for name, p in named_params:
            if p.requires_grad:
                self.params.append(p)
                names.append(name)
        self.masters = [p.detach().float().clone().requires_grad_(True) if self.bf16 else p
                        for p in self.params]
        self.names = names
        muon = o.optimizer == "muon"
        triples = [(n, p, m) for n, p, m in zip(names, self.params, self.masters)
                   if not (muon and is_muon_param(n, p.dim()))]
        split = o.decoupled_lr is not None

        def pick(wd: bool, decoupled: bool) -> list:
            return [m for n, p, m in triples if uses_weight_decay(n, p) == wd
                    and (split and uses_decoupled_lr(n)) == decoupled]
        self.inner = make_inner_optimizer(param_groups(
            pick(True, False), pick(False, False), o, pick(True, True), pick(False, True),
            muon=[m for n, p, m in zip(names, self.params, self.masters)
                  if muon and is_muon_param(n, p.dim())]), o)

    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self._grad_of(p)

    def _prepare_grads(self, coef: float) -> None:
        grads = [self.grad(p) for p in self.params]
        if coef != 1.0:     # one foreach call, not one Python-level mul_ per parameter
            torch._foreach_mul_(grads, coef)
        if self.bf16:
            for m, g in zip(self.masters, grads):
                m.grad = g

    def _write_back(self) -> None:
        if self.bf16:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def _model_views(self) -> List[torch.Tensor]:
        return self.params

    def sharded_state(self, index, state):
        """Whole local tensors, cut as the parameters are (an FSDP2 parameter's state is a
        DTensor sharded as it is)."""
        coords, out, steps = group_coords(state), {}, []
        for p, master in zip(self.params, self.masters):
            name, spec = index[id(p)]
            st = self.inner.state.get(master, {})
            tensors = dict(self._tensor_state(st, master))
            if self.bf16:
                tensors["master"] = master.detach()
            if st.get("step") is not None:
                steps.append(float(st["step"]))
            _, at, fsdp_groups = fsdp_piece(p, state)
            writer = param_writer(p, spec, coords, fsdp_groups)
            for key, t in tensors.items():
                local = t.to_local() if at is not None else t.view(p.shape)
                out[f"{key}.{name}"] = ChunkedTensor(spec.full_shape,
                                                     spec_chunks(spec, local, coords, at), writer)
        return out, self._one_step(steps)

    def scale_rows(self, p, row_scale):
        """The parameter (under FSDP2: its row piece) and, with half precision, its fp32
        master."""
        i = next(i for i, q in enumerate(self.params) if q is p)
        for t in {id(p): p, id(self.masters[i]): self.masters[i]}.values():
            local = t.to_local() if is_dtensor(t) else t
            lo = 0
            if is_dtensor(t):
                (meta,) = t.__create_chunk_list__()
                lo = meta.offsets[0]
            rows = row_scale[lo:lo + local.shape[0]].to(local.dtype)
            local.data.mul_(rows.view(-1, *([1] * (local.dim() - 1))))

    def muon_slots(self, state, spec_of) -> List[MatrixSlot]:
        """Whole TP-local tensors, or under FSDP2 the rows of this rank's piece (a flat
        range: FSDP2 shards dim 0) with the group sharding them."""
        slots = []
        for name, p, master in zip(self.names, self.params, self.masters):
            if not is_muon_param(name, p.dim()):
                continue
            spec = spec_of[id(p)]
            piece, at, groups = fsdp_piece(p, state)
            lo, group = 0, None
            if at is not None:
                if any(at[1:]) or len(groups) == 0:
                    raise ValueError(f"Muon: {name} is not sharded by rows under FSDP2")
                name_of = next((g for g in groups if g in ("dp-cp", "expert-dp")), groups[0])
                lo, group = at[0] * (p.numel() // max(p.shape[0], 1)), state[name_of]
            slots.append(MatrixSlot(name, spec, tuple(p.shape), lo, piece.numel(), master,
                                    group, name.endswith("linear_qkv.weight")
                                    and self.inner.o.muon_split_qkv))
        return slots

    def _stepped_state(self, local, keys):
        out = {}
        for p, master in zip(self.params, self.masters):
            out[id(master)] = {k: _like_param(local[id(p)][k].to(master.dtype), p)
                               for k in self._state_keys(master, keys)}
            if self.bf16:
                master.copy_(local[id(p)]["master"])
        return out


def _like_param(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor placed as ``p`` is: for an FSDP2 parameter a DTensor over
    p's mesh built from this rank's piece (torch's optimizer steps DTensors whole); any
    other parameter's state is the local tensor itself."""
    if not hasattr(p, "device_mesh"):
        return local
    # start-up time: torch.distributed's DCP/DTensor/FSDP packages, ~0.5 s
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride())
