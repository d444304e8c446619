"""Reading a Config from YAML files and dotted `key=value` overrides.

A YAML file is a mapping of groups (`model`, `parallel`, ...) to fields. The
top-level key `base: other.yaml` (relative to the file) names a file to start
from; the child's values override the base's, group by group. Every value is
checked against the dataclass field type; unknown keys are errors.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing

import numpy as np
import yaml

from mtjax.config.data_path import parse_data_path
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, DataPath
from mtjax.config.yaml_file import BOOL_WORDS, SURPRISING_NUMBER, first_words, read_yaml, yaml_load


def _optional(typ):
    """T for a field typed `T | None`, else None."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


# Every int field is a count, a size or a seed: beyond int32 it is a typo, and it would overflow
# inside JAX (int32 step counters, C longs) as a traceback.
INT_LIMIT = 2 ** 31
# Floats reach the device in fp32: they must be finite there, and nonzero ones must not flush to 0.
FP32_MAX, FP32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def _coerce(key: str, value, typ, nullable: bool = False):
    """`value` as field type `typ` (int, float, bool or str, or one of them `| None`, which YAML's
    null sets, or a DataPath), or ConfigError."""
    spelling = getattr(value, "spelling", None)
    if spelling is not None:            # a number as YAML read it (`_SpelledInt`): its text and plain value
        value = float(value) if isinstance(value, float) else int(value)
        if typ in (int, float) and SURPRISING_NUMBER.match(spelling):
            why = "base 60 (its colons)" if ":" in spelling else "octal (its leading 0)"
            raise ConfigError(key, f"YAML 1.1 reads {spelling} as {why}, {value}: write {value} if that is meant")
    if typ == DataPath:
        return parse_data_path(key, value if spelling is None else spelling)
    inner = _optional(typ)
    if inner is not None:
        if value is None:
            return None
        return _coerce(key, value, inner, nullable=True)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value in BOOL_WORDS:     # YAML 1.1's spellings (`yaml_file`)
            return BOOL_WORDS[value]
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -INT_LIMIT < value < INT_LIMIT:
                raise ConfigError(key, f"{value} is out of range (|value| < 2**31)")
            return value
    elif typ is float:
        if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
            value = float(value)    # YAML spells them .inf and .nan; refused below as what they are
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if not math.isfinite(value):   # no field means anything at infinity, and NaN compares false
                raise ConfigError(key, f"must be a finite number, got {value!r}")
            if value and not FP32_TINY <= abs(value) <= FP32_MAX:
                raise ConfigError(key, f"{value!r} is not representable in float32 (it would become "
                                       f"{'0' if abs(value) < 1 else 'inf'} on the device)")
            return value
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value) if spelling is None else spelling
    expected = f"{typ.__name__}{' or null' if nullable else ''}"
    raise ConfigError(key, f"expected {expected}, got {type(value).__name__} {value!r}")


def coerce(key: str, value, typ):
    """`value` as field type `typ` under the rules of config values (int32 range, finite fp32
    floats, strict types), or ConfigError naming `key`: for values that come from elsewhere
    (command-line flags, a Hugging Face config.json)."""
    return _coerce(key, value, typ)


# keys that existed once: {"group.key": why it is gone}, so an old config gets a precise error
REMOVED = {
    "train.state_layout": "was removed: the state always holds only the fp32 master weights and "
                          "moments; the step casts (and gathers) the compute weights itself",
}


def did_you_mean(key, known, prefix: str = "") -> str:
    """'; did you mean PREFIX+NAME?' for the known name nearest to `key` (difflib's ratio of
    matching characters, at least 0.6), else ''."""
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _build_group(name: str, cls, values) -> object:
    if not isinstance(values, dict):
        raise ConfigError(name, "must be a mapping of fields")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if f"{name}.{key}" in REMOVED:
            raise ConfigError(f"{name}.{key}", REMOVED[f"{name}.{key}"])
        if key not in known:
            raise ConfigError(f"{name}.{key}", "unknown key" + did_you_mean(key, known, f"{name}."))
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def from_dict(raw: dict, written=frozenset()) -> Config:
    """A Config from a {group: {field: value}} mapping, strictly typed; `written`: the
    'group.field' keys the user wrote (`Config.written`), none by default: a mapping read back
    from a config (config.json, a checkpoint's) holds every field, written or not."""
    hints = typing.get_type_hints(Config)
    known = Config.groups()
    groups = {}
    for name, values in raw.items():
        if name not in known:
            raise ConfigError(str(name), "unknown config group" + did_you_mean(name, known))
        groups[name] = _build_group(name, hints[name], values)
    return Config(**groups, written=frozenset(written))


def written_keys(raw: dict) -> frozenset[str]:
    """The 'group.field' keys of a {group: {field: value}} mapping as the user gave it."""
    return frozenset(f"{group}.{name}" for group, values in raw.items() if isinstance(values, dict)
                     for name in values)


# Pairs of keys that give one setting two ways (b, or m with b = B/(m d)). Of the two, the one a
# later layer writes wins, as any later layer's key wins over an earlier one's: an override's
# train.micro_batches over the micro_batch of the file (or of its base), a file's over its base's.
# Written in one layer, both stand, and validation checks that they agree. A winner at its
# "unset" value (micro_batches 0: derive m from b) drops nothing.
ALTERNATIVES = (("train.micro_batch", "train.micro_batches"),)
UNSET = {"train.micro_batches": 0}


def layered(raw: dict, layers: list[frozenset[str]]) -> tuple[dict, frozenset[str]]:
    """(`raw` without the key of each `ALTERNATIVES` pair that a later layer's other key
    overrides, the keys written): `layers` are the written keys of each layer, the defaults' side
    first (base files, the file, the overrides)."""
    for pair in ALTERNATIVES:
        last = [max((i for i, keys in enumerate(layers) if key in keys), default=-1) for key in pair]
        if min(last) < 0 or last[0] == last[1]:
            continue
        loser, winner = (pair[0], pair[1]) if last[0] < last[1] else (pair[1], pair[0])
        group, name = winner.split(".")
        if winner in UNSET and raw[group][name] == UNSET[winner]:
            continue
        group, name = loser.split(".")
        raw = {**raw, group: {k: v for k, v in raw[group].items() if k != name}}
        layers = [keys - {loser} for keys in layers]
    return raw, frozenset().union(*layers)


def override_list(overrides) -> list[str]:
    """`overrides` (any iterable of 'group.field=value' strings; None for none) as a list, or
    TypeError: a string, bytes or a dict would be read character by character or key by key."""
    if overrides is None:
        return []
    wrong = TypeError(f"overrides is a list of 'group.field=value' strings, got the {type(overrides).__name__} "
                      f"{overrides!r}")
    if isinstance(overrides, (str, bytes, dict)):
        raise wrong
    try:
        overrides = list(overrides)
    except TypeError:
        raise wrong from None
    for i, text in enumerate(overrides):
        if not isinstance(text, str):
            raise TypeError(f"overrides[{i}] is the {type(text).__name__} {text!r}: each override is a "
                            "'group.field=value' string")
    return overrides


def parse_override(text: str) -> tuple[str, str, object]:
    """'group.field=value' -> (group, field, value parsed as a YAML scalar)."""
    if "=" not in text:        # a blank text is named as a string (else the line starts ': ' or names nothing)
        raise ConfigError(text if text.strip() else repr(text), "override must look like group.field=value")
    key, _, value = text.partition("=")
    parts = key.strip().split(".")
    if key.startswith("-"):         # (from Python: the config argument, mtjax.mesh.simulate_cpu_devices)
        raise ConfigError(key, "is a command's flag, not a group.field=value override")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(repr(text) if not key.strip() else key, "override key must be group.field")
    if "\n" in value or "\r" in value:    # YAML would fold it into one line with a space, silently
        raise ConfigError(key, "the value holds a line break: give it on one line")
    try:
        parsed = yaml_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    except (RecursionError, ValueError) as e:
        raise ConfigError(key, f"cannot read the value: {first_words(e)}") from None
    return parts[0], parts[1], parsed


def _plain(v):
    """Lists and dicts all the way down (a blend's tuples as lists)."""
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else \
        {k: _plain(x) for k, x in v.items()} if isinstance(v, dict) else v


def printed(cfg: Config) -> dict:
    """`cfg`'s fields as `--print-config` shows them: every field of every group (a blend as a
    list of {weight, path}), but with train.micro_batches set the micro_batch the run uses rather
    than an unused one. Unwritten, it is b = B/(m d) at the config's own parallel.data; at data -1
    (d is the devices') it is left out, as it is derived from them. Written, it equals b
    (`validate.batch_split`) and is shown as written."""
    raw = _plain(cfg.to_dict())
    tr, d = cfg.train, cfg.parallel.data
    if tr.micro_batches and "train.micro_batch" not in cfg.written:
        if d > 0 and tr.global_batch % (tr.micro_batches * d) == 0:
            raw["train"]["micro_batch"] = tr.global_batch // (tr.micro_batches * d)
        else:
            del raw["train"]["micro_batch"]
    return raw


def to_yaml(cfg: Config) -> str:
    """`cfg` as a YAML file (`printed`) that `load_config` reads back to a Config that runs the
    same: equal, but for a micro_batch that train.micro_batches made unused, now shown as b."""
    return yaml.safe_dump(printed(cfg), sort_keys=False, allow_unicode=True)


def to_json(cfg: Config) -> str:
    """`cfg` as one JSON object (`printed`), its groups and fields in `to_yaml`'s order."""
    return json.dumps(printed(cfg), indent=2, ensure_ascii=False) + "\n"


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file (and its bases) <- dotted overrides. Every key of the files and the
    overrides is recorded as written (`Config.written`), the defaults are not; of two keys that
    give one setting two ways, a later layer's wins (`layered`)."""
    files: list[dict] = []
    raw = read_yaml(path, layers=files) if path else {}
    given: dict = {}
    for text in overrides:
        group, name, value = parse_override(text)
        if group in raw and not isinstance(raw[group], dict):
            raise ConfigError(group, "must be a mapping of fields")
        raw.setdefault(group, {})[name] = value
        given.setdefault(group, {})[name] = value
    return from_dict(*layered(raw, [written_keys(layer) for layer in (*files, given)]))
