"""Print a pipeline schedule's timeline and its cost model.

    python -m mtjax.pipeline show --schedule 1f1b --stages 4 --micro-batches 8
    python -m mtjax.pipeline show --schedule interleaved --stages 4 --micro-batches 8 --virtual-stages 2
    python -m mtjax.pipeline show --schedule gpipe --stages 4 --micro-batches 8 --recompute --json

Notation: p stages, m micro-batches, v model chunks per stage. Every figure is computed from
the table (`Schedule.cost_model`), in forward units: a chunk's forward costs 1, its backward 2,
or 3 with `--recompute` (the backward recomputes the forward). A tick lasts as long as its
slowest stage, so
  lockstep_time     = sum over ticks of max over stages of that stage's cost in the tick,
  stage_busy_time   = one stage's compute, v m (1 + backward cost),
  time_over_ideal   = lockstep_time / stage_busy_time, bubble_fraction = time_over_ideal - 1,
  max_in_flight     = per stage, the most stashes (forward run, backward not finished) held,
printed beside Megatron's time over ideal, 1 + (p - 1)/(v m), for comparison.
`--json` prints these as one JSON object and nothing else.

Bad arguments print one line `error: ...` on stderr and exit with status 2 (`mtjax.cli`).
"""
from __future__ import annotations

import json
import sys

from mtjax.cli import make_bare_parser, report
from mtjax.config.errors import ConfigError
from mtjax.pipeline.schedules import SCHEDULES, Schedule, make_schedule, render


# what make_schedule's refusals talk about, and the flag that sets it
FLAG_WORDS = {"virtual stages": "--virtual-stages", "micro-batches": "--micro-batches", "stages": "--stages"}


def _flag_of(message: str) -> str:
    """The flag a refusal of make_schedule is about: the first one its message names."""
    found = [(message.find(words), flag) for words, flag in FLAG_WORDS.items() if words in message]
    return min(found)[1] if found else "arguments"


def figures(s: Schedule, recompute: bool) -> dict:
    """`Schedule.cost_model` plus the lockstep time and busy time it divides, and Megatron's
    1 + (p - 1)/(v m) to compare time_over_ideal with."""
    cost = s.stage_cost(recompute)                 # [ticks, p] forward units
    megatron = 1 + (s.stages - 1) / (s.chunks * s.micro_batches)
    return {**s.cost_model(recompute), "recompute": recompute,
            "lockstep_time": int(cost.max(axis=1).sum()), "stage_busy_time": int(cost.sum(axis=0).max()),
            "megatron_time_over_ideal": megatron}


def _text(fig: dict) -> str:
    """`key: value` lines, max_in_flight as one number per stage."""
    return "\n".join(f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in fig.items())


def main(argv: list[str] | None = None) -> int:
    """The exit status; bad arguments are one line (`cli.report`)."""
    return report(_main, None if argv is None else list(argv))


def _main(argv: list[str]) -> int:
    parser = make_bare_parser("python -m mtjax.pipeline", "Pipeline schedules as tables.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print a schedule's timeline and cost model", allow_abbrev=False)
    show.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    show.add_argument("--stages", type=int, required=True, metavar="P")
    show.add_argument("--micro-batches", type=int, required=True, metavar="M")
    show.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                      help="model chunks per stage (interleaved only)")
    show.add_argument("--recompute", action="store_true",
                      help="the backward recomputes the forward (costs 3 forward units instead of 2)")
    show.add_argument("--json", action="store_true", help="print the figures as one JSON object only")
    args = parser.parse_args(argv)
    for flag, value, limit in (("--stages", args.stages, 1024), ("--micro-batches", args.micro_batches, 16384),
                               ("--virtual-stages", args.virtual_stages, 64)):
        if value > limit:      # the table has (v m + p) p cells: keep it printable and in memory
            parser.error(f"argument {flag}: at most {limit}, got {value}")
    try:
        schedule = make_schedule(args.schedule, args.stages, args.micro_batches, args.virtual_stages)
    except ValueError as e:
        raise ConfigError(_flag_of(str(e)), str(e)) from None
    fig = figures(schedule, args.recompute)
    print(json.dumps(fig) if args.json else f"{render(schedule)}\n\n{_text(fig)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
