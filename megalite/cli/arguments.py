"""Megatron-LM compatible command line, generated from the dataclasses in ``config``.

Everything here is pure Python: validation runs before any process group exists, so
a bad layout is a one-line error instead of a hang on 64 GPUs.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING
from typing import Optional, Sequence

from megalite.cli import compat_flags
from megalite.config import (SECTIONS, ConfigError, MegaliteConfig,  # noqa: F401 (re-export)
                             all_fields, field_flag)
from megalite.config.megatron_fsdp import apply_megatron_fsdp
from megalite.cli.presets import preset_fields
from megalite.cli.recipes import RECIPE_SECTION, flag_value, load_yaml, read_recipe_info
from megalite.checkpointing.checkpoint_args import apply_checkpoint_args
from megalite.cli.elastic_fit import fit_world
from megalite.cli.validation import check_flags, validate, with_default_global_batch
from megalite.config.domains import check_domains


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are a ``ConfigError`` (one line, exit status 2 through
    ``run_cli``) instead of a usage dump and a bare ``SystemExit``."""

    def __init__(self, *args, help_hint: str = "--help", **kwargs):
        super().__init__(*args, **kwargs)
        self.help_hint = help_hint

    def error(self, message):
        raise ConfigError(f"{message} (see {self.help_hint})")


_SECTION_TITLES = {
    "model": "model shape and architecture",
    "parallel": "parallelism (DP is derived: world / (TP*PP*CP))",
    "optimizer": "optimizer, precision and learning-rate schedule",
    "data": "data and tokenizer",
    "training": "batch sizes, iterations, evaluation and recomputation",
    "logging": "logging and metrics",
    "checkpoint": "checkpoints",
}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(text) -> bool:
    """A boolean from YAML or a ``--flag VALUE``: strictly, so a typo is an error, not False."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog, allow_abbrev=False,
        description="megalite: Megatron-style pretraining. Flags follow Megatron-LM.")
    general = parser.add_argument_group("general")
    general.add_argument("--config", metavar="FILE", default=None,
                         help="YAML file of settings; flags given on the command line override it.")
    general.add_argument("--world-size", type=int, default=None,
                         help="World size for --dry-run / planning (default: from torchrun or SLURM; "
                         "for --dry-run of a recipe, its published GPU count).")
    general.add_argument("--model-preset", metavar="NAME", default=None,
                         help="Start from the shapes of a model preset (megalite plan "
                         "--list-recipes); model flags given in --config or here override them.")
    general.add_argument("--gpu", default=None, metavar="PRESET",
                         help="GPU the --dry-run estimate is for (default: the recipe's, else "
                         "h100-80gb).")
    general.add_argument("--gpus-per-node", type=int, default=None,
                         help="GPUs per node for --dry-run (default: the recipe's, else 8).")
    groups = {name: parser.add_argument_group(title) for name, title in _SECTION_TITLES.items()}
    for section, f in all_fields():
        add_field_argument(groups[section], f)
    compat_flags.register(parser)
    return parser


def add_field_argument(group, f, aliases: Sequence[str] = ()) -> None:
    """Field ``f``'s flag(s) as pretrain_gpt.py defines them (name, help, type, choices),
    for any parser that takes a training flag (``megalite plan`` takes some); ``aliases``:
    that parser's own extra names."""
    meta = f.metadata
    flags = [field_flag(f), *meta.get("aliases", ()), *aliases]
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    kwargs = {"dest": f.name, "help": meta.get("help") or None, "default": default}
    action = meta.get("action")
    if action:
        kwargs["action"] = action
    else:
        kwargs["type"] = meta.get("type") or _field_type(f)
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if meta.get("nargs"):
            kwargs["nargs"] = meta["nargs"]
    group.add_argument(*flags, **kwargs)
    if meta.get("negation"):     # Megatron's --no-X switch of a boolean field
        group.add_argument(meta["negation"], dest=f.name, action="store_false",
                           help=f"Turn {flags[0]} off.")
    if meta.get("shorthand"):    # Megatron's switch for one value (--recompute-activations)
        switch, value = meta["shorthand"]
        group.add_argument(switch, dest=f.name, action="store_const", const=value,
                           help=f"{flags[0]} {value}.")


def _field_type(f):
    t = str(f.type)
    if "list" in t:
        return str
    for name, conv in (("float", float), ("int", int), ("bool", _parse_bool)):
        if name in t:
            return conv
    return str


def _yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict:
    """Map a YAML file (flat or sectioned; dashes or underscores) onto parser dests."""
    raw = load_yaml(path)
    raw.pop(RECIPE_SECTION, None)       # what the file reproduces, not flags (megalite/cli/recipes.py)
    flat = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    by_dest = {a.dest: a for a in parser._actions}
    by_flag = {s.lstrip("-").replace("-", "_"): a for a in parser._actions for s in a.option_strings}
    out = {}
    for key, value in flat.items():
        k = str(key).replace("-", "_")
        if k in by_flag and isinstance(by_flag[k], (argparse._StoreTrueAction,
                                                    argparse._StoreFalseAction)):
            a = by_flag[k]
            try:
                on = _parse_bool(value)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"--config {path}: {a.option_strings[0]}: {exc}") from None
            out[a.dest] = a.const if on else a.default
        elif k in by_dest and k not in ("help", "config", "model_preset", "gpu", "gpus_per_node",
                                               "world_size"):
            out[k] = value
        else:
            raise ConfigError(f"--config: unknown setting '{key}' in {path}; "
                              "use the flag names of --help")
    return out


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set:
    """The dests the command line itself sets (parsed again with every default suppressed),
    so a default can be told from a value the user typed."""
    kept, defaults = [(a, a.default) for a in parser._actions], parser._defaults
    parser._defaults = {}
    for a, _ in kept:
        a.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_known_args(list(argv))[0]))
    finally:
        parser._defaults = defaults
        for a, default in kept:
            a.default = default


def env_world_size(default: int = 1) -> int:
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return default


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "pretrain_gpt.py",
               defaults: Optional[dict] = None, validate_config: bool = True) -> MegaliteConfig:
    """Parse flags (and an optional YAML file) into a validated ``MegaliteConfig``.

    ``defaults`` lets an entry point (pretrain_moe.py) change defaults without new flags.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    if defaults:
        parser.set_defaults(**defaults)
    config_path = flag_value(argv, "--config")
    recipe = read_recipe_info(config_path)
    preset = flag_value(argv, "--model-preset") or recipe.model
    if preset:             # preset shapes < the --config file < the command line
        parser.set_defaults(**preset_fields(preset))
    from_file = _yaml_defaults(config_path, parser) if config_path else {}
    parser.set_defaults(**from_file)
    ns = vars(parser.parse_args(argv))
    published_world = recipe.num_gpus if ns["dry_run"] else None
    world = ns.pop("world_size") or env_world_size(published_world or 1)
    for key in ("config", "model_preset", "gpu", "gpus_per_node"):
        ns.pop(key, None)
    accepted = compat_flags.pop_given(ns)
    sections = {}
    for section, f in all_fields():
        sections.setdefault(section, {})[f.name] = ns[f.name]
    data = sections["data"]
    if data["tokenizer_type"] is None and data["vocab_file"] and data["merge_file"]:
        data["tokenizer_type"] = "GPT2BPETokenizer"   # Megatron's GPT-2 examples omit the type
    cfg = MegaliteConfig(world_size=world, launched_world_size=world, accepted_flags=accepted,
                         **{s: SECTIONS[s](**kw) for s, kw in sections.items()})
    cfg = apply_megatron_fsdp(cfg)     # --use-megatron-fsdp: its ZeRO stage's strategy fields
    # a bad --load or value fails here, before any file is read (and, validating, a flag
    # set without the one it needs)
    if validate_config:
        check_flags(cfg)
    else:
        check_domains(cfg)
    if cfg.checkpoint.use_checkpoint_args:     # before validation, which needs the model flags

        cfg, notes = apply_checkpoint_args(cfg, set(from_file) | given_dests(parser, argv))
        if int(os.environ.get("RANK", "0")) == 0:
            print("\n".join(notes), flush=True)
    if validate_config and cfg.parallel.elastic and not cfg.training.dry_run:
        cfg, line = fit_world(cfg)         # the re-layout rule; validates at the fitted world
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)
    elif validate_config:
        validate(cfg)
    if validate_config:    # the one normalisation of a built config (validation is pure)
        cfg = with_default_global_batch(cfg)
    return cfg
