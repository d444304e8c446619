"""Tokenize text files into PREFIX.bin/.idx (see `indexed` for the format).

    python -m mtjax.data.preprocess --input data.jsonl --output data/my_corpus

Input formats:
  jsonl  one JSON object per line, its text under --json-key is one
         document; blank lines are skipped.
  text   the whole file is one document (give one --input per document).
  auto   jsonl for names ending in .jsonl or .json, text otherwise.

The tokenizer's end-of-document id is appended after every document. On bad
input (missing file, malformed JSON line, missing key, unwritable output)
the command prints one `error: ...` line to stderr, exits with status 2 and
leaves no output files; on success it prints a one-line summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Iterator, Sequence

from mtjax.data.errors import DataError
from mtjax.data.indexed import IndexedWriter, dtype_for_vocab
from mtjax.data.tokenizer import Tokenizer, load_tokenizer

FORMATS = ("auto", "jsonl", "text")
EXIT_BAD_INPUT = 2


@dataclasses.dataclass(frozen=True)
class PreprocessStats:
    documents: int  # documents written
    tokens: int  # tokens written, EOD included
    seconds: float  # wall time


def resolve_format(path: str, fmt: str) -> str:
    """"jsonl" or "text" for this input under --format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    return "jsonl" if path.endswith((".jsonl", ".json")) else "text"


def read_documents(path: str, fmt: str, json_key: str = "text") -> Iterator[str]:
    """The documents of one input file, in order; raises DataError naming file and line."""
    try:
        if resolve_format(path, fmt) == "text":
            with open(path, encoding="utf-8") as f:
                yield f.read()
            return
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield _jsonl_text(line, json_key, f"{path}:{lineno}")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 (byte {e.start})") from None


def _jsonl_text(line: str, json_key: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if json_key not in record:
        raise DataError(f"{where}: no key {json_key!r}")
    text = record[json_key]
    if not isinstance(text, str):
        raise DataError(f"{where}: {json_key!r} is a {type(text).__name__}, not a string")
    return text


def preprocess(inputs: Sequence[str], output: str, tokenizer: Tokenizer,
               json_key: str = "text", fmt: str = "auto") -> PreprocessStats:
    """Tokenize `inputs` (in order) into `output`.bin/.idx; all or nothing."""
    start = time.perf_counter()
    for path in inputs:  # fail before creating anything
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: output directory does not exist or is not a directory")
    with IndexedWriter(output, dtype_for_vocab(tokenizer.vocab_size)) as writer:
        for path in inputs:
            for text in read_documents(path, fmt, json_key):
                writer.add_document(tokenizer.encode(text) + [tokenizer.eod_id])
    return PreprocessStats(writer.documents, writer.tokens, time.perf_counter() - start)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m mtjax.data.preprocess",
        description="Tokenize text into an mtjax indexed dataset (PREFIX.bin and PREFIX.idx). "
                    "jsonl: one JSON object per line, one document each. text: the whole file "
                    "is one document. EOD is appended after every document.")
    parser.add_argument("--input", action="append", required=True,
                        help="input file; repeat for several (read in the order given)")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="byte",
                        help="'byte' (UTF-8 bytes + EOD) or a path to a Hugging Face tokenizer.json")
    parser.add_argument("--json-key", default="text", help="key holding the text in each JSONL record")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="auto: jsonl for *.jsonl/*.json, text otherwise; "
                             "text: the whole file is one document")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        stats = preprocess(args.input, args.output, tokenizer, args.json_key, args.format)
    except (DataError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.output}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens, "
          f"{stats.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
