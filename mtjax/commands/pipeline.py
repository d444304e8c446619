"""Print a pipeline schedule's timeline and its cost model.

    python -m mtjax.pipeline show --schedule 1f1b --stages 4 --micro-batches 8
    python -m mtjax.pipeline show --schedule interleaved --stages 4 --micro-batches 8 --virtual-stages 2
    python -m mtjax.pipeline show --schedule gpipe --stages 4 --micro-batches 8 --recompute --json
    python -m mtjax.pipeline show --schedule zb --stages 4 --micro-batches 8 --costs 1,1,0.5 --max-in-flight 4
    python -m mtjax.pipeline show --schedule zbv --stages 4 --micro-batches 8 --plot zbv.png

Notation: p stages, m micro-batches, v model chunks per stage. Every figure is computed from
the table (`Schedule.cost_model`), in forward units: `--costs F,B,W` per chunk (default 1,1,1
for the split schedules zb and zbv, whose backward is B then W; 1,2 for the others, whose
backward costs B + W, 2 by default, or + F with `--recompute`: it recomputes the forward).
A tick lasts as long as its slowest stage, so
  lockstep_time     = sum over ticks of max over stages of that stage's cost in the tick,
  stage_busy_time   = one stage's compute, v m (F + B + W),
  time_over_ideal   = lockstep_time / stage_busy_time, bubble_fraction = time_over_ideal - 1,
  max_in_flight     = per stage, the most stashes (forward run, B not finished) held, (mb, chunk)
                      pairs: a chunk's stash is 1/v of the stage's; `--max-in-flight N` builds the
                      table under the cap N v on slots_held (0: the schedule's own),
  w_pending         = per stage, the most pairs whose B has run and W has not (split schedules),
  slots_held        = per stage, the most pairs whose F has run and whose backward has not
                      finished (B, or W when split: W's pairs wait in B's slot),
printed beside Megatron's time over ideal, 1 + (p - 1)/(v m), and for zb/zbv beside ZB-H1's
lower bound (m(F + B + W) + (p - 1)(F + B - W)) / (m(F + B + W)).
`--json` prints these as one JSON object and nothing else. `--plot FILE.png` also draws the
table's timeline into FILE (`mtjax.plots`; needs matplotlib: `pip install 'mtjax[notebooks]'`).
The executor runs every schedule here (`parallel.schedule`, `parallel.max_in_flight`), its table
built at the default costs.

Bad arguments print one line `error: ...` on stderr and exit with status 2 (`mtjax.cli`).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from fractions import Fraction

from mtjax import cli_checks
from mtjax.cli import make_bare_parser, report
from mtjax.config.errors import ConfigError, RunFault
from mtjax.pipeline.schedules import SCHEDULES, SPLIT_SCHEDULES, make_schedule, render
from mtjax.pipeline.table import Schedule, default_costs, parse_costs
from mtjax.pipeline.zero_bubble import zb_lower_bound

LIMITS = {"--stages": 1024, "--micro-batches": 16384, "--virtual-stages": 64}
PLOT_FORMATS = (".png", ".svg", ".pdf")
SPLIT_LIMITS = {"--stages": 64, "--micro-batches": 512, "--virtual-stages": 8}   # zb, zbv or a cap: seconds
CELLS, SPLIT_CELLS = 2 ** 18, 2 ** 17      # the table's estimated ticks x stages (`estimated_cells`)


def estimated_cells(name: str, p: int, m: int, v: int, cap: int) -> int:
    """About the table's ticks x p, before building it (each cell is a simulated step; a larger
    table takes minutes). With c chunks a stage (2 for zbv): about c m + 6p ticks uncapped, 2c m + 6p
    for GPipe (all forwards, then all backwards) and zb (its one-operation-a-tick table is built
    too); under a cap N a stage starts N micro-batches per round trip of 2 c p - 1 ticks, so about
    m (2 c p - 1) / N + 2 c p (1F1B at N = 1: m (2p - 1))."""
    c = 2 if name == "zbv" else v
    ticks = c * m * (2 if name in ("gpipe", "zb") else 1) + 6 * p
    if cap:
        ticks = max(ticks, -(-m * (2 * c * p - 1) // cap) + 2 * c * p)
    return ticks * p


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def figures(s: Schedule, recompute: bool, costs=None) -> dict:
    """`Schedule.cost_model` plus the lockstep time and busy time it divides, Megatron's
    1 + (p - 1)/(v m) (and ZB-H1's bound for split schedules) to compare time_over_ideal with,
    the costs, the cap, the W-pending pairs and the slots held."""
    costs = parse_costs(costs) if costs is not None else default_costs(s.split)
    ratio = s.time_over_ideal(recompute, costs)
    busy = s.chunks * s.micro_batches * sum(costs)
    if recompute:
        busy += s.chunks * s.micro_batches * costs[0]
    fig = {**s.cost_model(recompute, costs), "recompute": recompute, "costs": [_number(c) for c in costs],
           "lockstep_time": _number(ratio * busy), "stage_busy_time": _number(busy),
           "megatron_time_over_ideal": 1 + (s.stages - 1) / (s.chunks * s.micro_batches),
           "max_in_flight_cap": s.max_in_flight_cap, "w_pending": [int(n) for n in s.w_pending()],
           "slots_held": [int(n) for n in s.slots_held()]}
    if s.split and not recompute:
        fig["zb_lower_bound"] = float(zb_lower_bound(s.stages, s.micro_batches, costs))
    return fig


def _text(fig: dict) -> str:
    """`key: value` lines, max_in_flight as one number per stage."""
    return "\n".join(f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in fig.items())


def main(argv: list[str] | None = None) -> int:
    """The exit status; bad arguments are one line (`cli.report`)."""
    return report(_main, None if argv is None else list(argv))


def _flag_of(message: str) -> str:
    """The flag a table builder's refusal is about, from the words it starts with."""
    for words, flag in (("micro-batches", "--micro-batches"), ("interleaving", "--micro-batches"),
                        ("virtual stages", "--virtual-stages"), ("stages", "--stages"),
                        ("max_in_flight", "--max-in-flight")):
        if message.startswith(words):
            return flag
    return "--schedule"


def _plot(schedule: Schedule, path: str, costs=None, recompute: bool = False) -> None:
    """The timeline into `path`; a missing matplotlib, a format it lacks or a place it cannot write
    is one line naming --plot (checked before drawing, so a refusal writes nothing)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PLOT_FORMATS:
        raise ConfigError("--plot", f"{path}: give a file ending in {', '.join(PLOT_FORMATS)}")
    if os.path.isdir(path):
        raise ConfigError("--plot", f"{path} is a directory; name an image file")
    cli_checks.output_parent("--plot", path)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError("--plot", f"{path}: file is not writable")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot", "needs matplotlib: pip install 'mtjax[notebooks]'") from None
    from mtjax.plots import save_timeline
    # drawn into a file beside it, renamed onto it when whole: a full disk leaves no half image
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            save_timeline(schedule, f, costs, recompute, fmt=suffix[1:])   # at the printed figures' costs
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RunFault(f"--plot: cannot write {path}: {e.strerror or e}; nothing was written") from None


def _costs(text: str) -> tuple:
    """`F,B` or `F,B,W` -> exact costs (`parse_costs`); a bad value is one line naming --costs."""
    try:
        return parse_costs(text.split(","))
    except ValueError as e:
        raise ConfigError("--costs", str(e)) from None


def _joined_costs(argv: list[str]) -> list[str]:
    """`--costs -1,2` as `--costs=-1,2`: argparse reads a value that starts with '-' and is not a
    plain negative number as a flag, and would say only that --costs expected one argument."""
    out, k = [], 0
    while k < len(argv):
        value = argv[k + 1] if argv[k] == "--costs" and k + 1 < len(argv) else ""
        joined = value[:1] == "-" and value[1:2] != "" and value[1:2] in "0123456789."
        out.append(f"--costs={value}" if joined else argv[k])
        k += 2 if joined else 1
    return out


def _main(argv: list[str]) -> int:
    parser = make_bare_parser("python -m mtjax.pipeline", "Pipeline schedules as tables.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{show}")   # the error names it
    show = commands.add_parser("show", help="print a schedule's timeline and cost model", allow_abbrev=False)
    show.add_argument("--schedule", choices=SCHEDULES + SPLIT_SCHEDULES, default="1f1b",
                      help="the table to build, as parallel.schedule names it (default: %(default)s)")
    show.add_argument("--stages", type=int, required=True, metavar="P", help="pipeline stages p (parallel.pipe)")
    show.add_argument("--micro-batches", type=int, required=True, metavar="M",
                      help="micro-batches m per step (train.micro_batches)")
    show.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                      help="model chunks per stage (interleaved only; zbv always has 2) (default: %(default)s)")
    show.add_argument("--recompute", action="store_true",
                      help="the backward recomputes the forward (costs F more)")
    show.add_argument("--costs", metavar="F,B[,W]", help="per-chunk costs: default 1,1,1 for zb and zbv, "
                      "1,2 for the others (their backward costs B + W)")
    show.add_argument("--max-in-flight", type=int, default=0, metavar="N",
                      help="build the table holding at most N micro-batches' stashes per stage (default: %(default)s, "
                           "the schedule's own)")
    show.add_argument("--json", action="store_true", help="print the figures as one JSON object only")
    show.add_argument("--plot", type=cli_checks.path, metavar="FILE.png",
                      help="draw the timeline into this image file too (.png, .svg or .pdf; needs matplotlib)")
    args = parser.parse_args(_joined_costs(argv))
    split = args.schedule in SPLIT_SCHEDULES
    if args.max_in_flight < 0:
        parser.error(f"argument --max-in-flight: must be >= 0 (0: the schedule's own), got {args.max_in_flight}")
    costs = _costs(args.costs) if args.costs is not None else None
    if split and costs is not None and len(args.costs.split(",")) != 3:
        parser.error(f"argument --costs: {args.schedule} splits the backward: give F,B,W, got {args.costs}")
    if args.schedule == "interleaved" and args.virtual_stages == 1:    # as parallel.virtual_stages is refused
        parser.error("argument --virtual-stages: interleaved needs at least 2 chunks a stage (at 1 it is 1f1b's "
                     "table: --schedule 1f1b)")
    values = {"--stages": args.stages, "--micro-batches": args.micro_batches, "--virtual-stages": args.virtual_stages}
    for flag, limit in (SPLIT_LIMITS if split or args.max_in_flight else LIMITS).items():
        if values[flag] > limit:      # keep the table printable; its cells are bounded below
            parser.error(f"argument {flag}: at most {limit}{' here' if limit < LIMITS[flag] else ''}, "
                         f"got {values[flag]}")
    cells, limit = estimated_cells(args.schedule, args.stages, args.micro_batches, args.virtual_stages,
                                   args.max_in_flight), SPLIT_CELLS if split or args.max_in_flight else CELLS
    if cells > limit:
        parser.error(f"argument --micro-batches: a table of about {cells} ticks x stages, at most {limit} here "
                     f"(--stages {args.stages}, --micro-batches {args.micro_batches}"
                     + (f", --max-in-flight {args.max_in_flight}" if args.max_in_flight else "")
                     + "): give fewer micro-batches or stages" + (" or a larger cap" if args.max_in_flight else ""))
    try:
        schedule = make_schedule(args.schedule, args.stages, args.micro_batches, args.virtual_stages,
                                 args.max_in_flight, costs)
    except ValueError as e:
        raise ConfigError(_flag_of(str(e)), str(e)) from None
    if args.plot is not None:
        _plot(schedule, args.plot, costs, args.recompute)
    fig = figures(schedule, args.recompute, costs)
    print(json.dumps(fig) if args.json else f"{render(schedule, costs)}\n\n{_text(fig)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
