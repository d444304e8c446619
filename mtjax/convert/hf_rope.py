"""config.json's rotary position settings <-> the model's rope fields (`hf_config.py` calls both ways).

from-hf reads transformers 5's `rope_parameters` or transformers 4's `rope_theta` + `rope_scaling`
(`type` or `rope_type`); a scaling other than linear, llama3 (Llama 3.1's frequency bands) or yarn, a
partial rotation, an attention factor outside yarn, yarn's mscale / mscale_all_dim form or its
truncate false, parameters per layer type (transformers 5's nested form) or a top-level
original_max_position_embeddings unlike the rope mapping's own (transformers 5 reads the top-level
one, 4 the other) is refused with a ConfigError naming the key. llama3 and yarn without their
original_max_position_embeddings take transformers 5's fallback: the top-level key, else
max_position_embeddings; yarn without a factor takes max_position_embeddings / that (transformers
5 too; transformers 4 took that ratio even over a given factor, which we do not follow). A yarn
beta_fast / beta_slow absent, null or 0 is transformers' 32 / 1. to-hf writes both spellings. `get` is `hf_config`'s typed reader of a config.json value.
"""
from __future__ import annotations

from mtjax.config.errors import ConfigError
from mtjax.config.schema import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# config.json's key for each rope field (`{rope}`: rope_parameters, or transformers 4's rope_scaling)
ROPE_KEYS = {"rope_theta": "rope_theta", "rope_scaling_factor": "{rope}.factor",
             "rope_low_freq_factor": "{rope}.low_freq_factor", "rope_high_freq_factor": "{rope}.high_freq_factor",
             "rope_original_positions": "{rope}.original_max_position_embeddings",
             "rope_beta_fast": "{rope}.beta_fast", "rope_beta_slow": "{rope}.beta_slow",
             "rope_attention_factor": "{rope}.attention_factor"}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}      # (transformers' `or 32`, `or 1`)


def rope_fields(hf: dict, get, default_theta: float = 10000.0, positions: int = 2048) -> dict:
    """The model's rope_theta and scaling fields, from transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling` (`default_theta`: the family's rope_theta where config.json states
    none; `positions`: its max_position_embeddings, llama3's fallback context). Given both (as
    to-hf writes them), 4's keys must say what 5's say: a config whose two spellings disagree is
    refused rather than read one way."""
    fields = _one_spelling(hf, get, default_theta, positions)
    if hf.get("rope_parameters") is None:
        return fields
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    if legacy.get("rope_theta") is not None:
        theta = get(legacy, "rope_theta", float)
        if theta != fields["rope_theta"]:
            raise ConfigError("rope_theta", f"{theta} disagrees with rope_parameters.rope_theta {fields['rope_theta']}")
    if legacy.get("rope_scaling") is not None:
        old = _one_spelling({**legacy, "rope_theta": fields["rope_theta"]}, get, default_theta, positions)
        if old != fields:
            raise ConfigError("rope_scaling", f"{legacy['rope_scaling']!r} disagrees with rope_parameters "
                                              f"{hf['rope_parameters']!r}")
    return fields


def _one_spelling(hf: dict, get, default_theta: float, positions: int) -> dict:
    """`rope_fields` from one spelling: 5's `rope_parameters` when present, else 4's."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(key, f"must be a mapping, got {params!r}")
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:      # transformers 5's parameters per layer type ({"full_attention": {...}})
        raise ConfigError(f"{key}.{nested[0]}", "rotary parameters per layer type are not supported: give "
                                                "one rope_type and its parameters")
    sub = {k: v for k, v in params.items() if v is not None}
    theta = get({**hf, **sub}, "rope_theta", float, default_theta,
                where=f"{key}.rope_theta" if "rope_theta" in sub else "rope_theta")
    kind = sub.get("rope_type", sub.get("type", "default"))    # (transformers 4 reads rope_type first)
    where = f"{key}.{'rope_type' if 'rope_type' in sub else 'type'}"     # the key config.json spells
    if kind not in ROPE_TYPES:
        raise ConfigError(where, f"{kind!r} is not supported (mtjax has {', '.join(ROPE_TYPES)})")
    for name in ("partial_rotary_factor", "attention_factor"):
        value = sub.get(name, hf.get(name))
        if kind == "yarn" and name in sub:      # (yarn's own, read by `_yarn_fields`)
            continue
        if value is not None and value != 1.0:
            raise ConfigError(f"{key}.{name}" if name in sub else name,
                              f"{value!r} is not supported: mtjax rotates every head dimension, unscaled")
    fields = {"rope_theta": theta}
    if kind == "default":
        return fields
    if kind == "yarn":
        return fields | _yarn_fields(hf, sub, key, get, positions)
    fields |= {"rope_scaling": kind, "rope_scaling_factor": get(sub, "factor", float, where=f"{key}.factor")}
    if kind == "llama3":
        fields |= {name: get(sub, hf_name, float, where=f"{key}.{hf_name}") for name, hf_name in (
            ("rope_low_freq_factor", "low_freq_factor"), ("rope_high_freq_factor", "high_freq_factor"))}
        fields["rope_original_positions"] = _original_positions(hf, sub, key, get, positions)
    return fields


def _yarn_fields(hf: dict, sub: dict, key: str, get, positions: int) -> dict:
    """yarn's fields from its rope mapping `sub` (found under `key`): factor (absent: max_position_embeddings
    / the original context, as transformers 5), original context, betas, attention factor (absent: 0,
    derived from the factor)."""
    for name in ("mscale", "mscale_all_dim"):
        if sub.get(name) is not None:
            raise ConfigError(f"{key}.{name}", f"{sub[name]!r} is not supported: mtjax's yarn attention factor is "
                                               "attention_factor, else 0.1 ln(factor) + 1")
    if sub.get("truncate", True) is not True:
        raise ConfigError(f"{key}.truncate", f"{sub['truncate']!r} is not supported: mtjax's yarn rounds the "
                                             "correction range outwards (truncate true)")
    original = _original_positions(hf, sub, key, get, positions)
    factor = get(sub, "factor", float, positions / original, where=f"{key}.factor")
    fields = {"rope_scaling": "yarn", "rope_scaling_factor": factor, "rope_original_positions": original}
    for name, default in YARN_DEFAULTS.items():
        fields[f"rope_{name}"] = get(sub, name, float, default, where=f"{key}.{name}") or default
    attention = get(sub, "attention_factor", float, 0.0, where=f"{key}.attention_factor")
    if "attention_factor" in sub and sub["attention_factor"] is not None and attention <= 0:
        raise ConfigError(f"{key}.attention_factor", f"must be positive, got {attention}")
    return fields | {"rope_attention_factor": attention}


def _original_positions(hf: dict, sub: dict, key: str, get, positions: int) -> int:
    """llama3's and yarn's original context. transformers 5 (`standardize_rope_params`) takes a top-level
    original_max_position_embeddings first, else the rope mapping's own, else max_position_embeddings
    (`positions`); transformers 4 requires the rope mapping's. Given both, they must agree."""
    name = "original_max_position_embeddings"
    top = get(hf, name, int, None, size=True)
    if name not in sub:
        return positions if top is None else top
    own = get(sub, name, int, where=f"{key}.{name}")
    if top is not None and top != own:
        raise ConfigError(name, f"{top!r} disagrees with {key}.{name} {own}")
    return own


def rope_keys(m: ModelConfig) -> dict:
    """config.json's rotary keys for `m`: transformers 5's `rope_parameters` and 4's
    `rope_theta` + `rope_scaling` beside it, saying the same."""
    kind = m.rope_scaling
    scaling = None if kind == "none" else {"rope_type": kind, "factor": m.rope_scaling_factor}
    if kind == "llama3":
        scaling |= {"low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                    "original_max_position_embeddings": m.rope_original_positions}
    if kind == "yarn":
        scaling |= {"original_max_position_embeddings": m.rope_original_positions, "beta_fast": m.rope_beta_fast,
                    "beta_slow": m.rope_beta_slow}
        if m.rope_attention_factor:       # (0: derived from the factor, as transformers derives it when absent)
            scaling["attention_factor"] = m.rope_attention_factor
    params = {"rope_type": "default" if scaling is None else kind, "rope_theta": m.rope_theta, **(scaling or {})}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": params}
