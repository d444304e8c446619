"""config.json's rotary position settings <-> the model's rope fields (`hf_config.py` calls both ways).

from-hf reads transformers 5's `rope_parameters` or transformers 4's `rope_theta` + `rope_scaling`
(`type` or `rope_type`); a scaling other than linear or llama3 (Llama 3.1's frequency bands), a
partial rotation, an attention factor, parameters per layer type (transformers 5's nested form) or
a top-level original_max_position_embeddings unlike llama3's own (transformers 5 reads the top-level
one, 4 the other) is refused with a ConfigError naming the key. llama3 without its
original_max_position_embeddings takes transformers 5's fallback: the top-level key, else
max_position_embeddings. to-hf writes both spellings. `get` is `hf_config`'s typed reader of a config.json value.
"""
from __future__ import annotations

from mtjax.config.errors import ConfigError
from mtjax.config.schema import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3")


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
        if value is not None and value != 1.0:
            raise ConfigError(f"{key}.{name}" if name in sub else name,
                              f"{value!r} is not supported: mtjax rotates every head dimension, unscaled")
    fields = {"rope_theta": theta}
    if kind == "default":
        return fields
    fields |= {"rope_scaling": kind, "rope_scaling_factor": get(sub, "factor", float, where=f"{key}.factor")}
    if kind == "llama3":
        fields |= {name: get(sub, hf_name, float, where=f"{key}.{hf_name}") for name, hf_name in (
            ("rope_low_freq_factor", "low_freq_factor"), ("rope_high_freq_factor", "high_freq_factor"))}
        fields["rope_original_positions"] = _original_positions(hf, sub, key, get, positions)
    return fields


def _original_positions(hf: dict, sub: dict, key: str, get, positions: int) -> int:
    """llama3's original context. transformers 5 (`standardize_rope_params`) takes a top-level
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
    params = {"rope_type": "default" if scaling is None else kind, "rope_theta": m.rope_theta, **(scaling or {})}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": params}
