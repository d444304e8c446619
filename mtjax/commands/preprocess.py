"""The preprocess command: tokenize text files into PREFIX.bin/.idx (`mtjax.data.build_index`,
`mtjax.data.sft`).

    python -m mtjax.data.preprocess --input data.jsonl --output data/my_corpus

Input formats (--format): jsonl, one JSON object per line, its text under --json-key is one
document; text, the whole file is one document (give one --input per document); auto, jsonl for
names ending in .jsonl, .json or .ndjson (any case), text otherwise; sft, JSONL fine-tuning
samples, a prompt and a response each (--prompt-key, --response-key), cut to --seq-len + 1
tokens. The end-of-document token (--eod-token, by default the tokenizer's own) follows every
document, and with --add-bos the beginning-of-document token (--bos-token) precedes each. On
bad input (a missing file, malformed JSON, text that is not valid Unicode, an output that exists
already or whose directory is missing or not writable) the command prints one `error: ...` line
to stderr, exits with status 2 and leaves no files; on a fault while writing (a full disk, an I/O
error) one line and status 1; on SIGINT/SIGTERM one line and 128 + the signal number, leaving
no files either way. On success it prints a one-line summary.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Sequence

from mtjax import cli_checks
from mtjax.cli import make_bare_parser, report
from mtjax.cli_checks import given, output_parent
from mtjax.config.errors import ConfigError
from mtjax.data.build_index import FORMATS, check_inputs, check_output, preprocess, resolve_format
from mtjax.data.errors import one_line
from mtjax.data.sft import preprocess_sft
from mtjax.data.tokenizer import TokenOptionError, load_tokenizer
from mtjax.interrupts import Interrupted


def _parser() -> argparse.ArgumentParser:
    parser = make_bare_parser(
        "python -m mtjax.data.preprocess",
        "Tokenize text into an mtjax indexed dataset (PREFIX.bin and PREFIX.idx). "
        "jsonl: one JSON object per line, one document each. text: the whole file "
        "is one document. EOD is appended after every document; documents with no "
        "text are skipped.")
    parser.add_argument("--input", action="append", required=True,
                        help="input file; repeat for several (read in the order given)")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="byte", type=cli_checks.path,
                        help="'byte' (UTF-8 bytes + EOD) or a path to a Hugging Face tokenizer.json (default: %(default)s)")
    parser.add_argument("--eod-token", default="",
                        help="the end-of-document token (default: the tokenizer's end-of-text token)")
    parser.add_argument("--bos-token", default="",
                        help="the beginning-of-document token (default: the tokenizer's, if it has one)")
    parser.add_argument("--add-bos", action="store_true",
                        help="put the beginning-of-document token before every document")
    parser.add_argument("--json-key", default="text", help="key holding the text in each JSONL record (default: %(default)s)")
    parser.add_argument("--format", choices=FORMATS + ("sft",), default="auto",
                        help="auto: jsonl for *.jsonl/*.json/*.ndjson (any case), text otherwise; "
                             "text: the whole file is one document; sft: JSONL fine-tuning samples, "
                             "a prompt and a response each (loss on the response only) (default: %(default)s)")
    parser.add_argument("--prompt-key", default="prompt", help="sft: the key of each sample's prompt (default: %(default)s)")
    parser.add_argument("--response-key", default="response", help="sft: the key of each sample's response (default: %(default)s)")
    parser.add_argument("--seq-len", type=cli_checks.read_int,
                        default=2048, help="sft: the model's sequence length s; longer samples are cut to s + 1 "
                                           "tokens, a prompt of s tokens or more is refused (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status; every refusal, fault or interrupt is one line on stderr (`cli.report`)."""
    return report(_main, None if argv is None else list(argv))


def _inert_flags(args, argv: list[str]) -> None:
    """A flag given where it does nothing is refused (as the config's no-effect rule): the sft
    keys and --seq-len without --format sft, --bos-token without --add-bos, --json-key where no
    input is read as JSONL."""
    for flag in ("--prompt-key", "--response-key", "--seq-len"):
        if args.format != "sft" and given(argv, flag):
            raise ConfigError(flag, "applies to --format sft only: here it would have no effect")
    if given(argv, "--bos-token") and not args.add_bos:    # the data holds no BOS: the name would go unused
        raise ConfigError("--bos-token", "applies with --add-bos only: here it would have no effect")
    jsonl = args.format != "sft" and any(resolve_format(path, args.format) == "jsonl" for path in args.input)
    if given(argv, "--json-key") and not jsonl:
        raise ConfigError("--json-key", "no input is read as JSONL (--format jsonl, or auto with *.jsonl/*.json/"
                                        "*.ndjson; sft names its keys with --prompt-key/--response-key): it would have "
                                        "no effect")


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _inert_flags(args, argv)
    for suffix in (".bin", ".idx"):   # the command creates its output, never replaces it (a directory there:
        if os.path.lexists(args.output + suffix) and not os.path.isdir(args.output + suffix):  # check_output's)
            raise ConfigError("--output", f"{args.output}{suffix} already exists; choose another prefix")
    try:
        tokenizer = load_tokenizer(args.tokenizer, args.eod_token, args.bos_token, args.add_bos)
        check_inputs(args.input)
        check_output(args.output)
        output_parent("--output", args.output)   # exists, is a directory, is writable: shared with every CLI
        if args.format == "sft":
            if args.seq_len < 1:
                raise ConfigError("--seq-len", f"must be >= 1, got {args.seq_len}")
            stats = preprocess_sft(args.input, args.output, tokenizer, args.seq_len, args.prompt_key,
                                   args.response_key, args.add_bos,
                                   report=lambda line: print(f"warning: {line}", file=sys.stderr))
        else:
            stats = preprocess(args.input, args.output, tokenizer, args.json_key, args.format, args.add_bos)
    except TokenOptionError as e:   # reported against the flag given: the tokenizer's own, if not this one
        flag = f"--{e.option.replace('_', '-')}"
        raise ConfigError(flag if given(argv, flag) else "--tokenizer", str(e)) from None
    except ImportError as e:        # a tokenizer.json without the `tokenizers` package
        raise ConfigError("--tokenizer", one_line(e)) from None
    except Interrupted as e:
        print(f"error: interrupted by {signal.Signals(e.signum).name}; nothing was written", file=sys.stderr)
        return e.exit_status
    if args.format == "sft":
        print(f"wrote {args.output}.bin/.idx: {stats.documents} samples, {stats.tokens} tokens, "
              f"{stats.seconds:.2f} s")
    else:
        print(f"wrote {args.output}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens "
              f"({stats.skipped} empty documents skipped), {stats.seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
