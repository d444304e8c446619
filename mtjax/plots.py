"""Pictures of a pipeline schedule, drawn from the same table the executor runs.

Notation: p stages, m micro-batches, v model chunks per stage. A schedule is a table
tick x stage -> (forward slot, backward slot[, weight slot]) (`mtjax.pipeline.table.Schedule`);
`draw_timeline` draws it as it is, one column per tick and one row per stage, each slot a box
coloured by its micro-batch: a forward pale, a backward (B, or B + W unsplit) solid, a weight
gradient (W, split schedules only) hatched.

matplotlib is an optional dependency (`pip install 'mtjax[notebooks]'`): it is imported inside
the functions here, never when `mtjax` is imported.
"""
from __future__ import annotations

from mtjax.pipeline.table import NONE, Schedule, default_costs, parse_costs

KINDS = ("forward", "backward", "weight")
STYLE = {"forward": {"alpha": 0.35, "hatch": None}, "backward": {"alpha": 1.0, "hatch": None},
         "weight": {"alpha": 0.55, "hatch": "////"}}


def _slots(s: Schedule, recompute: bool = False, costs=None) -> list[tuple[str, float, float]]:
    """(kind, left, width) of each slot inside a tick of width 1, in the order a tick runs them,
    in proportion to their costs (`default_costs`: unsplit F | B 1:2, split F | B | W in thirds;
    recomputing, the backward costs F more)."""
    if not s.has_backward:
        return [("forward", 0.0, 1.0)]
    f, b, w = parse_costs(costs) if costs is not None else default_costs(s.split)
    backward = b + (0 if s.split else w) + (f if recompute else 0)
    widths = [("forward", f), ("backward", backward)] + ([("weight", w)] if s.split else [])
    total, left, out = sum(x for _, x in widths), 0.0, []
    for kind, x in widths:
        out.append((kind, left, float(x / total)))
        left += float(x / total)
    return out


def _tables(s: Schedule, kind: str):
    return {"forward": (s.forward_mb, s.forward_chunk), "backward": (s.backward_mb, s.backward_chunk),
            "weight": (s.weight_mb, s.weight_chunk)}[kind]


def micro_batch_colours(m: int) -> list:
    """One colour per micro-batch: tab10 up to 10, tab20 up to 20, then a cycle of tab20."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if m <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(m)]


def draw_timeline(s: Schedule, ax=None, title: str | None = None, costs=None, recompute: bool = False):
    """Draw `s` on `ax` (a new figure if None): x the tick, y the stage (stage 0 on top). Each box
    is labelled with its micro-batch, and with v > 1 its local chunk (`3b`: micro-batch 3, chunk
    b, its second). Slot widths and the title's time over ideal are at `costs` (F,B[,W]; None:
    `default_costs`), with the forward recomputed in the backward if `recompute`, as
    `Schedule.time_over_ideal` counts them. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=timeline_size(s))
    colours = micro_batch_colours(s.micro_batches)
    font = 7 if s.micro_batches <= 10 and s.chunks == 1 else 6
    slots = _slots(s, recompute, costs)
    for kind, left, width in slots:
        mbs, chunks = _tables(s, kind)
        for tick in range(s.ticks):
            for stage in range(s.stages):
                mb = int(mbs[tick, stage])
                if mb == NONE:
                    continue
                style = STYLE[kind]
                ax.add_patch(Rectangle((tick + left, stage - 0.42), width, 0.84, facecolor=colours[mb],
                                       alpha=style["alpha"], hatch=style["hatch"], edgecolor="black", linewidth=0.4))
                label = f"{mb}" if s.chunks == 1 else f"{mb}{chr(ord('a') + int(chunks[tick, stage]))}"
                ax.text(tick + left + width / 2, stage, label, ha="center", va="center", fontsize=font)
    ax.set_xlim(0, s.ticks)
    ax.set_ylim(s.stages - 0.5, -0.5)
    ax.set_yticks(range(s.stages), [f"stage {i}" for i in range(s.stages)])
    step = max(1, s.ticks // 20)
    ax.set_xticks(range(0, s.ticks + 1, step))
    ax.set_xlabel("tick (one forward slot, then one backward slot" + (", then one W slot)" if s.split else ")"))
    ratio = float(s.time_over_ideal(recompute, costs))
    ax.set_title(title or f"{s.name}: p={s.stages}, m={s.micro_batches}, v={s.chunks}, {s.ticks} ticks, "
                          f"time over ideal {ratio:.3f}", fontsize=10)
    grey = (0.5, 0.5, 0.5)
    handles = [Patch(facecolor=grey, alpha=STYLE[k]["alpha"], hatch=STYLE[k]["hatch"], edgecolor="black",
                     label={"forward": "forward F", "backward": "backward B" if s.split else "backward B+W",
                            "weight": "weight gradient W"}[k])
               for k, _, _ in slots]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              title="box colour: micro-batch", title_fontsize=8, frameon=False)
    return ax


def timeline_size(s: Schedule) -> tuple[float, float]:
    """A figure size (inches) in which each tick is wide enough for its labels."""
    per_tick = 0.5 if s.split or s.chunks > 1 else 0.38
    return max(6.0, 1.8 + per_tick * s.ticks), 0.9 + 0.42 * s.stages


def save_timeline(s: Schedule, path, costs=None, recompute: bool = False, fmt: str | None = None) -> None:
    """Draw `s` into the image file `path` (its suffix picks the format: .png, .svg, .pdf; or a
    binary file object and `fmt`) at `costs` (`draw_timeline`). A bare Figure, not pyplot: no
    window, no display, and a notebook's own backend is left alone."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=timeline_size(s))
    draw_timeline(s, fig.add_subplot(), costs=costs, recompute=recompute)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=fmt)
