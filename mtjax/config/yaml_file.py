"""How a config's YAML is read: files with `base:` chains, and override values.

PyYAML's SafeLoader with five changes (`_Loader`): YAML 1.2 floats such as `3e-4`; a key given
twice in one mapping refused; each number keeps the text it was written as (`_SpelledInt`), so
a str field takes that text and an int field can refuse YAML 1.1's octal and base 60; dates as
text; booleans as YAML 1.2 spells them (`yes`, `on` are text a bool field also takes). Values are checked against the schema by `config.load`.
"""
from __future__ import annotations

import os
import re

import yaml

from mtjax.config.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as `3e-4` (YAML 1.1 wants `3.0e-4`),
    refuses a key given twice in one mapping (PyYAML would keep the last silently; `<<: *anchor`'s
    merged keys yield to the mapping's own), keeps how each number was written (`_Spelled`) and
    reads dates as text (no field is a date)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node in [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]:   # `<<` merged below
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark)
                seen.add(key)
            except TypeError:       # a list or mapping as a key: SafeLoader's own error names its line
                break
        return super().construct_mapping(node, deep)


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.problem_mark = key, mark


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."))


class _SpelledInt(int):
    """A YAML number with the text it was written as (`spelling`): a str field takes that text
    (`run_dir: 007` is the directory 007, not 7), and an int field refuses YAML 1.1's octal
    `010` (8) and base-60 `1:30` (90), which no one means."""
    spelling = ""


class _SpelledFloat(float):
    spelling = ""


def _keep_spelling(construct, cls):
    def constructor(loader, node):
        value = cls(construct(loader, node))
        value.spelling = node.value
        return value
    return constructor


_Loader.add_constructor("tag:yaml.org,2002:int", _keep_spelling(yaml.SafeLoader.construct_yaml_int, _SpelledInt))
_Loader.add_constructor("tag:yaml.org,2002:float", _keep_spelling(yaml.SafeLoader.construct_yaml_float,
                                                                  _SpelledFloat))
_Loader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)
# Booleans as YAML 1.2 spells them (true, false): YAML 1.1's yes, no, on and off stay text, so a
# str field takes them as written (`run_dir: on` is the directory "on"); a bool field reads them
# as YAML 1.1 would (`config.load`'s `BOOL_WORDS`).
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
BOOL_WORDS = {w: v for words, v in (("yes on", True), ("no off", False)) for word in words.split()
              for w in (word, word.capitalize(), word.upper())}
# YAML 1.1's legacy number forms: a leading zero is octal, colons count in base 60
SURPRISING_NUMBER = re.compile(r"^[-+]?(?:0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$")


def yaml_load(text_or_file):
    return yaml.load(text_or_file, Loader=_Loader)  # noqa: S506  (a SafeLoader subclass)


def read_yaml(path: str, seen: tuple[str, ...] = (), named_by: str | None = None, layers: list | None = None) -> dict:
    """The merged mapping of `path` and its base files (`named_by`: whose `base:` names `path`);
    `layers`, if given, gets each file's own mapping appended, the deepest base first."""
    real = os.path.realpath(path)
    if real in seen:
        raise ConfigError("base", f"circular base file chain through {path}")
    key, whose = ("--config", "") if named_by is None else ("base", f" (the base of {named_by})")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml_load(f)
    except FileNotFoundError:
        raise ConfigError(key, f"file not found: {path}{whose}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(key, f"cannot read {path}{whose}: {e}") from None
    except _DuplicateKey as e:
        raise ConfigError(key, f"{path}{whose} gives the key {e.key!r} twice (line {e.problem_mark.line + 1}); "
                               "give each key once") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(key, f"malformed YAML in {path}{whose}{where}") from None
    except (RecursionError, ValueError) as e:   # nesting thousands deep; an integer of thousands of digits
        raise ConfigError(key, f"cannot read {path}{whose}: {first_words(e)}") from None
    if not isinstance(raw, dict):   # None: an empty file or comments only (as a failed write leaves), not the defaults
        raise ConfigError(key, f"{path}{whose} " + ("is empty: no config groups" if raw is None else
                                                    "must hold a mapping of config groups"))
    base = raw.pop("base", None)
    if base is None:
        layers is None or layers.append(raw)
        return dict(raw)
    if not isinstance(base, str) or not base.strip():
        raise ConfigError("base", f"must be a file path, got {base!r} in {path}")
    merged = read_yaml(os.path.join(os.path.dirname(path), base), seen + (real,), path, layers)
    layers is None or layers.append(raw)
    for group, values in raw.items():
        if isinstance(values, dict) and isinstance(merged.get(group), dict):
            merged[group] = {**merged[group], **values}
        else:
            merged[group] = values
    return merged


def first_words(e: Exception) -> str:
    return " ".join(str(e).split())[:120] or type(e).__name__
