"""Which backend builds the hot layers (``--transformer-impl``), and why; the flag checks.

``auto`` picks Transformer Engine when a CUDA device will run the model and
``transformer_engine.pytorch`` imports, and the local PyTorch layers otherwise.  On CPU
``auto`` is ``local`` without even trying the import, so CPU runs are unchanged.
The checks here return one line (validation turns it into a ``ConfigError`` before any
process group exists); nothing imports transformer_engine at megalite import time.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Optional, Tuple

import torch

TE_INSTALL = "pip install --no-build-isolation transformer_engine[pytorch]"
TE_MODULE = "transformer_engine.pytorch"


def te_import_error() -> Optional[str]:
    """None when ``transformer_engine.pytorch`` imports, else why not (one line).

    A broken install fails with OSError/RuntimeError (missing CUDA libraries), not only
    ImportError; any failure means "not usable here"."""
    try:
        importlib.import_module(TE_MODULE)
    except Exception as exc:  # noqa: BLE001 -- the reason is reported, never swallowed
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else 'import failed'}"
    return None


def cuda_will_run(device_flag: str) -> bool:
    """Whether ``--device`` (auto | cpu | cuda) puts this run on a CUDA device."""
    return device_flag != "cpu" and torch.cuda.is_available()


def resolve_transformer_impl(requested: str, device_flag: str = "auto") -> Tuple[str, str]:
    """(``local`` | ``transformer_engine``, the reason in a few words)."""
    if requested in ("local", "transformer_engine"):
        return requested, f"--transformer-impl {requested}"
    if requested != "auto":
        raise ValueError(f"unknown --transformer-impl '{requested}'")
    if not cuda_will_run(device_flag):
        why = "--device cpu" if device_flag == "cpu" else "no CUDA device"
        return "local", f"auto: {why}"
    err = te_import_error()
    if err is not None:
        return "local", f"auto: transformer_engine does not import ({err}); to use it: {TE_INSTALL}"
    return "transformer_engine", "auto: CUDA device present and transformer_engine imports"


def describe_backend(requested: str, device_flag: str) -> str:
    """The one log line of a run: which implementation and why."""
    impl, why = resolve_transformer_impl(requested, device_flag)
    return f"> transformer implementation: {impl} ({why})"


def resolve_backend_config(cfg, device_flag: Optional[str] = None):
    """``cfg`` with ``--transformer-impl auto`` replaced by what it resolves to (a copy), so
    every model chunk of the run is built by the same backend."""
    flag = device_flag or cfg.training.device
    impl, _ = resolve_transformer_impl(cfg.model.transformer_impl, flag)
    if impl == cfg.model.transformer_impl:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, transformer_impl=impl))


def fp8_support_error() -> Optional[str]:
    """None when TE says this GPU runs FP8 (delayed scaling), else its reason."""
    te = importlib.import_module(TE_MODULE)
    check = getattr(te, "is_fp8_available", None)
    if check is None:
        return None      # an old TE without the query: TE itself raises at the first GEMM
    try:
        res = check(return_reason=True)
    except TypeError:
        res = check()
    ok, why = res if isinstance(res, tuple) else (bool(res), "")
    return None if ok else (why or "this GPU has no FP8 support")


def fp8_environment(cfg) -> str:
    """What this run offers FP8, in words (the rule engine's FP8 refusal quotes it)."""
    te = "installed" if te_import_error() is None else "missing"
    dev = "cuda" if cuda_will_run(cfg.training.device) else "cpu"
    return f"device={dev}, transformer_engine {te}, --transformer-impl {cfg.model.transformer_impl}"


def backend_refusal(cfg) -> Optional[str]:
    """One line when this machine cannot run the backend or FP8 flags as given, else None:
    TE that does not import or has no GPU, FP8 on a GPU without it -- facts about the
    environment only.  Which features combine (FP8 needs TE, TE with FSDP2 or a schedule that
    splits backward, FP8 with recompute, Megatron FP8 flags not wired) is the rule engine's
    (``megalite/cli/features.py``), read after ``auto`` is resolved.  Called by validation
    (not for --dry-run, which only describes a layout)."""
    m, t = cfg.model, cfg.training
    if m.transformer_impl == "transformer_engine":
        err = te_import_error()
        if err is not None:
            return (f"--transformer-impl transformer_engine: transformer_engine does not "
                    f"import ({err}); install it with `{TE_INSTALL}` or use "
                    "--transformer-impl local")
        if not cuda_will_run(t.device):
            where = "--device cpu" if t.device == "cpu" else "no CUDA device is visible"
            return (f"--transformer-impl transformer_engine needs a CUDA GPU ({where}); use "
                    "--transformer-impl local (or auto)")
    impl, _ = resolve_transformer_impl(m.transformer_impl, t.device)
    if m.fp8_format is None or impl != "transformer_engine":
        return None      # FP8 without TE: the rule engine's "fp8 needs te"
    why = fp8_support_error()
    if why:
        return f"--fp8-format {m.fp8_format}: this GPU cannot run FP8 ({why}); drop --fp8-*"
    return None
