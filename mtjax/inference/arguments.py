"""The checks of `InferenceModel.generate`'s and `.logits`' arguments: each bad one is a
ConfigError (a ValueError) naming the parameter, before anything runs on the devices.

Numbers follow the command line's rules where they reach the device (`mtjax.config.load.coerce`:
floats finite and representable in fp32, so a temperature of 1e300 is refused rather than cast to
inf), plus each parameter's own domain: temperature >= 0, top_k >= 1 (any size: k >= V is no
filter), top_p in (0, 1], seed in [0, 2**31) as every seed.
"""
from __future__ import annotations

import numbers

import numpy as np

from mtjax.config.errors import ConfigError
from mtjax.config.load import coerce


def check_ids(key: str, ids, vocab: int) -> list:
    """`ids` as a list (a row of ints; a list of rows for `tokens`), every id in [0, vocab)."""
    if isinstance(ids, str):
        raise ConfigError(key, "takes token ids, not text: encode it first (model.tokenizer.encode)")
    flat = [i for row in ids for i in row] if key == "tokens" else ids
    if isinstance(flat, np.ndarray):
        flat = flat.tolist()
    if not isinstance(flat, (list, tuple)) or not flat:
        raise ConfigError(key, "must hold at least one token id")
    for i in flat:
        if not _integer(i) or not 0 <= i < vocab:
            raise ConfigError(key, f"token ids are integers in [0, {vocab}), got {i!r}")
    return list(ids)


def check_settings(seq_len: int, longest: int, max_new, temperature, top_k, top_p, seed) -> None:
    """generate's settings for a longest prompt of `longest` tokens in a model of `seq_len`."""
    if not _integer(max_new) or max_new < 0:
        raise ConfigError("max_new_tokens", f"must be an integer >= 0, got {max_new!r}")
    if longest > seq_len:
        raise ConfigError("prompt_ids", f"a prompt of {longest} tokens is longer than model.seq_len {seq_len}")
    if longest + max_new > seq_len:
        tokens = f"{longest} token{'s' * (longest != 1)}"
        raise ConfigError("max_new_tokens", f"a prompt of {tokens} and {max_new} new ones exceed "
                                            f"model.seq_len {seq_len}")
    if not _real(temperature) or not coerce("temperature", float(temperature), float) >= 0:
        raise ConfigError("temperature", f"must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not _integer(top_k) or top_k < 1):
        raise ConfigError("top_k", f"must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (not _real(top_p) or not 0 < top_p <= 1):
        raise ConfigError("top_p", f"must be in (0, 1], got {top_p!r}")
    if top_p is not None:
        coerce("top_p", float(top_p), float)           # 1e-50 would be 0 on the device
    if not _integer(seed) or not 0 <= seed < 2 ** 31:   # the domain of every seed (train.seed, --seed)
        raise ConfigError("seed", f"must be an integer in [0, 2**31), got {seed!r}")


def flag(key: str, value) -> bool:
    """A switch argument: True or False only (a string such as "false" would read as true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(key, f"must be True or False, got {value!r}")
    return bool(value)


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _real(x) -> bool:
    """A bool is a number to Python, but True is no temperature or probability."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))
