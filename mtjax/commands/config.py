"""`python -m mtjax.config [GROUP | GROUP.FIELD ...] [--search WORD] [--markdown]`: every config
group and field with its default and one-line meaning, from the schema (`mtjax/config/reference.py`);
`--search` keeps the fields whose name or meaning holds a word; `--markdown` prints docs/config.md
(with names, only what they name). A group named twice is listed once; a
name that is no group or field is one line `error: ...` (with a suggestion), exit status 2."""
from __future__ import annotations

from mtjax import cli
from mtjax.config import reference


def main(argv: list[str]) -> int:
    p = cli.make_bare_parser("python -m mtjax.config",
                             "List every config group and field with its default and meaning.")
    p.add_argument("--markdown", action="store_true",
                   help="print the reference as docs/config.md (with GROUPs: theirs only)")
    p.add_argument("--search", metavar="WORD", default=None,
                   help="only the fields whose name or meaning holds WORD, any case (--search dropout, "
                        "--search 'loss scale')")
    p.add_argument("groups", nargs="*", metavar="GROUP[.FIELD]",
                   help="only these groups (model, parallel, ...) or fields (model.num_layers)")
    args = p.parse_args(argv)
    show = reference.markdown if args.markdown else reference.listing
    print(show(args.groups, args.search), end="")
    return 0


if __name__ == "__main__":
    cli.run(main)
