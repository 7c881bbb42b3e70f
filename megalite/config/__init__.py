"""Configuration dataclasses: the single source of truth for every setting.

Each field carries its Megatron-LM flag name, help text and valid domain in ``metadata``
(``opt`` in fields.py), so ``megalite.cli.arguments`` generates the command line from these classes
and ``megalite.config.domains`` checks every value against its declaration, instead of keeping
second lists in sync by hand.  Fields whose names already match Megatron's flag
(underscores -> dashes) need no explicit ``flag``.  One module per section.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megalite.config.fields import field_domain, field_flag, has_domain, is_bool_flag, opt
from megalite.config.model import ModelConfig
from megalite.config.moe_layer_freq import MoeLayerFreqError, parse_moe_layer_freq
from megalite.config.optimizer import OptimizerConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.parallel_dims import ParallelDims
from megalite.config.run import (RECOMPUTE_MODULES, CheckpointConfig, DataConfig,
                                 LoggingConfig, TrainingConfig)
from megalite.errors import ConfigError

__all__ = ["ConfigError", "opt", "field_flag", "field_domain", "has_domain", "is_bool_flag",
           "ModelConfig", "MoeLayerFreqError", "parse_moe_layer_freq", "ParallelConfig",
           "ParallelDims", "OptimizerConfig", "DataConfig", "TrainingConfig", "LoggingConfig",
           "CheckpointConfig", "RECOMPUTE_MODULES", "SECTIONS", "MegaliteConfig",
           "all_fields", "find_field"]

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class MegaliteConfig:
    """Everything a run needs; one attribute per section."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    world_size: int = 1
    # ranks the launcher started: more than world_size when some wait as spares (--elastic)
    launched_world_size: Optional[int] = None
    # Megatron flags given that have no setting here: [(flag, value, note)] (compat_flags)
    accepted_flags: list = field(default_factory=list)

    @property
    def parallel_dims(self) -> ParallelDims:
        """The run's layout (config/parallel_dims.py): every size derived from it."""
        return ParallelDims.from_config(self)

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp

    @property
    def num_micro_batches(self) -> int:
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.data_parallel_size)

    @property
    def padded_vocab_size(self) -> int:
        return self.model.padded_vocab_size(self.parallel.tp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MegaliteConfig":
        kwargs = {name: klass(**d.get(name, {})) for name, klass in SECTIONS.items()}
        return cls(world_size=d.get("world_size", 1), **kwargs)


def all_fields():
    """(section, field) for every configurable field, in CLI order."""
    for section, klass in SECTIONS.items():
        for f in dataclasses.fields(klass):
            yield section, f


def find_field(name: str, section: str = ""):
    """(section, field) for ``"name"`` (looked up in ``section`` first) or ``"section.name"``."""
    if "." in name:
        section, name = name.split(".", 1)
        return section, {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
    if section:
        own = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        if name in own:
            return section, own[name]
    for sec, f in all_fields():
        if f.name == name:
            return sec, f
    raise KeyError(name)
