"""`python -m mtjax`: the list of mtjax's commands. Each is a module of its own, run as
`python -m mtjax.NAME`; this only points to them, so there stays one way to start each. It
imports nothing of mtjax (and no JAX), so it answers at once."""
import sys

COMMANDS = (   # (module, what it does)
    ("mtjax.train", "train a model: --config FILE [--cpu-devices N] [group.field=value ...]"),
    ("mtjax.inspect", "compile the train step without running it: memory, FLOPs, collectives (--target h100)"),
    ("mtjax.config", "every config field with its default and meaning (GROUP, GROUP.FIELD, --search WORD)"),
    ("mtjax.data.preprocess", "tokenize text or JSONL into PREFIX.bin/.idx for data.path"),
    ("mtjax.convert", "Hugging Face models in (from-hf) and out (to-hf)"),
    ("mtjax.generate", "continue a prompt from a checkpoint"),
    ("mtjax.pipeline", "a pipeline schedule's timeline and cost model (show)"),
)


def main(argv: list[str]) -> int:
    """0 and the list for no argument or --help; a word that is no flag is one line, status 2."""
    if argv and argv[0] not in ("-h", "--help"):
        named = [module for module, _ in COMMANDS if module.rsplit(".", 1)[1] == argv[0]]
        hint = (f"run it as python -m {named[0]} ..." if named
                else "not a command; python -m mtjax lists them")
        print(f"error: {argv[0]}: {hint}", file=sys.stderr)
        return 2
    width = max(len(module) for module, _ in COMMANDS)
    print("mtjax's commands, each run as python -m MODULE (MODULE --help: its flags):")
    for module, what in COMMANDS:
        print(f"  {module:<{width}}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
