"""Print a pipeline schedule's timeline.

    python -m mtjax.pipeline show --schedule 1f1b --stages 4 --micro-batches 8
    python -m mtjax.pipeline show --schedule interleaved --stages 4 --micro-batches 8 --virtual-stages 2

Bad arguments print one line `error: ...` on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import sys

from mtjax.pipeline.schedules import SCHEDULES, make_schedule, render

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m mtjax.pipeline", description="Pipeline schedules as tables.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print a schedule's timeline, one line per stage")
    show.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    show.add_argument("--stages", type=int, required=True, metavar="P")
    show.add_argument("--micro-batches", type=int, required=True, metavar="M")
    show.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                      help="model chunks per stage (interleaved only)")
    args = parser.parse_args(argv)
    try:
        schedule = make_schedule(args.schedule, args.stages, args.micro_batches, args.virtual_stages)
    except ValueError as e:
        parser.error(str(e))
    print(render(schedule))
    return 0


if __name__ == "__main__":
    sys.exit(main())
