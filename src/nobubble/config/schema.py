"""The whole configuration: one flat dataclass made of its sections.

Each section (:mod:`nobubble.config.model`, ``data``, ``optimizer``, ``correction``,
``parallel``, ``training``, ``checkpoint``, ``logging``) declares its own keys; :class:`TrainConfig`
inherits them all, so a key is read as ``cfg.lr`` wherever it is used, ``config.json`` stays one
flat object (every run folder of earlier versions loads), and a TOML file may group keys under
``[section]`` headings or not.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from nobubble.config.checkpoint import CheckpointSettings
from nobubble.config.correction import CorrectionSettings
from nobubble.config.data import DataSettings
from nobubble.config.logging import LoggingSettings
from nobubble.config.model import ModelSettings
from nobubble.config.optimizer import OptimizerSettings
from nobubble.config.parallel import ParallelSettings
from nobubble.config.training import TrainingSettings

# section name -> its settings, in the order of the command line's help
SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "data": DataSettings,
    "optimizer": OptimizerSettings,
    "correction": CorrectionSettings,
    "parallel": ParallelSettings,
    "training": TrainingSettings,
    "checkpoint": CheckpointSettings,
    "logging": LoggingSettings,
}


@dataclass
class TrainConfig(
    LoggingSettings,
    CheckpointSettings,
    TrainingSettings,
    ParallelSettings,
    CorrectionSettings,
    OptimizerSettings,
    DataSettings,
    ModelSettings,
):
    """Every setting of a training run. A dataclass takes the fields of its bases last base
    first, so they come in the order of :data:`SECTIONS`, the model's first."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
HINTS: dict[str, Any] = typing.get_type_hints(TrainConfig)
SECTION_OF: dict[str, str] = {
    f.name: name for name, section in SECTIONS.items() for f in dataclasses.fields(section)
}
