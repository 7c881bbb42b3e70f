"""The MLP activations: one registry entry each, read by every place that depends on it.

The dense MLP and the grouped experts apply ``activation_of(model_cfg)``; the parameter
counts, FLOPs, memory models, precision probe and checkpoint checks read the same entry
(how wide fc1 is, how many matmuls a token does, what backward keeps), so adding an MLP
variant is one entry here, its Megatron-LM switch (if Megatron has one) in
``config/model.py`` and its line in the docs (docs/extending.md).  ``--activation NAME``
takes every entry; the Megatron switches (``--swiglu``, ...) are other spellings of the
same one choice, and two different choices at once are refused (``choice_problem``).
Importing this module does not import torch (the planner reads it).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple


def _silu_glu(y):
    import torch.nn.functional as F  # start-up time: torch only when a model runs (docstring)

    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _quick_geglu(y, offset: float = 0.0, clamp: Optional[float] = None):
    """gpt-oss's gate: g * sigmoid(1.702 g) * (up + offset), g <= clamp and up in
    [-clamp, clamp] first (Megatron's quick_geglu with --glu-linear-offset and
    --activation-func-clamp-value; the HF model computes the same products in this order)."""
    import torch  # start-up time: torch only when a model runs (docstring)

    gate, up = y.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    glu = gate * torch.sigmoid(gate * 1.702)
    return glu * (up + offset) if offset else glu * up


def _gelu(y):
    import torch.nn.functional as F  # start-up time: torch only when a model runs (docstring)

    return F.gelu(y)


def _squared_relu(y):
    import torch.nn.functional as F  # start-up time: torch only when a model runs (docstring)

    return F.relu(y).square()


def _gelu_tanh_glu(y):
    import torch.nn.functional as F  # start-up time: torch only when a model runs (docstring)

    gate, up = y.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _llama_ffn(hidden: int) -> int:
    """Llama's rule: 2/3 of 4h, rounded up to a multiple of 64."""
    return int(math.ceil(int(8 * hidden / 3) / 64) * 64)


@dataclass(frozen=True)
class Activation:
    name: str
    flag: Optional[str]        # its Megatron-LM switch, a ModelConfig field (None: none)
    summary: str
    gated: bool                # fc1 computes [gate; up] (two blocks per TP rank)
    fn: Callable               # fc1 output -> fc2 input (torch tensors)
    # what backward keeps per token, in multiples of the MLP width f (the activation
    # memory models' terms; measured in tests/unit/test_pipeline_activation_memory.py)
    saved: Tuple[Tuple[str, int], ...]
    hf_names: Tuple[str, ...]  # Hugging Face ``hidden_act`` values that mean it
    default_ffn: Callable[[int], int] = lambda hidden: 4 * hidden   # no --ffn-hidden-size
    # ModelConfig fields ``fn`` takes as keywords (its knobs), {field: keyword}
    knobs: Tuple[Tuple[str, str], ...] = ()

    @property
    def fc1_blocks(self) -> int:
        """How many f-wide blocks fc1 produces: 2 ([gate; up]) when gated."""
        return 2 if self.gated else 1

    @property
    def matmuls(self) -> int:
        """h x f matmuls per token: fc1's blocks and fc2."""
        return self.fc1_blocks + 1

    @property
    def saved_elements(self) -> int:
        return sum(n for _, n in self.saved)


ACTIVATIONS: Dict[str, Activation] = {a.name: a for a in (
    Activation("swiglu", "swiglu", "SwiGLU: silu(gate) * up (Llama)", gated=True,
               fn=_silu_glu, hf_names=("silu", "swish", "swiglu"), default_ffn=_llama_ffn,
               saved=(("fc1 output [gate; up] (silu and mul save views)", 2),
                      ("silu(gate)", 1), ("fc2 input silu(gate)*up", 1))),
    Activation("gelu", None, "GeLU (GPT-2)", gated=False, fn=_gelu,
               hf_names=("gelu",),   # erf; HF's gelu_new is the tanh form, not this
               saved=(("GeLU input (fc1 output)", 1), ("fc2 input (GeLU output)", 1))),
    Activation("squared-relu", "squared_relu", "squared ReLU: relu(x)^2, not gated "
               "(Primer; Nemotron's MLP)", gated=False, fn=_squared_relu, hf_names=("relu2",),
               saved=(("relu output (square saves the same tensor)", 1),
                      ("fc2 input relu(x)^2", 1))),
    # Gemma 2/3: GeGLU with the tanh-approximated GeLU (HF's gelu_pytorch_tanh, gated)
    Activation("geglu", None, "GeGLU: gelu_tanh(gate) * up (Gemma)", gated=True,
               fn=_gelu_tanh_glu, hf_names=("gelu_pytorch_tanh",), default_ffn=_llama_ffn,
               saved=(("fc1 output [gate; up] (gelu and mul save views)", 2),
                      ("gelu(gate)", 1), ("fc2 input gelu(gate)*up", 1))),
    # gpt-oss (its knobs: --glu-linear-offset, --activation-func-clamp-value)
    Activation("quick-geglu", "quick_geglu", "quick-GeGLU: g*sigmoid(1.702g) * (up + offset), "
               "clamped (gpt-oss)", gated=True, fn=_quick_geglu, hf_names=("quick_gelu",),
               knobs=(("glu_linear_offset", "offset"), ("activation_func_clamp_value", "clamp")),
               saved=(("fc1 output [gate; up] (clamp and mul save views)", 2),
                      ("sigmoid(1.702 g)", 1), ("g*sigmoid(1.702 g)", 1),
                      ("fc2 input", 1))),
)}
DEFAULT = ACTIVATIONS["gelu"]                  # no --activation and no switch (Megatron's)
SWITCHES = tuple(a.flag for a in ACTIVATIONS.values() if a.flag)   # ModelConfig fields


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def choices_given(model_cfg) -> List[Tuple[str, Activation]]:
    """``[(flag text, entry)]`` for ``--activation`` and every Megatron switch that is on."""
    given = []
    name = getattr(model_cfg, "activation", None)
    if name is not None and name in ACTIVATIONS:
        given.append((f"--activation {name}", ACTIVATIONS[name]))
    given += [(_flag(a.flag), a) for a in ACTIVATIONS.values()
              if a.flag and getattr(model_cfg, a.flag, False)]
    return given


def activation_of(model_cfg) -> Activation:
    """The activation ``model_cfg`` selects: ``--activation``, else its switch, else GeLU,
    its ``fn`` given the entry's knobs from ``model_cfg``.
    (Two different choices are refused by ``choice_problem`` before a model exists.)"""
    given = choices_given(model_cfg)
    entry = given[0][1] if given else DEFAULT
    if not entry.knobs:
        return entry
    kw = {key: getattr(model_cfg, field) for field, key in entry.knobs
          if getattr(model_cfg, field, None) not in (None, 0.0)}    # unset: the fn's default
    return replace(entry, fn=functools.partial(entry.fn, **kw)) if kw else entry


def glu_knob_problem(value, cfg) -> Optional[str]:
    """only with an activation that has the knob (quick-geglu)"""
    if value in (None, 0.0):
        return None
    entry = activation_of(cfg.model)
    fields = [f for f, _ in entry.knobs]
    for field in ("glu_linear_offset", "activation_func_clamp_value"):
        if getattr(cfg.model, field) not in (None, 0.0) and field not in fields:
            return (f"{_flag(field)} shapes a gated activation's gate; the MLP's is "
                    f"{entry.name}: add --quick-geglu (or --activation quick-geglu)")
    return None


glu_knob_problem.invalid = []


def choice_problem(value, cfg) -> Optional[str]:
    """one MLP activation: --activation or a Megatron switch naming it, never two different ones"""
    given = choices_given(cfg.model)
    if len({a.name for _, a in given}) > 1:
        names = " and ".join(flag for flag, _ in given)
        return f"{names}: the MLP has one activation; give one of them " \
               f"(--activation {'|'.join(ACTIVATIONS)})"
    return None


def activation_for_hf(hidden_act: str) -> Optional[Activation]:
    """The entry a Hugging Face ``hidden_act`` names (None: not one of ours)."""
    return next((a for a in ACTIVATIONS.values() if hidden_act in a.hf_names), None)


def switches(activation: Activation) -> dict:
    """The ModelConfig switches that select ``activation`` ({field: bool})."""
    return {f: f == activation.flag for f in SWITCHES}
