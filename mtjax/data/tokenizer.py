"""Tokenizers: text <-> token ids, plus the end-of-document id.

Two implementations of one small protocol:

* `ByteTokenizer`: UTF-8 bytes are ids 0..255 and id 256 ends a document.
  Needs nothing, never fails to encode, and is what the embedded corpus uses.
* `HFTokenizer`: a user-supplied Hugging Face `tokenizer.json`, loaded with
  the optional `tokenizers` package (imported only when asked for).

`load_tokenizer(spec)` picks one from a string, as the CLI and configs do.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence, runtime_checkable

from mtjax.data.errors import DataError, one_line


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str  # short identifier, e.g. "byte" or "hf:/path/tokenizer.json"
    vocab_size: int  # ids are in [0, vocab_size)
    eod_id: int  # appended after every document

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; the end-of-document id is rendered as text too."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; token 256 is end-of-document.

    Decoding renders the EOD token as `EOD_TEXT` and replaces invalid UTF-8
    (e.g. a multi-byte character cut by a sample boundary) with U+FFFD.
    """

    EOD_TEXT = "<|endoftext|>"

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        pieces, current = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eod_id:
                pieces.append(current.decode("utf-8", "replace") + self.EOD_TEXT)
                current = bytearray()
            elif 0 <= i < 256:
                current.append(i)
            else:
                raise ValueError(f"byte tokenizer: id {i} outside [0, {self.vocab_size})")
        pieces.append(current.decode("utf-8", "replace"))
        return "".join(pieces)


# Tried in order when no end-of-document token is named explicitly.
EOD_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, used through the `tokenizers` package.

    `eod_token` names the end-of-document token; when None, the first of
    `EOD_CANDIDATES` present in the vocabulary is used. Encoding adds no
    special tokens (the pipeline appends EOD itself).
    """

    def __init__(self, path: str, eod_token: str | None = None):
        _check_tokenizer_path(path)  # a mistyped name says so, whether or not the package is there
        try:
            import tokenizers  # optional dependency, imported only here
        except ImportError as e:
            raise ImportError(
                "loading a tokenizer.json needs the 'tokenizers' package: "
                "pip install tokenizers"
            ) from e
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise DataError(f"{path}: cannot load tokenizer: {one_line(e)}") from e
        self.name = f"hf:{os.path.abspath(path)}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._find_eod(path, eod_token)
        if not 0 <= self.eod_id < self.vocab_size:
            raise DataError(f"{path}: the end-of-document id {self.eod_id} is outside the vocabulary of "
                            f"{self.vocab_size} ids")

    def _find_eod(self, path: str, eod_token: str | None) -> int:
        candidates = (eod_token,) if eod_token is not None else EOD_CANDIDATES
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise DataError(
            f"{path}: no end-of-document token (looked for {', '.join(candidates)})"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(spec: str, eod_token: str | None = None) -> Tokenizer:
    """"byte" gives `ByteTokenizer`; anything else is a path to a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)


def _check_tokenizer_path(path: str) -> None:
    hint = "a tokenizer is 'byte' or the path of a Hugging Face tokenizer.json"
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a tokenizer file; {hint}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: tokenizer file not found; {hint}")
