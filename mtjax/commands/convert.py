"""`python -m mtjax.convert from-hf --hf-dir DIR --out OUT [--seq-len N]`
`python -m mtjax.convert to-hf --checkpoint DIR --out HF_DIR [--family mistral]`

from-hf: a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE directory (config.json,
safetensors weights) into OUT/checkpoints/0, an mtjax checkpoint that `python -m mtjax.train --config OUT/config.yaml`
resumes from, and its tokenizer files into OUT/tokenizer/ (the config's data.tokenizer). to-hf: the
newest complete checkpoint under DIR (a run directory, a checkpoint directory or one step's
directory) into HF_DIR/config.json (with the tokenizer's BOS and EOS ids), HF_DIR/model.safetensors
and the run's tokenizer files; --family mistral writes a plain llama as MistralForCausalLM (the
default: the family a conversion not trained since came from, else the one the model implies).
Bad input is one line `error: ...` and exit status 2, with nothing written; a fault (a full disk,
a read-only file system, an I/O error) one line and status 1, with nothing written either.
`python -m mtjax.convert from-hf --help` (or to-hf) lists each flag with its meaning.
"""
from __future__ import annotations

import logging
import sys

from mtjax import cli, cli_checks
from mtjax.config.errors import ConfigError

COMMANDS = ("from-hf", "to-hf")


def _parse(argv: list[str]):
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command not in COMMANDS:
        raise ConfigError("arguments", f"the command must be {' or '.join(COMMANDS)}, got {command!r}")
    summary = __doc__.splitlines()[0 if command == "from-hf" else 1]
    p = cli.make_bare_parser(f"python -m mtjax.convert {command}", summary)
    if command == "from-hf":
        p.add_argument("--hf-dir", required=True, type=cli_checks.path,
                       help="Hugging Face model directory: config.json, *.safetensors")
        p.add_argument("--seq-len", type=int, default=None,
                       help="model.seq_len of a rotary model (default: max_position_embeddings)")
    else:
        p.add_argument("--checkpoint", required=True, type=cli_checks.path,
                       help="run directory, checkpoint directory or step directory")
        p.add_argument("--family", default="",
                       help="the transformers family to write: mistral for a plain llama (default: the "
                            "converted model's own, else the one the model implies)")
    p.add_argument("--out", required=True, type=cli_checks.path,
                   help="the directory to create (or an empty one to fill)")
    return command, p.parse_args(rest)


def main(argv: list[str]) -> int:
    command, args = _parse(argv)
    logging.getLogger("absl").setLevel(logging.CRITICAL)   # orbax's progress lines
    from mtjax.commands.convert_hf import CONFIG_YAML, from_hf, to_hf
    if command == "from-hf":
        cfg = from_hf(args.hf_dir, args.out, args.seq_len)
        from mtjax.convert.tokenizer_files import train_hint
        copied = "" if cfg.data.tokenizer == "byte" else f", the tokenizer ({cfg.data.tokenizer})"
        print(f"wrote {args.out}: an mtjax checkpoint (step 0, arch {cfg.model.arch}){copied} and {CONFIG_YAML}; train "
              f"with python -m mtjax.train --config {args.out}/{CONFIG_YAML} data.path=PREFIX{train_hint(cfg.data)}")
    else:
        config = to_hf(args.checkpoint, args.out, args.family)
        print(f"wrote {args.out}: config.json ({config['architectures'][0]}) and model.safetensors")
    return 0


if __name__ == "__main__":
    cli.run(main)
