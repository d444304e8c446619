"""The run's tokenization completed from what its data records.

A preprocessed index records how its tokens were made (`data.tokenizer.record`): the tokenizer
file's name, size and CRC-32, the end- and beginning-of-document ids, and whether each document
starts with BOS. A run that leaves `data.tokenizer` unset ("byte", the default) on data made
with a tokenizer file takes all of it: the file (looked for beside the index, then in the current
directory, and recognised by its content), `data.add_bos`, and the EOD and BOS tokens by name.
A run that names its tokenizer keeps its own settings, which `data_setup.check_tokenization`
compares with the record as before: a setting that disagrees is refused.
"""
from __future__ import annotations

import dataclasses
import os

from mtjax.config.data_path import corpora
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.data import IndexedDataset
from mtjax.data.tokenizer import describe, file_identity, same_tokenizer


def completed_config(cfg: Config) -> Config:
    """`cfg` with its `data` group's tokenization taken from the first training corpus's index
    when `data.tokenizer` is unset and that corpus was made with a tokenizer file (module
    docstring); `cfg` itself otherwise. ConfigError naming data.tokenizer when the file is not
    found."""
    listed = corpora(cfg.data.path)
    if cfg.data.tokenizer != "byte" or not listed:
        return cfg
    indexed = IndexedDataset(listed[0].path, verify=False)   # the record only; _open verifies the tokens
    made = indexed.record or {}
    identity = made.get("tokenizer")
    if not isinstance(identity, dict) or identity.get("name") == "byte":
        return cfg
    path = find_tokenizer(indexed.prefix, identity)
    if path is None:
        bos = made.get("add_bos") is True
        raise ConfigError("data.tokenizer", f"{indexed.idx_path} was made with the tokenizer {describe(identity)}"
                                            f"{' and BOS before each document' if bos else ''}, which is neither "
                                            f"beside it nor in the current directory; give data.tokenizer=PATH"
                                            + (" data.add_bos=true" if bos else ""))
    names = _token_names(path, made.get("eod_id"), made.get("bos_id") if made.get("add_bos") else None)
    data = dataclasses.replace(cfg.data, tokenizer=path, add_bos=bool(made.get("add_bos")),
                               eod_token=names[0], bos_token=names[1])
    return cfg.replace(data=data)


def find_tokenizer(prefix: str, identity: dict) -> str | None:
    """The file with the recorded tokenizer's content: the recorded name (or tokenizer.json)
    beside the data, then the recorded name in the current directory; None if none is."""
    name = os.path.basename(str(identity.get("name", "")))
    beside = os.path.dirname(os.path.abspath(prefix))
    for candidate in (os.path.join(beside, name), os.path.join(beside, "tokenizer.json"), os.path.abspath(name)):
        if name and os.path.isfile(candidate) and same_tokenizer(file_identity(candidate), identity):
            return candidate
    return None


def _token_names(path: str, *ids) -> list[str]:
    """The tokens of `ids` in the tokenizer file ("" for None, for an id it lacks, or when the
    file cannot be read here: loading it for the run then says why, and the run's check reports
    ids that differ)."""
    try:
        import tokenizers    # optional, as for HFTokenizer
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception:        # ImportError, or the library's bare Exception on a bad file
        return [""] * len(ids)
    return [(tok.id_to_token(int(i)) or "") if isinstance(i, int) else "" for i in ids]
