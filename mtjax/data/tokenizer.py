"""Tokenizers: text <-> token ids, plus the end-of-document id and an optional beginning-of-document id.

Two implementations of one small protocol:

* `ByteTokenizer`: UTF-8 bytes are ids 0..255 and id 256 ends a document.
  Needs nothing, never fails to encode, and is what the embedded corpus uses.
* `HFTokenizer`: a user-supplied Hugging Face `tokenizer.json`, loaded with
  the optional `tokenizers` package (imported only when asked for).

Special tokens are never produced from plain text: a document that contains the literal
`<|endoftext|>` (source code does) is encoded as those characters, and only the pipeline
puts the end-of-document id (and, with `add_bos`, the beginning-of-document id) in the data.

`load_tokenizer(spec)` picks one from a string, as the CLI does, and `config_tokenizer` from a
run's `data` group; `record` is what a corpus records of the tokenization that made it
(`indexed.py` keeps it in the .idx), and `file_identity`, `same_tokenizer` and `describe`
identify, compare and name a tokenizer file.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Protocol, Sequence, runtime_checkable

from mtjax.data.errors import DataError, one_line


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str  # short identifier, e.g. "byte" or "hf:/path/tokenizer.json"
    vocab_size: int  # ids are in [0, vocab_size)
    eod_id: int  # appended after every document
    bos_id: int | None  # the beginning-of-document token, prepended with add_bos; None if it has none
    identity: dict  # what identifies it: {"name": "byte"} or the file's name, size and CRC-32

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; the end-of-document id is rendered as text too."""
        ...

    def token(self, token_id: int) -> str:
        """The text of one id (for messages)."""
        ...


class TokenOptionError(DataError):
    """An end/beginning-of-document option the tokenizer cannot satisfy; `option` is
    "eod_token", "bos_token" or "add_bos" (the caller names its own key or flag)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; token 256 is end-of-document.

    Decoding renders the EOD token as `EOD_TEXT` and replaces invalid UTF-8
    (e.g. a multi-byte character cut by a sample boundary) with U+FFFD.
    """

    EOD_TEXT = "<|endoftext|>"

    name = "byte"
    vocab_size = 257
    eod_id = 256
    bos_id = None
    identity = {"name": "byte"}

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

    def token(self, token_id: int) -> str:
        return self.EOD_TEXT if token_id == self.eod_id else bytes([token_id]).decode("latin-1")


# Looked for, in order, among the special tokens and then in the whole vocabulary, when the
# tokenizer.json's post-processor does not place one (Llama 3's <|end_of_text|> is only found here).
EOD_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, used through the `tokenizers` package.

    `eod_token` names the end-of-document token. Empty, it is the tokenizer's own: the special
    token its post-processor template appends after a sequence, else the first special token
    (then any token) among `EOD_CANDIDATES`. `bos_token` likewise: named, or the special token
    the template puts first, else the first of `BOS_CANDIDATES`; None when there is none.

    Encoding adds no special tokens and matches none: the special tokens' literals in the text
    are encoded as ordinary text (`encode_special_tokens`), and a text that would still give the
    EOD or BOS id (a tokenizer whose vocabulary holds the literal as a word) is refused.
    """

    def __init__(self, path: str, eod_token: str | None = None, bos_token: str | None = None):
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
        self._tok.encode_special_tokens = True  # a special token's literal in the text is text
        self.path = path
        self.name = f"hf:{os.path.abspath(path)}"
        self.identity = file_identity(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        specials = [t.content for _, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special]
        before, after = _template_specials(self._tok.to_str())
        self.eod_id = self._find("eod_token", eod_token, after, specials, EOD_CANDIDATES)
        if self.eod_id is None:
            raise TokenOptionError("eod_token", f"{path}: no end-of-document token (the post-processor appends none, "
                                                f"and none of {', '.join(EOD_CANDIDATES)} is in the vocabulary); "
                                                f"name one")
        self.bos_id = self._find("bos_token", bos_token, before, specials, BOS_CANDIDATES)
        self._reserved = {self.eod_id} | ({self.bos_id} if self.bos_id is not None else set())

    def _find(self, option: str, named: str | None, placed: str | None, specials: list[str],
              candidates: tuple[str, ...]) -> int | None:
        """The id of the token `named`, else `placed` (by the template), else the first candidate
        among the special tokens, then in the vocabulary; None when there is none."""
        if named:
            token_id = self._tok.token_to_id(named)
            if token_id is None:
                raise TokenOptionError(option, f"{self.path}: has no token {named!r}")
            return self._in_vocabulary(option, token_id)
        for token in ([placed] if placed else []) + [c for c in candidates if c in specials] + list(candidates):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return self._in_vocabulary(option, token_id)
        return None

    def _in_vocabulary(self, option: str, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise TokenOptionError(option, f"{self.path}: the {option} id {token_id} is outside the vocabulary "
                                           f"of {self.vocab_size} ids")
        return token_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        clash = self._reserved.intersection(ids)
        if clash:
            token_id = min(clash)
            raise DataError(f"the text encodes to id {token_id} ({self.token(token_id)!r}), which marks the "
                            f"{'end' if token_id == self.eod_id else 'beginning'} of a document: {self.path} "
                            f"holds that token's literal as an ordinary word, so the text cannot keep it as text")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or f"<id {token_id}>"


def _template_specials(tokenizer_json: str) -> tuple[str | None, str | None]:
    """(the special token the post-processor's single-sequence template puts before the text,
    the one it puts after), each None if none: `<|begin_of_text|> $A` gives (BOS, None)."""
    processor = json.loads(tokenizer_json).get("post_processor") or {}
    templates = processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]
    for template in templates:
        if not isinstance(template, dict) or template.get("type") != "TemplateProcessing":
            continue
        pieces = template.get("single") or []
        text = next((i for i, p in enumerate(pieces) if "Sequence" in p), None)
        if text is None:
            continue
        names = [p["SpecialToken"]["id"] if "SpecialToken" in p else None for p in pieces]
        before = next((n for n in names[:text] if n), None)
        after = next((n for n in names[text + 1:] if n), None)
        return before, after
    return None, None


def file_identity(path: str) -> dict:
    """A tokenizer file's name, size and CRC-32: two files with the same bytes are the same tokenizer."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return {"name": os.path.basename(path), "bytes": os.path.getsize(path), "crc32": f"{crc:08x}"}


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two identities name the same tokenizer (the file's content, whatever its name)."""
    def content(identity: dict):
        return "byte" if identity.get("name") == "byte" else (identity.get("bytes"), identity.get("crc32"))
    return content(a) == content(b)


def describe(identity: dict) -> str:
    """'byte', or 'tokenizer.json (9000 bytes, crc32 1234abcd)'."""
    if identity.get("name") == "byte":
        return "byte"
    return f"{identity.get('name')} ({identity.get('bytes')} bytes, crc32 {identity.get('crc32')})"


def record(tokenizer: Tokenizer, add_bos: bool) -> dict:
    """What a corpus records of the tokenization that made it (the .idx keeps it; training compares)."""
    return {"tokenizer": dict(tokenizer.identity), "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id,
            "bos_id": tokenizer.bos_id, "add_bos": bool(add_bos)}


def load_tokenizer(spec: str, eod_token: str | None = None, bos_token: str | None = None,
                   add_bos: bool = False) -> Tokenizer:
    """"byte" gives `ByteTokenizer`; anything else is a path to a tokenizer.json. TokenOptionError
    when a named token is missing, when `add_bos` finds no BOS token, or when the byte tokenizer
    is given a token name (its ids are fixed)."""
    if spec == "byte":
        for option, value in (("eod_token", eod_token), ("bos_token", bos_token)):
            if value:
                raise TokenOptionError(option, f"the byte tokenizer has fixed ids (EOD 256, no BOS): "
                                               f"{option} {value!r} cannot be set")
        tokenizer: Tokenizer = ByteTokenizer()
    else:
        tokenizer = HFTokenizer(spec, eod_token=eod_token, bos_token=bos_token)
    if add_bos and tokenizer.bos_id is None:
        where = "the byte tokenizer" if spec == "byte" else spec
        raise TokenOptionError("add_bos", f"{where} has no beginning-of-document token"
                                          + ("" if spec == "byte" else "; name one (bos_token)"))
    return tokenizer


def check_bos_begins_documents(tokenizer: Tokenizer) -> None:
    """TokenOptionError("add_bos") when the tokenizer's BOS is its end-of-document id. Every EOD ends a
    document (`model/documents.py`), so such a BOS would be read as the end of the document before it:
    document masking would cut it off as a one-token document of its own and restart positions after
    it, and the documents would never begin with it. GPT-2-style tokenizers, whose one special token
    is both, separate documents with that token alone (Megatron's and Hugging Face's data alike)."""
    if tokenizer.bos_id is not None and tokenizer.bos_id == tokenizer.eod_id:
        raise TokenOptionError("add_bos", f"the beginning-of-document token {tokenizer.token(tokenizer.bos_id)!r} "
                                          f"is also the end-of-document token (id {tokenizer.eod_id}), so each BOS "
                                          f"would read as the end of the document before it; leave BOS out (EOD "
                                          f"alone separates documents) or name a BOS and EOD that differ")


def config_tokenizer(cfg) -> Tokenizer:
    """The tokenizer a run's `data` group describes (`data.tokenizer` with its eod_token, bos_token
    and add_bos), for training, conversion and inference alike; ConfigError naming data.eod_token,
    data.bos_token or data.add_bos when the tokenizer cannot do what they ask."""
    from mtjax.config.errors import ConfigError
    dc = cfg.data
    try:
        return load_tokenizer(dc.tokenizer, dc.eod_token or None, dc.bos_token or None, dc.add_bos)
    except TokenOptionError as e:
        raise ConfigError(f"data.{e.option}", str(e)) from None


def _check_tokenizer_path(path: str) -> None:
    hint = "a tokenizer is 'byte' or the path of a Hugging Face tokenizer.json"
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a tokenizer file; {hint}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: tokenizer file not found; {hint}")
