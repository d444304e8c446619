"""A training run, as `python -m mtjax.train` makes it and as `mtjax.train(...)` makes it from Python.

Validate the config once; lock the run's directories (one run per directory); find the checkpoint
`train.init_from` names, unless the run resumes its own; open the data and check it was made by
this run's tokenizer and its ids fit the vocabulary; when resuming, check the newest checkpoint
holds this model and was trained on this data (in seconds, before any compile), and stop there
when it has reached train.steps (nothing to train); build the trainer and compile its step,
refusing a step that cannot fit in memory; restore the newest valid checkpoint
(checkpoint.resume; refused if the model or the data differ), or else start from init_from's
weights; then, and only then, write anything and train. A run refused on the way leaves
nothing behind (`training/workspace.py`).

SIGTERM or SIGINT while training ends the run at the next step with a checkpoint; before
training, at once; on the command line a second signal ends it at once in any case
(`mtjax.interrupts`). The command turns a refusal into one line and an exit status
(`mtjax.cli.report`); `train` raises it: ConfigError or DataError for bad input, RunFault (and
NonFiniteLoss) or an OSError for a fault.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from time import monotonic     # the deadline's clock (tests move `time.perf_counter`, the summary's)


@dataclass(frozen=True)
class RunResult:
    """What a run leaves. `metrics`: the last row it logged, its last step's (`step`, `loss`,
    `grad_norm`, ... and, when it validated at that step, `val_loss`), as in metrics.jsonl: the
    step train.steps or a signal ended it at is logged whatever the interval; `run_dir`: where config.json,
    metrics.jsonl and tb/ are; `step`: the step the run reached; `checkpoint_dir`: its checkpoints
    (None with checkpoint.enabled=false); `stopped_by`: the signal that ended it early (SIGTERM, SIGINT),
    `time limit` (train.exit_duration_min), or None."""

    metrics: dict
    run_dir: str
    step: int
    checkpoint_dir: str | None = None
    stopped_by: str | None = None
    rows: list = field(default_factory=list, repr=False)   # every row this call logged


def train(config, overrides=()) -> RunResult:
    """Train as `python -m mtjax.train --config CONFIG OVERRIDES...` does, on all of JAX's
    devices, and return the run's `RunResult`.

    `config`: a YAML file's path, a `Config`, or None for the defaults; `overrides`: dotted
    `group.field=value` strings applied on top. Checkpoints, resume and init_from behave as on
    the command line; bad input raises ConfigError or DataError where the command prints
    `error: ...` and exits 2. Devices come from JAX: to simulate CPU devices call
    `mtjax.mesh.simulate_cpu_devices(n)` before JAX starts.

        import mtjax
        result = mtjax.train("configs/tiny.yaml", overrides=["train.steps=20"])
        result.metrics["loss"], result.run_dir
    """
    import jax

    from mtjax import distributed
    from mtjax.config import validate
    from mtjax.mesh import make_mesh
    cfg = resolve_config(config, overrides)
    distributed.initialize(cfg)
    d, p, t = validate(cfg, jax.device_count())
    with _signal_handlers_kept():
        return run(cfg, make_mesh(d, p, t, context=cfg.parallel.context))


def resolve_config(config, overrides=()):
    """A Config from a path (or None: the defaults) or a Config, with `overrides` applied."""
    from mtjax.config import Config, ConfigError, from_dict, load_config
    from mtjax.config.load import layered, override_list, parse_override
    overrides = override_list(overrides)
    for text in overrides:           # an override's error first: a '--config' one is not the file's
        parse_override(text)
    if config is None or isinstance(config, (str, os.PathLike)):
        path = None if config is None else os.fspath(config)
        if path is not None and not str(path).strip():
            raise ConfigError("config", "must name a file (or be None for the defaults)")
        try:
            return load_config(path, overrides)
        except ConfigError as e:      # the file: named as this function's argument, not the command's flag
            if e.key != "--config":
                raise
            raise ConfigError("config", e.problem) from None
    if not isinstance(config, Config):
        raise TypeError(f"config is a YAML file's path or a mtjax.config.Config, got {type(config).__name__}")
    raw = config.to_dict()
    checked = from_dict(raw, config.written)     # a Config built in Python: its fields' types checked as a file's are
    if not overrides:
        return config if checked == config else checked
    given = set()
    for text in overrides:
        group, name, value = parse_override(text)
        raw.setdefault(group, {})[name] = value
        given.add(f"{group}.{name}")
    return from_dict(*layered(raw, [config.written | config.set_keys(), frozenset(given)]))


def run(cfg, mesh) -> RunResult:
    """Make the run of a validated `cfg` on `mesh` (the module docstring's steps)."""
    import jax

    from mtjax.inspect import compile_train_step
    from mtjax.checkpoint import Checkpointer, plan_checkpoints
    from mtjax.checkpoint.policy import refuse_early
    from mtjax.training.data_setup import build_datasets
    from mtjax.checkpoint.init_from import find_source
    from mtjax.training.memory_fit import check_fits
    from mtjax.training.trainer import Trainer
    from mtjax.training.workspace import Workspace
    from mtjax.training import metrics

    started = monotonic()                        # train.exit_duration_min counts from here
    say = metrics.say if jax.process_index() == 0 else (lambda *a, **k: None)
    # Orbax reports a failed save twice: by raising (the loop turns that into one line) and by
    # logging tracebacks from its threads; keep only the first.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    with Workspace(cfg) as workspace:           # this run's directories are its own until it exits
        plan = plan_checkpoints(cfg)             # refuses to discard checkpoints
        resumes = cfg.checkpoint.resume and bool(plan.existing)
        source = find_source(cfg) if cfg.train.init_from and not resumes else None   # checked before compiling
        data = build_datasets(cfg, workspace)    # checks the token ids fit the vocabulary
        cfg = data.config                        # its tokenization as the data's index completed it
        checkpointer = None
        try:
            if resumes and cfg.checkpoint.enabled:   # another model or other data: refused before compiling
                checkpointer = Checkpointer(cfg, plan.directory, data=data.identity)
                refuse_early(checkpointer, cfg, data.vocab)
            finished = finished_step(checkpointer, cfg)   # nothing to train: said without compiling
            if finished is not None:
                workspace.started()
                data.save_caches()
                result = nothing_to_do(cfg, finished, plan.directory, say)
            else:
                trainer = Trainer(cfg, mesh, data.vocab, eod=data.eod)
                memory = check_fits(compile_train_step(trainer))  # the first step would run out of memory: refuse now
                if checkpointer is None and cfg.checkpoint.enabled:   # a fresh run: its directory is made only now,
                    checkpointer = Checkpointer(cfg, plan.directory, data=data.identity)   # past the memory check
                state, resumed, position = restore(cfg, checkpointer, trainer, source, say)
                plan.clear_if_starting_over()
                if plan.start_over and checkpointer is not None:
                    checkpointer.reload()            # its step list held the steps just deleted
                workspace.started()                  # from here on, what the run writes stays
                data.save_caches()
                result = train_from(cfg, data, trainer, checkpointer, state, resumed, plan.directory, say,
                                    position=position, memory=memory, started=started)
        except BaseException:
            if checkpointer is not None:         # orbax's threads must end, or the process would not exit
                checkpointer.close(quiet=True)   # without raising over the error on its way out
            raise
        if checkpointer is not None:
            checkpointer.close()
        return result


def finished_step(checkpointer, cfg) -> int | None:
    """The newest checkpoint's step when it has reached train.steps and is sealed and intact (so
    the resume would take it: `refuse_early` has checked it holds this model and data); else None."""
    from mtjax.checkpoint.manifest import verify
    steps = checkpointer.steps() if checkpointer is not None else []
    if not steps or steps[-1] < cfg.train.steps or verify(os.path.join(checkpointer.directory, str(steps[-1]))):
        return None
    return steps[-1]


def nothing_to_do(cfg, step: int, directory: str | None, say) -> RunResult:
    """A resume whose checkpoint `step` has reached train.steps: the rows past it (a crashed run's)
    go, as a resume drops them; the result holds the last row left."""
    import jax

    from mtjax.training.metrics import drop_rows_after
    if jax.process_index() == 0:
        drop_rows_after(cfg.train.run_dir, step)
    say(f"nothing to do: the checkpoint at step {step} has reached train.steps={cfg.train.steps} "
        f"(a larger train.steps trains on from it)", flush=True)
    return RunResult(last_row(cfg.train.run_dir), cfg.train.run_dir, step, directory)


def restore(cfg, checkpointer, trainer, source, say):
    """(state, resumed, data position): the newest valid checkpoint's state when resuming
    (ConfigError when every one was damaged); else step 0 from the weights of train.init_from
    (`source`, or found now); else None, a fresh start."""
    from mtjax.checkpoint.compat import carried, data_position
    from mtjax.checkpoint.init_from import find_source, initial_state
    from mtjax.checkpoint.policy import refuse_damaged_only
    step = None
    if checkpointer is not None and cfg.checkpoint.resume:
        # the step found is checked before a damaged newer one is moved aside: a refusal changes nothing
        step = checkpointer.latest_valid(report=lambda line: say(f"warning: {line}", file=sys.stderr, flush=True),
                                         check=lambda found: checkpointer.check_restorable(found, cfg, trainer.vocab))
    if step is None and checkpointer is not None and cfg.checkpoint.resume:
        refuse_damaged_only(checkpointer.directory)     # every step was damaged: moved aside just now
    if step is not None:
        state = checkpointer.restore(step, trainer)
        meta = checkpointer.saved(step)[0]
        position = data_position(meta, state, step)
        checkpointer.extra_meta |= carried(meta)         # the weights' origin, kept on
        say(f"resumed from checkpoint step {step} in {checkpointer.directory}", flush=True)
        if cfg.train.init_from:
            say(f"train.init_from={cfg.train.init_from} is not read: the run has its own checkpoints, and resuming "
                f"from them wins (checkpoint.resume=true)", flush=True)
        return state, True, position
    if not cfg.train.init_from:
        return None, False, 0
    source = source or find_source(cfg)
    state = initial_state(source, trainer)
    if checkpointer is not None:
        checkpointer.extra_meta |= carried(source.meta)  # the weights' origin, kept on
    say(f"started from the weights of checkpoint step {source.step} in {source.directory} (train.init_from); "
        f"fresh optimizer state, step 0", flush=True)
    return state, False, 0


def train_from(cfg, data, trainer, checkpointer, state, resumed: bool, directory: str, say,
               position: int = 0, memory: int | None = None, started: float | None = None) -> RunResult:
    """Write the run's config and print its layout (with the step's `memory` per device), train
    from `state` (fresh when None; a checkpoint's when `resumed`) and data `position` until
    train.steps, a signal, or train.exit_duration_min after `started` (`time.monotonic()`; default
    now), print the summary line."""
    import jax

    from mtjax.interrupts import arm_second_signal
    from mtjax.training.loop import train as train_loop
    from mtjax.training.metrics import MetricsWriter, devices_text, not_applicable, startup_line, summary_line
    from mtjax.training.flops import parameter_count
    from mtjax.training.signals import StopRequest

    start = int(state.step) if state is not None else 0     # (0: a fresh start)
    keep = directory if checkpointer is not None else None
    main_process = jax.process_index() == 0
    if start >= cfg.train.steps:    # (a newest checkpoint damaged, an older one past train.steps)
        return nothing_to_do(cfg, start, keep, say)
    if main_process:
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        with open(os.path.join(cfg.train.run_dir, "config.json"), "w", encoding="utf-8") as f:
            written = cfg.to_dict()
            written["train"]["micro_batch"] = trainer.plan.micro_batch   # b as used (train.micro_batches may set it)
            json.dump(written, f, indent=2)
        devices = devices_text(jax.device_count(), jax.devices()[0].platform)
        parameters = parameter_count(trainer.plan.params.shapes)      # global shapes, on every layout
        say(startup_line(trainer.plan, cfg, devices, data.prefix, parameters, memory), flush=True)
    limit = cfg.train.exit_duration_min * 60.0
    deadline = (monotonic() if started is None else started) + limit if limit else None
    stop, writer = StopRequest(checkpointer, deadline), None
    try:
        with stop:
            if state is None:    # a fresh start: its compile and run are not the loop's time (nor the bar's)
                state = jax.block_until_ready(trainer.init_state())
            writer = MetricsWriter(cfg.train.run_dir, cfg.train.steps, cfg.train.progress, enabled=main_process,
                                   resume_step=start if resumed else None,
                                   hidden=not_applicable(cfg.train.precision, cfg.train.on_nonfinite,
                                                          cfg.model.moe_aux_loss_coeff, cfg.model.moe_z_loss_coeff))
            t0 = time.perf_counter()
            outcome = train_loop(cfg, trainer, data, writer, state, checkpointer, stop, position)
    finally:
        if stop.requested_once:
            arm_second_signal()          # closing the writer and the checkpointer: a second signal acts at once
        if writer is not None:
            writer.close()
    say(summary_line(outcome.rows, start, outcome.step, trainer.plan.tokens_per_step, time.perf_counter() - t0,
                     outcome.stopped_by, keep), flush=True)
    metrics = outcome.rows[-1] if outcome.rows else last_row(cfg.train.run_dir)
    return RunResult(metrics, cfg.train.run_dir, outcome.step, keep, outcome.stopped_by, outcome.rows)


def last_row(run_dir: str) -> dict:
    """The last row of `run_dir`'s metrics.jsonl ({} if none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    return json.loads(lines[-1]) if lines else {}


@contextlib.contextmanager
def _signal_handlers_kept():
    """Put back the SIGINT/SIGTERM handlers a run found (in Python, a run stopped by a signal must
    not leave the command line's exit-at-once armed in the caller's process, say a notebook's kernel)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from mtjax.interrupts import SIGNALS, guard_saves
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield
    finally:
        guard_saves(None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
