"""What a restore checks before it reads any array: the same model, and the same data.

A checkpoint restores only into the model it was saved from (vocabulary padding, dropout
aside), and a resume continues on the data it was trained on unless `data.allow_change=true`.
"""
from __future__ import annotations

from dataclasses import asdict, fields

from mtjax.checkpoint.errors import CheckpointError
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, ModelConfig

MODEL_KEYS_FREE = ("vocab_multiple", "dropout", "attention_dropout")   # may differ on resume
DATA_KEYS = {"fingerprint": "data.path", "weights": "data.path", "tokenizer": "data.tokenizer", "seed": "data.seed",
             "valid_fraction": "data.valid_fraction"}


def _model_fields(model: dict) -> dict:
    """A saved `model` group as the model it describes: fields it lacks (saved before they existed)
    at their defaults, and the arch's defaults resolved (tie_embeddings null, activation "")."""
    known = {f.name for f in fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in model.items() if k in known})
    return {**model, **asdict(m), "tie_embeddings": m.tied, "activation": m.mlp_activation}


def check_same_model(saved: dict, cfg: Config, step: int) -> None:
    """A checkpoint restores only into the model it was saved from (vocabulary padding aside)."""
    saved, now = _model_fields(saved), _model_fields(cfg.to_dict()["model"])
    for key, value in saved.items():
        if key not in MODEL_KEYS_FREE and now.get(key) != value:
            raise CheckpointError(f"checkpoint step {step} was saved with model.{key}={value!r}, "
                                  f"the config says {now.get(key)!r}")


def check_same_data(saved: dict | None, now: dict | None, cfg: Config, step: int) -> None:
    """A resume continues on the data the checkpoint was trained on, unless data.allow_change=true:
    the corpora's content (fingerprint), the blend's weights, the tokenizer, the split seed and
    the held-out fraction. A blend and a single corpus differ in their fingerprints."""
    if not saved or not now or cfg.data.allow_change:
        return
    for item, key in DATA_KEYS.items():
        if item in saved and saved[item] != now.get(item):
            what = ("the token files differ" if item == "fingerprint" else
                    f"it was trained with the blend weights {_weights(saved[item])}, this run's are "
                    f"{_weights(now.get(item))}" if item == "weights" else
                    f"it was trained with {key}={saved[item]!r}, this run has {now.get(item)!r}")
            raise ConfigError(key, f"checkpoint step {step} was trained on other data: {what}; set "
                                   f"data.allow_change=true to go on with this data")


def _weights(shares) -> str:
    return "none (one corpus)" if shares is None else " ".join(f"{w:.4g}" for w in shares)
