"""Fine-tuning samples in the indexed format: `python -m mtjax.data.preprocess --format sft`.

Each line of the input is a JSON object with a prompt and a response (the keys: `--prompt-key`,
`--response-key`). A sample is written as two documents of the indexed format (`indexed.py`, the
same files, checksums and format version 3; the record adds {"sft": {"seq_len": S}}):

    document 2k      its prompt:   [BOS] prompt ids          (no loss when trained on)
    document 2k + 1  its response: response ids EOD          (the loss)

so the boundaries of the samples and of their loss masks are the index's own offsets, covered by
its checksum, and files made before this format read as before. A sample is at most S + 1
tokens (`--seq-len` S, the model's sequence; a row holds S + 1): a longer one is truncated, its
response cut to fill S + 1 tokens without EOD (it then fills its row alone), and the count is
reported. Refused, one line and nothing written: a line that is not a JSON object, a key
missing or not a string, an empty response, a prompt of S tokens or more (no response token
would be an input).
"""
from __future__ import annotations

import json
import os
import time
from typing import Sequence

from mtjax.config.errors import RunFault
from mtjax.data.build_index import PreprocessStats, check_inputs, check_output, decode_line, write_document
from mtjax.data.errors import DataError, json_kind
from mtjax.data.indexed import IndexedWriter, dtype_for_vocab
from mtjax.data.tokenizer import TokenOptionError, Tokenizer, check_bos_begins_documents, record

NO_LOSS = 1 << 30     # in a training row, set on a token whose prediction carries no loss (ids stay below it)


def is_sft(record: dict | None) -> bool:
    """Whether an index holds fine-tuning samples (prompt, response pairs)."""
    return bool(record) and isinstance(record.get("sft"), dict)


def _field(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise DataError(f"{where}: no key {key!r}")
    value = obj[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} is {json_kind(value)}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: {key!r} holds a lone surrogate at character {e.start}") from None
    return value


def read_samples(path: str, prompt_key: str, response_key: str):
    """(where, prompt, response) of each non-blank line of a JSONL file."""
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                line = decode_line(raw, where)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as e:
                    raise DataError(f"{where}: malformed JSON ({' '.join(str(e).split())})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: expected a JSON object, got {json_kind(obj)}")
                yield where, _field(obj, prompt_key, where), _field(obj, response_key, where)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None


def sample_ids(tokenizer: Tokenizer, prompt: str, response: str, seq_len: int, add_bos: bool, where: str):
    """(prompt ids, response ids, truncated): [BOS] prompt and response EOD, cut to S + 1 tokens."""
    first = [tokenizer.bos_id] if add_bos else []
    try:
        p, r = first + tokenizer.encode(prompt), tokenizer.encode(response)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None
    if not r:
        raise DataError(f"{where}: the response is empty")
    if len(p) >= seq_len:
        raise DataError(f"{where}: the prompt is {len(p)} tokens, it fills the whole sequence of "
                        f"--seq-len {seq_len} (no response token would be an input)")
    r = r + [tokenizer.eod_id]
    room = seq_len + 1 - len(p)
    return p, r[:room], len(r) > room


def preprocess_sft(inputs: Sequence[str], output: str, tokenizer: Tokenizer, seq_len: int,
                   prompt_key: str = "prompt", response_key: str = "response", add_bos: bool = False,
                   report=lambda line: None) -> PreprocessStats:
    """Tokenize the samples of `inputs` into `output`.bin/.idx (module docstring); all or nothing.
    `report` gets one line when samples were truncated. Stats count samples as documents."""
    start = time.perf_counter()
    if add_bos and tokenizer.bos_id is None:     # (as `build_index.preprocess`: before anything is read)
        raise TokenOptionError("add_bos", f"tokenizer {tokenizer.name} has no beginning-of-document token")
    if add_bos:
        check_bos_begins_documents(tokenizer)
    check_inputs(inputs)
    check_output(output)
    for path in inputs:
        if any(os.path.exists(f) and os.path.samefile(path, f) for f in (output + ".bin", output + ".idx")):
            raise DataError(f"{path}: is also the output ({output}.bin/.idx); choose another --output")
    made = {**record(tokenizer, add_bos), "sft": {"seq_len": seq_len}}
    samples = truncated = 0
    try:
        with IndexedWriter(output, dtype_for_vocab(tokenizer.vocab_size), made) as writer:
            for path in inputs:
                for where, prompt, response in read_samples(path, prompt_key, response_key):
                    p, r, cut = sample_ids(tokenizer, prompt, response, seq_len, add_bos, where)
                    write_document(writer, p, where, tokenizer)
                    write_document(writer, r, where, tokenizer)
                    samples, truncated = samples + 1, truncated + cut
            if samples == 0:
                raise DataError(f"no samples in {', '.join(inputs)}")
    except OSError as e:
        raise RunFault(f"{output}: cannot write the output ({e.strerror or e}); nothing was written") from None
    if truncated:
        report(f"{truncated} of {samples} samples were longer than --seq-len + 1 = {seq_len + 1} tokens: "
               f"their responses were cut to fit, without EOD")
    return PreprocessStats(samples, writer.tokens, 0, time.perf_counter() - start)
