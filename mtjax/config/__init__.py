"""Configuration: frozen dataclasses, YAML with a base file, dotted overrides, one validation pass."""
from mtjax.config.errors import ConfigError
from mtjax.config.load import from_dict, load_config
from mtjax.config.schema import (CheckpointConfig, Config, DataConfig, ModelConfig, OptimConfig,
                                 ParallelConfig, TrainConfig)
from mtjax.config.validate import validate

__all__ = ["Config", "ConfigError", "ModelConfig", "ParallelConfig", "OptimConfig", "DataConfig",
           "TrainConfig", "CheckpointConfig", "load_config", "from_dict", "validate"]
