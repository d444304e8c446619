"""Build an indexed dataset (PREFIX.bin/.idx, see `indexed` for the format) from documents: the
library under `python -m mtjax.data.preprocess` (`mtjax.commands.preprocess`).

Input formats:
  jsonl  one JSON object per line, its text under `json_key` is one
         document; blank lines are skipped.
  text   the whole file is one document, its text exactly as written (\r\n stays; give one input
         per document).
  auto   jsonl for names ending in .jsonl, .json or .ndjson (any case), text otherwise.

An input may be any readable file but a directory (a pipe such as /dev/stdin
too). The tokenizer's end-of-document id is appended after every document, and
with `add_bos` its beginning-of-document id is put before each; special tokens'
literals inside the text are encoded as ordinary text. The .idx records the
tokenizer (its file's name, size and CRC-32) and these ids, and training
refuses data made otherwise. Documents whose text gives no tokens are skipped
(as Megatron does), and input with no document left is refused. Bad input is a
DataError naming the file (and line); a fault while writing is a RunFault; either
way nothing is left (a writer killed outright leaves temporary files the next run
sweeps: `tempfiles`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Iterator, Sequence

from mtjax.config.errors import RunFault
from mtjax.data.errors import DataError, json_kind
from mtjax.data.indexed import IndexedWriter, dtype_for_vocab
from mtjax.data.tokenizer import TokenOptionError, Tokenizer, check_bos_begins_documents, record

FORMATS = ("auto", "jsonl", "text")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")   # `auto`, in any case: DATA.JSONL is JSON lines too


@dataclasses.dataclass(frozen=True)
class PreprocessStats:
    documents: int  # documents written
    tokens: int  # tokens written, EOD (and BOS) included
    skipped: int  # documents skipped because their text gave no tokens
    seconds: float  # wall time


def resolve_format(path: str, fmt: str) -> str:
    """"jsonl" or "text" for this input under --format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    return "jsonl" if path.lower().endswith(JSONL_SUFFIXES) else "text"


def read_documents(path: str, fmt: str, json_key: str = "text") -> Iterator[tuple[str, str]]:
    """(where, text) of each document of one input file, in order; `where` is
    PATH for a text file and PATH:LINE for a JSONL record. Raises DataError
    naming the file (and line) for anything unreadable."""
    try:
        if resolve_format(path, fmt) == "text":
            with open(path, encoding="utf-8", newline="") as f:   # newline="": \r\n and \r kept as written
                text = f.read()  # one decode of the whole file: the error's offset is the file's
            yield path, text
            return
        with open(path, "rb") as f:  # lines decoded one by one, so an error names its line
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                line = decode_line(raw, where)
                if line.strip():
                    yield where, _jsonl_text(line, json_key, where)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not an input file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def decode_line(raw: bytes, where: str) -> str:
    """One input line as text; a line that is not UTF-8 is a `DataError` naming `where`."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte {e.start} of the line)") from None


def _jsonl_text(line: str, json_key: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DataError(f"{where}: malformed JSON ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise DataError(f"{where}: malformed JSON (nested too deeply)") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {json_kind(record)}")
    if json_key not in record:
        raise DataError(f"{where}: no key {json_key!r}")
    text = record[json_key]
    if not isinstance(text, str):
        raise DataError(f"{where}: {json_key!r} is {json_kind(text)}, not a string")
    try:  # JSON's \ud800-style escapes can give lone surrogates, which no tokenizer encodes
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: {json_key!r} holds a lone surrogate {text[e.start]!r} at character "
                        f"{e.start}; it is not valid Unicode text") from None
    return text


def check_inputs(inputs: Sequence[str]) -> None:
    """Refuse missing inputs and directories before anything is created."""
    for path in inputs:
        if not path:
            raise DataError("an --input is empty; give the path of a file")
        if os.path.isdir(path):
            raise DataError(f"{path}: is a directory, not an input file")
        if not os.path.exists(path):
            raise DataError(f"{path}: file not found")


def check_output(output: str) -> None:
    """Refuse an output that is not a usable prefix, before anything is created (the command
    checks its directory too: `cli_checks.output_parent`)."""
    example = "an output is a prefix, e.g. data/corpus writes data/corpus.bin and data/corpus.idx"
    if not output:
        raise DataError(f"the output prefix is empty; {example}")
    if output.endswith(("/", os.sep)):
        raise DataError(f"{output}: ends with a path separator; {example}")
    if os.path.isdir(output):
        raise DataError(f"{output}: is a directory; {example}")
    for suffix in (".bin", ".idx"):
        if os.path.isdir(output + suffix):
            raise DataError(f"{output}{suffix}: is a directory, where the output file would go")


def preprocess(inputs: Sequence[str], output: str, tokenizer: Tokenizer,
               json_key: str = "text", fmt: str = "auto", add_bos: bool = False) -> PreprocessStats:
    """Tokenize `inputs` (in order) into `output`.bin/.idx, each document [BOS] text EOD; all or nothing."""
    if add_bos and tokenizer.bos_id is None:
        raise TokenOptionError("add_bos", f"tokenizer {tokenizer.name} has no beginning-of-document token")
    if add_bos:
        check_bos_begins_documents(tokenizer)
    start = time.perf_counter()
    check_inputs(inputs)
    check_output(output)
    for path in inputs:       # the output would replace an input while it is being read
        if any(os.path.exists(f) and os.path.samefile(path, f) for f in (output + ".bin", output + ".idx")):
            raise DataError(f"{path}: is also the output ({output}.bin/.idx); choose another --output")
    try:
        with IndexedWriter(output, dtype_for_vocab(tokenizer.vocab_size), record(tokenizer, add_bos)) as writer:
            skipped = _write_documents(writer, inputs, tokenizer, json_key, fmt, add_bos)
            if writer.documents == 0:
                raise DataError(f"no documents: nothing to tokenize in {', '.join(inputs)} "
                                f"({skipped} empty documents skipped)")
    except OSError as e:  # inputs raise DataError, so this is the writer's: a fault (a full disk, ...)
        raise RunFault(f"{output}: cannot write the output ({e.strerror or e}); nothing was written") from None
    return PreprocessStats(writer.documents, writer.tokens, skipped, time.perf_counter() - start)


def _write_documents(writer: IndexedWriter, inputs: Sequence[str], tokenizer: Tokenizer,
                     json_key: str, fmt: str, add_bos: bool) -> int:
    """Add every non-empty document ([BOS], its ids, EOD); returns how many were empty."""
    skipped, first = 0, [tokenizer.bos_id] if add_bos else []
    for path in inputs:
        for where, text in read_documents(path, fmt, json_key):
            try:
                ids = tokenizer.encode(text)
            except DataError as e:       # a special token's id from plain text
                raise DataError(f"{where}: {e}") from None
            if not ids:
                skipped += 1
                continue
            ids[:0] = first             # in place: no second list of a huge document's ids
            ids.append(tokenizer.eod_id)
            write_document(writer, ids, where, tokenizer)
    return skipped


def write_document(writer, ids: list[int], where: str, tokenizer) -> None:
    """writer.add_document(ids); DataError naming `where` for an id the token dtype cannot hold
    (the tokenizer misstates its vocabulary)."""
    try:
        writer.add_document(ids)
    except ValueError as e:
        raise DataError(f"{where}: {e} (tokenizer {tokenizer.name}, vocabulary {tokenizer.vocab_size})") from None
