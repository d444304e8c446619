"""`data.path` and `data.valid_path`: one token-file prefix, or a weighted blend of several.

The forms, the same in YAML and on the command line:
  data/web                          one prefix (a str; "" is the default)
  "0.7 data/web 0.3 data/code"      weight-prefix pairs, as Megatron's --data-path
  [{weight: 0.7, path: data/web}, {weight: 0.3, path: data/code}]   a YAML list

A blend becomes a tuple of `Corpus(weight, path)`, resolved once at load time. Weights must be
positive and finite, and so must their sum (the blend normalises them), the list must not be
empty, and each entry is named in errors by its position: `data.path[2]` is the second.

A prefix that names a raw text file (`x.jsonl` where `x.jsonl.bin` is missing) is refused with
the command that makes token files of it (`raw_text_hint`), and one that names a token file
itself (`x.bin`) with its prefix.
"""
from __future__ import annotations

import math
import os
import shlex

from mtjax.config.errors import ConfigError
from mtjax.config.schema import Corpus


def parse_data_path(key: str, value) -> str | tuple[Corpus, ...]:
    """A prefix (str) or a blend (tuple of Corpus) from a YAML value; ConfigError naming the entry."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        words = value.split()
        if len(words) < 2 or _number(words[0]) is None:
            _check_prefix(key, value)
            return value                  # one prefix, spaces and all
        if len(words) % 2:
            raise ConfigError(key, f"a weighted list needs weight-prefix pairs, got {len(words)} words in {value!r}")
        return _blend(key, [(words[i], words[i + 1]) for i in range(0, len(words), 2)])
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(key, "the weighted list is empty; give one prefix or weight-prefix pairs")
        return _blend(key, [_entry(f"{key}[{i + 1}]", item) for i, item in enumerate(value)])
    raise ConfigError(key, f"expected a prefix or a weighted list, got {type(value).__name__} {value!r}")


def _entry(key: str, item) -> tuple[object, object]:
    """(weight, path) of one YAML list item: a {weight, path} mapping (or a Corpus)."""
    if isinstance(item, Corpus):
        return item.weight, item.path
    if not isinstance(item, dict):
        raise ConfigError(key, f"expected a mapping {{weight, path}}, got {item!r}")
    unknown = sorted(str(k) for k in item if k not in ("weight", "path"))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", "unknown key (an entry has weight and path)")
    for name in ("weight", "path"):
        if name not in item:
            raise ConfigError(f"{key}.{name}", "missing")
    return _as_written(item["weight"], number=True), _as_written(item["path"])


def _as_written(x, number: bool = False):
    """A number as the config's YAML reader read it (`config/load.py` keeps its text): that text,
    so that an entry reads as the string form does (`path: 007` is the prefix 007, `weight: 010`
    is ten, not YAML 1.1's octal 8, and `1:30` is no number, not base 60's 90); a weight Python
    does not read (.inf, 0x10) as YAML read it."""
    spelling = getattr(x, "spelling", None)
    if spelling is None or (number and ":" not in spelling and _number(spelling) is None):
        return x
    return spelling


def _blend(key: str, pairs: list[tuple[object, object]]) -> tuple[Corpus, ...]:
    out = []
    for i, (weight, path) in enumerate(pairs):
        where = f"{key}[{i + 1}]"
        w = _number(weight)
        if w is None:
            raise ConfigError(f"{where}.weight", f"expected a number, got {weight!r}")
        if not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{where}.weight", f"must be positive and finite, got {weight!r}")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"{where}.path", f"must be a non-empty prefix, got {path!r}")
        _check_prefix(where, path)
        out.append(Corpus(w, path))
    if not math.isfinite(sum(c.weight for c in out)):   # normalising would give every corpus the share 0
        raise ConfigError(key, "the weights sum to more than a float holds; scale them down (only their ratios count)")
    return tuple(out)


def _check_prefix(key: str, prefix: str) -> None:
    hint = raw_text_hint(prefix)
    if hint:
        raise ConfigError(key, hint)


def raw_text_hint(prefix: str) -> str | None:
    """What to do when `prefix` has no token files but names a file itself: a raw text file
    gets the preprocess command that makes PREFIX.bin/.idx of it (or the prefix of the token
    files beside it), a token file its prefix; None otherwise (the prefix's files are there, or
    nothing is: validation names the missing file)."""
    if not os.path.isfile(prefix) or os.path.isfile(prefix + ".bin") or os.path.isfile(prefix + ".idx"):
        return None
    stem, ext = os.path.splitext(prefix)
    tokenized = os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx")
    if ext in (".bin", ".idx") and tokenized:
        return f"{prefix} is a token file; give its prefix: data.path={shlex.quote(stem)}"
    text = ext in (".jsonl", ".json", ".txt", ".text", ".md")
    if text and tokenized:
        return f"{prefix} is raw text; its token files are {stem}.bin/.idx: give data.path={shlex.quote(stem)}"
    out = stem if text else prefix + ".tokens"
    return (f"{prefix} is raw text, not a prefix of token files; preprocess it first: python -m "
            f"mtjax.data.preprocess --input {shlex.quote(prefix)} --output {shlex.quote(out)} [--tokenizer "
            f"tokenizer.json], then give data.path={shlex.quote(out)}")


def _number(x) -> float | None:
    """x as a float when it is a number or a string that spells one (bools are not numbers)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def corpora(value: str | tuple[Corpus, ...]) -> tuple[Corpus, ...]:
    """Every data path as a blend: one prefix is a blend of one, with weight 1 ("" gives ())."""
    if isinstance(value, tuple):
        return value
    return (Corpus(1.0, value),) if value else ()


def entry_key(key: str, value, i: int) -> str:
    """How errors name corpus i of `value`: the key itself for one prefix, `key[i+1]` in a blend."""
    return f"{key}[{i + 1}]" if isinstance(value, tuple) else key
