"""`python -m mtjax.generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
[--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-at-eod] [--json] [--cpu-devices N]
[parallel.tensor=t] [group.field=value ...]`

Continue a prompt from the newest complete checkpoint under DIR (a run directory, a directory of
steps or one step's directory) and print the continuation: its text, or with --json one object
{"prompt_ids", "ids", "text"}. A text prompt is encoded with the checkpoint config's
data.tokenizer (`data.tokenizer=PATH` points elsewhere). Greedy unless --temperature > 0.
parallel.tensor=t splits the heads over t devices (with --cpu-devices on a CPU); other overrides
apply to the saved config (e.g. train.precision=bf16). Without --max-new-tokens, 32 new tokens or
the room the prompt leaves in model.seq_len; --top-k at or above the vocabulary means no filter.
Bad input is one line `error: ...` and exit status 2 (never naming a flag not given); nothing is
written.
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
    prompt.add_argument("--prompt", type=cli_checks.text, help="text, encoded with the checkpoint's data.tokenizer")
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"at most N new tokens (default: {DEFAULT_NEW_TOKENS}, or the room left in model.seq_len)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample from the K most likely tokens (K >= the vocabulary: no filter)")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus: the most likely tokens up to P")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling key (the same seed, the same text)")
    p.add_argument("--stop-at-eod", action="store_true", help="end after the tokenizer's end-of-document token")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, ids, text")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="simulate N CPU devices")
    p.add_argument("overrides", nargs="*", metavar="group.field=value",
                   help="parallel.tensor=t, or overrides of the saved config")
    return p.parse_args(argv)


def prompt_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] (ranges are checked against the vocabulary by generate)."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError("--prompt-ids", f"must be comma-separated integers, got {text!r}") from None
    return ids


def tensor_size(overrides: list[str]) -> tuple[int, list[str]]:
    """(t from parallel.tensor=t, default 1; the other overrides)."""
    from mtjax.config.load import parse_override
    tensor, rest = 1, []
    for text in overrides:
        group, name, value = parse_override(text)
        if group != "parallel":
            rest.append(text)
        elif name in ("tensor_grid", "tensor_depth") and value not in ("1d", 1):
            raise ConfigError(f"parallel.{name}", "generation runs on the 1d tensor layout: decoding with a KV cache "
                                                  "is not implemented on a 2d/2.5d grid (a grid's checkpoint "
                                                  "generates on 1d)")
        elif name != "tensor":
            raise ConfigError(f"parallel.{name}", "generation runs on data=1, pipe=1: only parallel.tensor can be set")
        elif not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= cli.MAX_CPU_DEVICES:
            raise ConfigError("parallel.tensor", f"must be an integer >= 1, got {value!r}")
        else:
            tensor = value
    return tensor, rest


def main(argv: list[str]) -> int:
    args = _parse(argv)
    tensor, overrides = tensor_size(args.overrides)
    ids = prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.prompt is not None and not args.prompt:
        raise ConfigError("--prompt", "is empty")
    cli.start_devices(args.cpu_devices)
    logging.getLogger("absl").setLevel(logging.CRITICAL)   # orbax's notes on a read-only directory
    import jax

    from mtjax.data.errors import DataError
    from mtjax.inference import load
    from mtjax.mesh import make_mesh
    if jax.device_count() < tensor:
        raise ConfigError("parallel.tensor", f"{tensor} needs {tensor} devices, this machine has "
                                             f"{jax.device_count()} (--cpu-devices {tensor} simulates them)")
    model = load(args.checkpoint, make_mesh(1, 1, tensor, jax.devices()[:tensor]), overrides)
    try:
        tokenizer = model.tokenizer
    except (ImportError, DataError) as e:   # missing, unreadable, or a tokenizer.json without `tokenizers`
        raise ConfigError("data.tokenizer", f"{e} (data.tokenizer=PATH names another)") from None
    if ids is None:
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise ConfigError("--prompt", f"encodes to no tokens with {model.cfg.data.tokenizer!r}")
    prompt_flag = "--prompt-ids" if args.prompt is None else "--prompt"
    max_new = args.max_new_tokens
    if max_new is None:                   # the default fits the room the prompt leaves (flag not given)
        if len(ids) >= model.seq_len:
            raise ConfigError(prompt_flag, f"a prompt of {len(ids)} tokens leaves no room for new ones in "
                                           f"model.seq_len {model.seq_len}")
        max_new = min(DEFAULT_NEW_TOKENS, model.seq_len - len(ids))
    try:
        new = model.generate(ids, max_new, args.temperature, args.top_k, args.top_p, args.seed, args.stop_at_eod)
    except ConfigError as e:
        raise ConfigError(FLAGS.get(e.key, prompt_flag if e.key == "prompt_ids" else e.key), e.problem) from None
    # ids the model has beyond the tokenizer's (model.vocab_size larger) have no text
    text = tokenizer.decode([i for i in new if i < tokenizer.vocab_size])
    if args.json:
        print(json.dumps({"prompt_ids": ids, "ids": new, "text": text}, ensure_ascii=False))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    cli.run(main)
