"""Where metrics go, and the lines a run prints: a progress bar (interactive runs) or one line
per logged step, `metrics.jsonl` and TensorBoard events; the start-up line and the summary.

Only process 0 writes. One JSON object per logged step (`step`, `loss`, ...), and one of `step` and
the validation losses for a validation pass at a step not logged; the file and TensorBoard get every
field (non-finite values as strings in the file, floats in TensorBoard), the printed line and the bar
only those that apply to the run (`not_applicable`: no loss scale without fp16, no skipped steps
where no step can be skipped, no MoE loss whose coefficient is 0) and have a value (`format_row`: no
MFU without a known peak).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys


BAR_FIELDS = ("loss", "lr", "tokens_per_s", "val_loss")


class MetricsWriter:
    def __init__(self, run_dir: str, total_steps: int, progress: bool, enabled: bool = True,
                 resume_step: int | None = None, hidden: frozenset = frozenset()):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.hidden = hidden          # left out of the printed line and the bar (not of the file)
        self.total_steps = total_steps   # T of the printed `step N/T` (not in the file)
        self._bar = None
        self._tb = None
        self._postfix = {}            # the bar's fields, the last val_loss kept between validations
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # A fresh run starts a new file. A resumed one keeps the rows up to its checkpoint's
        # step (later ones belong to steps it is about to redo) and appends.
        if resume_step is not None:
            keep_rows_up_to(self.path, resume_step)
        self._file = open(self.path, "a" if resume_step is not None else "w", encoding="utf-8")
        self._tb_dir = os.path.join(run_dir, "tb")
        try:
            from mtjax.training.tensorboard import ScalarEvents
            # TensorBoard hides earlier files' events from this step on, as metrics.jsonl drops
            # their rows: those steps are redone (or, in a fresh run, belong to another run)
            first_step = 1 if resume_step is None else resume_step + 1
            with _naming(self._tb_dir):
                self._tb = ScalarEvents(self._tb_dir, purge_step=first_step)
        except ImportError:
            self._tb = None
        if progress and sys.stderr.isatty():
            from tqdm import tqdm
            # a resumed run's bar starts at its checkpoint's step, so it ends full at total_steps
            self._bar = tqdm(total=total_steps, initial=resume_step or 0, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        values = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with _naming(self.path):
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            with _naming(self._tb_dir):
                # the values, not the row: a non-finite one (an fp16 overflow's grad_norm, a loss
                # that went nan) is a string in the JSON row, and a float in TensorBoard
                for k, v in values.items():
                    if isinstance(v, (int, float)):
                        self._tb.add_scalar(k, v, step)
                self._tb.flush()
        if self._bar is not None:
            self._postfix.update({k: number(v)   # a non-finite loss: 'nan'
                                  for k, v in row.items() if k in BAR_FIELDS and v is not None})
            self._bar.set_postfix(self._postfix)
        else:
            say(format_row(row, self.hidden, self.total_steps), flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        tb, self._tb = self._tb, None
        with _naming(self.path):
            self._file.close()
        if tb is not None:
            with _naming(self._tb_dir):
                tb.close()


@contextlib.contextmanager
def _naming(path: str):
    """An OSError inside (a full disk, an I/O error) re-raised as one that names `path`: the
    error line says which file could not be written."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), path) from None


def say(*args, file=None, **kwargs) -> None:
    """print, but a reader gone from the stream (`python -m mtjax.train ... | head`) does not end
    the run: the stream goes to /dev/null from then on, and the run trains and saves as it would
    (metrics.jsonl keeps every row)."""
    try:
        print(*args, file=file, **kwargs)
    except BrokenPipeError:
        stream = sys.stdout if file is None else file
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


def drop_rows_after(run_dir: str, step: int) -> None:
    """What a resume at `step` does to the rows of later steps (a crashed run's) when it has no step
    left to train: dropped from metrics.jsonl and, when there were any, hidden in TensorBoard (a
    new file's purge marker, as a resumed `MetricsWriter` writes)."""
    if keep_rows_up_to(os.path.join(run_dir, "metrics.jsonl"), step):
        MetricsWriter(run_dir, step, progress=False, resume_step=step).close()


def keep_rows_up_to(path: str, step: int) -> int:
    """Rewrite `path` (atomically) without the rows logged after `step`; how many it dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8", errors="replace") as f:   # a damaged line is dropped below, not fatal
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue   # a line cut by a crash
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _plain(v):
    v = v.item() if hasattr(v, "item") else v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def format_row(row: dict, hidden=frozenset(), total: int | None = None) -> str:
    """`step 20/100 | loss 3.603 | ...`: the step out of `total` (the run's train.steps, as
    Megatron prints `iteration N/T`; None: the step alone), floats to 4 significant digits; the
    fields in `hidden`, and those without a value (None: MFU without a known peak), left out."""
    parts = []
    for k, v in row.items():
        if k == "step" and total is not None:
            parts.append(f"step {v}/{total}")
            continue
        # per-layer MoE loads: file and TensorBoard only
        if k in hidden or v is None or "/" in k and k.startswith("moe_"):
            continue
        parts.append(f"{k} {number(v)}")
    return " | ".join(parts)


def number(v) -> str:
    """A value as the line prints it: a float to 4 significant digits, but in whole units from
    10^4 to 10^16 (tokens_per_s 17940, loss_scale 4294967296, not 1.794e+04); anything else as is."""
    if not isinstance(v, float):
        return str(v)
    return f"{v:.0f}" if 1e4 <= abs(v) < 1e16 else f"{v:.4g}"


def not_applicable(precision: str, on_nonfinite: str, aux_loss_coeff: float = 0.0,
                   z_loss_coeff: float = 0.0) -> frozenset:
    """Fields of a row that say nothing about this run: the loss scale without fp16, the skipped
    steps unless fp16 (an overflow) or train.on_nonfinite=skip can skip a step, and a mixture of
    experts' auxiliary loss whose coefficient is 0 (it joins the objective times its coefficient,
    so it reads 0 whatever the routing; `moe_stats.metrics`)."""
    hidden = set() if precision == "fp16" else {"loss_scale"}
    if precision != "fp16" and on_nonfinite != "skip":
        hidden.add("skipped_steps")
    hidden |= {name for name, coeff in (("moe_aux_loss", aux_loss_coeff), ("moe_z_loss", z_loss_coeff)) if not coeff}
    return frozenset(hidden)


def devices_text(n: int, platform: str, target: str | None = None) -> str:
    """The devices a step runs on, for `layout`: '1 cpu device', '8 cpu devices', or with
    `mtjax.inspect --target`: '8 h100 GPUs (compile-only)'."""
    if target is not None:
        return f"{n} {target} GPU{'s' if n != 1 else ''} (compile-only)"
    return f"{n} {platform} device{'s' if n != 1 else ''}"


def layout(plan, cfg, devices: str) -> list[str]:
    """A step's layout as the start-up line and `mtjax.inspect` print it (`plan`: the trainer's
    StepPlan; `devices`: '8 cpu devices'): the mesh (and the tensor grid unless Megatron's 1D),
    sequence parallelism, the pipeline schedule with v and its cap, b x m x d = B sequences of s
    tokens, precision, ZeRO-1 (or ZeRO-3 with fsdp), recomputation and the attention kernel; the
    tensor-parallel overlaps where asked for."""
    mesh = f"mesh (data, pipe, tensor) = ({plan.data}, {plan.pipe}, {plan.tensor}) on {devices}"
    if plan.context > 1:
        mesh = (f"mesh (data, pipe, context, tensor) = ({plan.data}, {plan.pipe}, {plan.context}, {plan.tensor}) "
                f"on {devices}, context attention {plan.layout.context_attention}")
    grid = "" if plan.grid is None else (f", {cfg.parallel.tensor_grid} tensor grid "
                                         f"(q {plan.grid.q}, depth {plan.grid.depth})")
    schedule = "schedule none (pipe 1)"
    if plan.schedule is not None:
        cap = cfg.parallel.max_in_flight
        schedule = f"schedule {plan.schedule.name} (v {plan.virtual_stages}, {f'cap {cap}' if cap else 'no cap'})"
    recompute = plan.recompute.mode + (f" {plan.recompute.layers} layers" if plan.recompute.mode == "block" else "")
    m = cfg.model
    experts = [f"experts {m.num_experts} (top {m.moe_top_k}, expert parallel {cfg.parallel.expert})"] if m.moe else []
    lay = plan.layout
    overlap = [] if lay is None else (["tensor overlap on"] if lay.tensor_overlap else []) + (
        [f"half-batch overlap over the {lay.half_batch_axis} (half_batch_group {lay.half_batch_group})"]
        if lay.half_batches else [])
    return [mesh + grid, *experts, f"sequence parallel {'on' if plan.sequence_parallel else 'off'}", *overlap, schedule,
            f"batch b x m x d = {plan.micro_batch} x {plan.micro_batches} x {plan.data} = {plan.global_batch} "
            f"sequences of {plan.seq_len} tokens",
            f"precision {plan.precision}",
            "ZeRO-3 (fsdp) on" if plan.fsdp else f"ZeRO-1 {'on' if plan.distributed_optimizer else 'off'}",
            f"recompute {recompute}{', activations offloaded' if plan.recompute.offload else ''}",
            f"attention {plan.attention}"]


def startup_line(plan, cfg, devices: str, data: str, parameters: int | None = None,
                 memory: int | None = None) -> str:
    """The run's first line: its `layout`, the model and its `parameters` (and those a token
    uses, with a mixture of experts), the `memory` per device of the step by XLA's estimate
    (bytes), the last step, the vocabulary, the data and the run directory."""
    from mtjax.training.flops import inactive_parameters
    m = cfg.model
    heads = f"{m.num_heads} heads" + (f" ({m.kv_heads} kv)" if m.kv_heads != m.num_heads else "")
    model = f"model {m.arch}: {m.num_layers} layer{'s' if m.num_layers != 1 else ''}, hidden {m.hidden_size}, {heads}"
    if parameters is not None:
        active = parameters - inactive_parameters(m)
        model += f", {parameters:,} parameters" + (f" ({active:,} active)" if active != parameters else "")
    facts = [model] + ([] if memory is None else [f"memory per device {size(memory)} (XLA's estimate of the step)"])
    facts.append(f"training to step {cfg.train.steps}")
    return "; ".join([*layout(plan, cfg, devices), *facts, f"vocab {plan.vocab} (padded {plan.padded_vocab})",
                      f"data {data}", f"run dir {cfg.train.run_dir}"])


def size(n: float | None) -> str:
    """Bytes in binary units: '512 B', '1.50 MiB'."""
    if n is None:
        return "?"
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"


def summary_line(rows: list, first: int, last: int, tokens_per_step: int, seconds: float,
                 stopped_by: str | None, checkpoints: str | None) -> str:
    """The end of a run in one line: how it ended (done, or the signal that stopped it), where
    its checkpoint went, the steps (first+1..last) and tokens this process trained and in what
    time, and the last loss and val_loss logged."""
    head = f"stopped by {stopped_by} after step {last}" if stopped_by else f"done after step {last}"
    where = f"checkpoint saved in {checkpoints}" if checkpoints else "no checkpoint (checkpoint.enabled=false)"
    n = last - first
    losses = [f"{k} {_last(rows, k):.4g}" for k in ("loss", "val_loss") if isinstance(_last(rows, k), float)]
    return "; ".join([head, where, f"{n} step{'s' if n != 1 else ''} ({n * tokens_per_step:,} tokens) in "
                      f"{duration(seconds)}", *([", ".join(losses)] if losses else [])])


def _last(rows: list, key: str):
    return next((row[key] for row in reversed(rows) if key in row), None)


def duration(seconds: float) -> str:
    """'8.3 s', '12 min 5 s', '2 h 3 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60)} s"
    return f"{minutes // 60} h {minutes % 60} min"
