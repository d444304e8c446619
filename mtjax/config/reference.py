"""The configuration reference, read off the schema: every group and field with its type,
default and one-line meaning (`fields.doc`'s metadata). One source for three readers:
`python -m mtjax.config [GROUP ...] [--search WORD]` (a listing), `python -m mtjax.config --markdown`
(docs/config.md, which a test keeps equal to `markdown()`), and the docs' tables."""
from __future__ import annotations

import dataclasses
import json
import typing
from typing import NamedTuple

from mtjax.config.errors import ConfigError
from mtjax.config.load import REMOVED, did_you_mean
from mtjax.config.schema import Config, DataPath


class FieldDoc(NamedTuple):
    key: str          # group.field
    type: str         # int, float, bool, str, a `| null`, or path (DataPath)
    default: str      # as written in YAML
    help: str


def groups() -> dict[str, type]:
    """{group name: its dataclass}, in the schema's order."""
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in Config.groups()}


def group_help(cls) -> str:
    """A group's meaning: its docstring's first paragraph, on one line."""
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _type_name(typ) -> str:
    if typ == DataPath:
        return "path"
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if args:
        return f"{args[0].__name__} | null"
    return typ.__name__


def _yaml_value(value) -> str:
    """How a default is written in a YAML file (or on the command line after `=`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if value == "" else value
    return repr(value)


def fields(name: str) -> list[FieldDoc]:
    """One group's fields, in the schema's order."""
    cls = groups()[name]
    hints = typing.get_type_hints(cls)
    return [FieldDoc(f"{name}.{f.name}", _type_name(hints[f.name]), _yaml_value(f.default), f.metadata["help"])
            for f in dataclasses.fields(cls)]


def chosen(names: list[str] | None) -> list[tuple[str, list[FieldDoc]]]:
    """(group, the rows to show) for each name of `names` (a group, or one field as
    `group.field`), each group once and in the order first named, its fields in the schema's
    order (every group, whole, by default); ConfigError for a name that is neither."""
    picked: dict[str, set[str] | None] = {}       # group -> the fields named (None: all of them)
    for name in names or groups():
        group, dot, field = name.partition(".")
        if group not in groups():
            owner = [g for g in groups() if not dot and any(r.key == f"{g}.{name}" for r in fields(g))]
            hint = f"; did you mean {owner[0]}.{name}?" if owner else did_you_mean(group, groups())
            if not hint and not dot and name.strip():     # a word, perhaps from a field's meaning
                hint = f"; --search {name} lists the fields whose name or meaning holds it"
            raise ConfigError(repr(name) if not name.strip() else name, "unknown config group" + hint)
        keys = {r.key for r in fields(group)}
        if dot and name not in keys:       # the field's name against the group's, as loading guesses
            guess = did_you_mean(field, {k.partition(".")[2] for k in keys}, f"{group}.")
            raise ConfigError(name, REMOVED.get(name) or f"unknown field of {group}" + guess)
        if not dot or picked.get(group, set()) is None:
            picked[group] = None
        else:
            picked.setdefault(group, set()).add(name)
    return [(group, [r for r in fields(group) if keys is None or r.key in keys]) for group, keys in picked.items()]


def found(names: list[str] | None, search: str | None) -> list[tuple[str, list[FieldDoc]]]:
    """`chosen(names)` narrowed to the fields whose key or meaning holds `search` (any case),
    groups without one left out; ConfigError when no field does."""
    picked = chosen(names)
    if search is None:
        return picked
    word = search.strip().lower()
    if not word:
        raise ConfigError("--search", "must name a word")
    hits = [(g, [r for r in rows if word in r.key.lower() or word in r.help.lower()]) for g, rows in picked]
    hits = [(g, rows) for g, rows in hits if rows]
    if not hits:
        raise ConfigError("--search", f"no field's name or meaning holds {search!r}"
                                      + (f" in {', '.join(g for g, _ in picked)}" if names else ""))
    return hits


def listing(names: list[str] | None = None, search: str | None = None) -> str:
    """The groups or fields `names` names (every group by default), only those that mention
    `search` when given, as aligned text: `group.field = default  meaning (type)`; ConfigError
    for a name that is neither, or a search that finds nothing."""
    out = []
    for name, rows in found(names, search):
        width = max(len(f"{r.key} = {r.default}") for r in rows)
        out.append(f"{name}: {group_help(groups()[name])}")
        out += [f"  {f'{r.key} = {r.default}':<{width}}  {r.help} ({r.type})" for r in rows]
        out.append("")
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


MARKDOWN_HEAD = """\
# Configuration reference

Generated from `mtjax/config/schema.py` by `python -m mtjax.config --markdown > docs/config.md`;
`tests/test_config_reference.py` fails when the two differ. `python -m mtjax.config [GROUP ...]`
prints the same list in a terminal (`--search WORD`: the fields whose name or meaning holds it).

A config is resolved once: the defaults below, then the YAML file (`--config FILE`, which may
start from another with a top-level `base: other.yaml`), then the `group.field=value` overrides
on the command line, read as YAML scalars (`true`, `1e-3`, `null`). The keys the files and the
overrides set are recorded as written. `train.micro_batch` and `train.micro_batches` give b two
ways: of the two, a later layer's wins (an override's over the file's, a file's over its base's),
and both written in one layer must agree, whatever the value. An unknown key or a wrong
type is an error; `mtjax/config/validate/` then checks ranges and divisibility. `--print-config`
prints the resolved config as YAML (with `--json`, where the command has it: JSON) without
running anything, after the checks a run makes on the devices `--cpu-devices N` names, or else
on the config's own mesh (not whether the data files exist or the run directory is writable
here: the config may be meant for another machine). The user guide explains the fields in
context: [docs/guide/](guide/README.md).
"""


def markdown(names: list[str] | None = None, search: str | None = None) -> str:
    """docs/config.md: a table per group (field, type, default, meaning); with `names` (or
    `search`), only the tables (or rows) of the groups (or fields) they name (or that mention it)."""
    out = [] if names or search is not None else [MARKDOWN_HEAD]
    for name, rows in found(names, search):
        out += [f"## `{name}`", "", group_help(groups()[name]), "",
                "| field | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{r.key}` | {_cell(r.type)} | `{r.default}` | {_cell(r.help)} |" for r in rows]
        out.append("")
    return "\n".join(out)
