"""The tokenizer's files across a conversion.

from-hf copies the tokenizer files it finds beside the Hugging Face model into the run's
`tokenizer/` directory and points the run's `data.tokenizer` at the tokenizer.json there, so
that training, preprocessing and generation use the model's own tokenizer without being told.
to-hf writes the ids of the run's end- and beginning-of-document tokens into config.json
(`eos_token_id`, `bos_token_id`) and copies the run's tokenizer files beside the weights.
"""
from __future__ import annotations

import json
import os
import shutil

from mtjax.config.errors import ConfigError
from mtjax.config.schema import DataConfig
from mtjax.data.errors import DataError, one_line
from mtjax.data.tokenizer import HFTokenizer, TokenOptionError, load_tokenizer

# What transformers saves of a tokenizer (tokenizer.json is the one mtjax reads)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
SUBDIR = "tokenizer"


def found(directory: str) -> list[str]:
    """The tokenizer files in `directory`, in `TOKENIZER_FILES` order."""
    return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, name))]


def run_tokenizer(hf_dir: str, run_dir: str) -> str:
    """What `data.tokenizer` of a run converted from `hf_dir` into `run_dir` is: the path its
    tokenizer.json will have in the run, or "byte" when the model directory has none."""
    return os.path.join(run_dir, SUBDIR, "tokenizer.json") if "tokenizer.json" in found(hf_dir) else "byte"


def check_hf_tokenizer(hf_dir: str) -> None:
    """The tokenizer files beside the model must be what they say, since they are copied into the
    run (checked before anything is written): each one there a readable file (a directory or a
    dangling link of that name would be skipped and the run left on the byte tokenizer), the JSON
    ones JSON, and tokenizer.json a tokenizer. DataError naming the file. A tokenizer.json whose
    end-of-document token cannot be found is kept: the run can name it (data.eod_token)."""
    for name in TOKENIZER_FILES:
        path = os.path.join(hf_dir, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise DataError(f"{path}: is not a file (a directory, or a link to nothing readable)")
    for name in JSON_FILES:
        if os.path.isfile(path := os.path.join(hf_dir, name)):
            _check_json(path)
    if os.path.isfile(path := os.path.join(hf_dir, "tokenizer.json")):
        _check_tokenizer(path)


def check_run_tokenizer(data: DataConfig) -> None:
    """What `copy_to_hf` would copy into a Hugging Face directory, checked as from-hf checks a
    model's (`check_hf_tokenizer`): a broken tokenizer.json is refused, never passed on."""
    if data.tokenizer == "byte" or not os.path.lexists(data.tokenizer):   # moved away: the weights convert
        return
    if os.path.basename(data.tokenizer) == "tokenizer.json":
        check_hf_tokenizer(os.path.dirname(os.path.abspath(data.tokenizer)))
    elif not os.path.isfile(data.tokenizer):
        raise DataError(f"{data.tokenizer}: is not a file (a directory, or a link to nothing readable)")
    else:
        _check_tokenizer(data.tokenizer)


def _check_tokenizer(path: str) -> None:
    try:
        HFTokenizer(path)
    except TokenOptionError:
        pass
    except ImportError:
        _check_json(path)


def _check_json(path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{path}: not readable JSON ({one_line(e)})") from None


def copy_from_hf(hf_dir: str, run_dir: str) -> list[str]:
    """Copy the tokenizer files of `hf_dir` into `run_dir`/tokenizer/; their names."""
    names = found(hf_dir)
    if names:
        os.makedirs(os.path.join(run_dir, SUBDIR))
    for name in names:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(run_dir, SUBDIR, name))
    return names


SOURCE_IDS = "hf_token_ids"     # the checkpoint meta entry from-hf writes: the model's own ids


def source_token_ids(hf: dict) -> dict:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} as a Hugging Face config.json states them:
    an id, a list of ids (several end tokens), or None. from-hf keeps them in the step-0
    checkpoint's meta, so that to-hf gives them back even when no tokenizer came with the model."""
    def valid(i):
        ints = i if isinstance(i, list) else [i]
        return bool(ints) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints)
    return {key: hf.get(key) if valid(hf.get(key)) else None for key in ("bos_token_id", "eos_token_id",
                                                                         "pad_token_id")}


def check_source_token_ids(hf: dict, path: str) -> None:
    """ConfigError naming `path` and the key when config.json's bos/eos/pad id is neither absent,
    null, a whole number nor a non-empty list of them ("2", 2.0, true: transformers would keep the
    value as written and fail on it later). A negative id is allowed (-1 is "none" in some
    configs) and kept out of the meta as none (`source_token_ids`)."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        ints = value if isinstance(value, list) else [value]
        if value is not None and not (ints and all(isinstance(i, int) and not isinstance(i, bool) for i in ints)):
            raise ConfigError(f"{path}: {key}", f"must be a token id (a whole number) or a list of them, got {value!r}")


def token_ids(data: DataConfig, meta: dict | None = None) -> dict:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} for to-hf's config.json: those of the run's
    tokenizer (`data.tokenizer` with its eod_token and bos_token; EOS its end-of-document id, BOS
    its beginning-of-document id, None where it has none; no padding id), except in a checkpoint converted from
    Hugging Face and not trained since (its `meta` holds SOURCE_IDS): there the model's own ids,
    and the tokenizer's only where the model stated none and a tokenizer came with it (without
    one, the run's "byte" is a placeholder, not the model's). None when the tokenizer cannot be
    loaded here (its file has moved, or `tokenizers` is missing): the weights convert all the same."""
    source = meta.get(SOURCE_IDS) if meta else None
    source = source_token_ids(source) if isinstance(source, dict) else None
    if source is not None and (data.tokenizer == "byte" or None not in source.values()):
        return source
    try:
        tokenizer = load_tokenizer(data.tokenizer, data.eod_token or None, data.bos_token or None)
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eod_id, "pad_token_id": None}
    except (DataError, ImportError):
        ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    return {k: v if source is None or source[k] is None else source[k] for k, v in ids.items()}


def copy_to_hf(data: DataConfig, out: str) -> list[str]:
    """Copy the run's tokenizer into the Hugging Face directory `out`: its tokenizer.json, and the
    other tokenizer files beside it when it is named tokenizer.json (a directory from-hf filled).
    Nothing for the byte tokenizer or a file no longer there."""
    if data.tokenizer == "byte" or not os.path.isfile(data.tokenizer):
        return []
    source = os.path.dirname(os.path.abspath(data.tokenizer))
    if os.path.basename(data.tokenizer) != "tokenizer.json":
        shutil.copyfile(data.tokenizer, os.path.join(out, "tokenizer.json"))
        return ["tokenizer.json"]
    names = found(source)
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    return names


def data_group(data: DataConfig) -> dict:
    """The `data` group a converted run's config.yaml holds: its tokenizer, when one was copied."""
    return {} if data.tokenizer == "byte" else {"data": {"tokenizer": data.tokenizer}}


def train_hint(data: DataConfig) -> str:
    """What the training command of a converted run still needs besides data.path: nothing when
    its tokenizer was copied; else the tokenizer the user must name."""
    return "" if data.tokenizer != "byte" else " data.tokenizer=PATH/tokenizer.json"
