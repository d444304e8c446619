"""`python -m mtjax.generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3)... [--max-new-tokens N]
[--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-at-eod] [--json] [--cpu-devices N]
[parallel.data=d] [parallel.pipe=p] [parallel.tensor=t] [group.field=value ...]`

Continue prompts from the newest complete checkpoint under DIR (a run directory, a directory of
steps or one step's directory) and print each continuation: its text, one line each, or with
--json one object {"prompt_ids", "ids", "text"} per line. --prompt (or --prompt-ids) given
several times is a batch of prompts. A text prompt is encoded with the checkpoint config's
data.tokenizer (`data.tokenizer=PATH` points elsewhere). Greedy unless --temperature > 0.
parallel.data=d splits the batch over d devices, parallel.pipe=p the layers over p pipeline
stages, parallel.tensor=t the heads over t devices (with --cpu-devices on a CPU); other
overrides apply to the saved config (e.g. train.precision=bf16). Without --max-new-tokens, 32
new tokens or the room the longest prompt leaves in model.seq_len; --top-k at or above the
vocabulary means no filter. Bad input is one line `error: ...` and exit status 2 (never naming
a flag not given); nothing is written.
"""
from __future__ import annotations

import json
import logging

from mtjax import cli, cli_checks
from mtjax.config.errors import ConfigError

DEFAULT_NEW_TOKENS = 32
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "seed": "--seed"}     # generate()'s parameters as the command line names them


def _parse(argv: list[str]):
    p = cli.make_bare_parser("python -m mtjax.generate", "Continue a prompt from an mtjax checkpoint.")
    p.add_argument("--checkpoint", required=True, type=cli_checks.path,
                   help="run directory, checkpoint directory or step directory")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", type=cli_checks.text, action="append",
                        help="text, encoded with the checkpoint's data.tokenizer (again: one more prompt)")
    prompt.add_argument("--prompt-ids", action="append", help="token ids, comma-separated (again: one more prompt)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"at most N new tokens (default: {DEFAULT_NEW_TOKENS}, or the room left in model.seq_len)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="softmax temperature of the sampling; 0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample from the K most likely tokens (K >= the vocabulary: no filter; default: none, no filter)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus: the most likely tokens up to P (default: none, no filter)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling key (the same seed, the same text) (default: %(default)s)")
    p.add_argument("--stop-at-eod", action="store_true", help="end after the tokenizer's end-of-document token")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, ids, text")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="simulate N CPU devices")
    p.add_argument("overrides", nargs="*", metavar="group.field=value",
                   help="parallel.data/pipe/tensor, or overrides of the saved config")
    return p.parse_args(argv)


def prompt_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] (ranges are checked against the vocabulary by generate)."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError("--prompt-ids", f"must be comma-separated integers, got {text!r}") from None
    return ids


def main(argv: list[str]) -> int:
    args = _parse(argv)
    ids = [prompt_ids(text) for text in args.prompt_ids] if args.prompt_ids is not None else None
    if args.prompt is not None and not all(args.prompt):
        raise ConfigError("--prompt", "is empty")
    cli.start_devices(args.cpu_devices)
    logging.getLogger("absl").setLevel(logging.CRITICAL)   # orbax's notes on a read-only directory
    from mtjax.data.errors import DataError
    from mtjax.inference import load
    model = load(args.checkpoint, None, args.overrides)
    try:
        tokenizer = model.tokenizer
    except (ImportError, DataError) as e:   # missing, unreadable, or a tokenizer.json without `tokenizers`
        raise ConfigError("data.tokenizer", f"{e} (data.tokenizer=PATH names another)") from None
    if ids is None:
        ids = [tokenizer.encode(text) for text in args.prompt]
        if not all(ids):
            raise ConfigError("--prompt", f"encodes to no tokens with {model.cfg.data.tokenizer!r}")
    prompt_flag = "--prompt-ids" if args.prompt is None else "--prompt"
    max_new, longest = args.max_new_tokens, max(map(len, ids))
    if max_new is None:                   # the default fits the room the prompt leaves (flag not given)
        if longest >= model.seq_len:
            raise ConfigError(prompt_flag, f"a prompt of {longest} tokens leaves no room for new ones in "
                                           f"model.seq_len {model.seq_len}")
        max_new = min(DEFAULT_NEW_TOKENS, model.seq_len - longest)
    try:
        new = model.generate(ids, max_new, args.temperature, args.top_k, args.top_p, args.seed, args.stop_at_eod)
    except ConfigError as e:
        raise ConfigError(FLAGS.get(e.key, prompt_flag if e.key == "prompt_ids" else e.key), e.problem) from None
    for prompt, continuation in zip(ids, new):
        # ids the model has beyond the tokenizer's (model.vocab_size larger) have no text
        text = tokenizer.decode([i for i in continuation if i < tokenizer.vocab_size])
        if args.json:
            print(json.dumps({"prompt_ids": prompt, "ids": continuation, "text": text}, ensure_ascii=False))
        else:
            print(text)
    return 0


if __name__ == "__main__":
    cli.run(main)
