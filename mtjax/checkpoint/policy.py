"""Which steps count, which are kept, and what happens to a damaged one.

What is deleted under the checkpoint directory, and by whom:
  - `<step>.orbax-checkpoint-tmp*`: an unfinished save (orbax, when a run opens the directory;
    a failed save's at once, `Checkpointer.close`);
  - the steps beyond the newest `checkpoint.keep`: orbax, only once a newer save has sealed;
  - with `checkpoint.overwrite=true` where the run would not resume them (`checkpoint.resume=false`
    or `checkpoint.enabled=false`): every step, tmp and damaged directory, and only those
    (`OWN`; the user asked for it, `CheckpointPlan.clear_if_starting_over`);
  - the lock file `.mtjax.lock` at exit, and directories a refused run created, when empty
    (`training/workspace.py`).
Nothing else: damaged steps are moved aside, never removed.

Damaged, never unfinished. A step directory is renamed into place only once complete, so one
that no longer verifies (even without its manifest: a partial copy, a stray `rm`) is damaged:
a resume reports it in one line, moves it aside (`damaged-<step>-<time>`) and takes the
previous one (`newest_valid`).

Found by path. `find_checkpoint` turns a run directory, a checkpoints directory or one step's
directory into (directory, newest complete step), for the converters, `mtjax.generate` and
`train.init_from`. It only reads: damaged newer steps are passed over with one warning line,
and with no usable step the one error line names the step, the file and what is wrong.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass

import jax
import numpy as np

from mtjax.checkpoint.errors import CheckpointError
from mtjax.checkpoint.manifest import verify
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config
from mtjax.data.errors import DataError
from mtjax.training.workspace import checkpoint_dir


# what a run's checkpoints are made of: a step, an unfinished save, a damaged step moved aside
OWN = re.compile(r"\d+|\d+\.orbax-checkpoint-tmp.*|damaged-\d+-\d+(-\d+)?")


def existing_steps(directory: str) -> list[int]:
    """Step directories present (complete or not), without creating anything."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def damaged_steps(directory: str) -> list[str]:
    """The damaged steps moved aside in `directory` (`move_aside`'s names)."""
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if n.startswith("damaged-") and OWN.fullmatch(n))


# ---------------------------------------------------------------- the plan, before anything is written

@dataclass(frozen=True)
class CheckpointPlan:
    directory: str
    existing: tuple[int, ...]
    start_over: bool          # resume=false with overwrite=true over existing checkpoints

    def clear_if_starting_over(self) -> None:
        """Delete the old checkpoints (the user asked for it with checkpoint.overwrite=true):
        the step, tmp and damaged directories, nothing else that shares the directory. Every
        process has planned before process 0 deletes (the first barrier), and none goes on
        before it is done (the second)."""
        barrier("mtjax: checkpoints planned")
        if self.start_over and jax.process_index() == 0:
            for name in os.listdir(self.directory):
                path = os.path.join(self.directory, name)
                if OWN.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
        barrier("mtjax: old checkpoints removed")


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def plan_checkpoints(cfg: Config) -> CheckpointPlan:
    """Where checkpoints go, and whether this run may proceed (ConfigError otherwise, before
    anything is written): a run that would not resume the checkpoints there (resume=false, or
    checkpoint.enabled=false: it would start over and rewrite the run's metrics) needs
    overwrite=true, which discards them; a resume over damaged steps alone is refused."""
    ck, directory = cfg.checkpoint, checkpoint_dir(cfg)
    existing, damaged = tuple(existing_steps(directory)), damaged_steps(directory)
    for step in existing:          # a step's name taken by a file (or a link to none): saving it would fail mid-run
        if not os.path.isdir(os.path.join(directory, str(step))):
            raise ConfigError("checkpoint.dir", f"{os.path.join(directory, str(step))} is not a directory, where a "
                                                f"checkpoint step would be saved: move it away")
    held = f"newest step {existing[-1]}" if existing else f"damaged ones: {', '.join(damaged)}"
    start_over = bool(existing or damaged) and not (ck.resume and ck.enabled)
    if start_over and not ck.overwrite and not ck.enabled:
        raise ConfigError("checkpoint.enabled", f"is false but {directory} holds this run's checkpoints ({held}): "
                                                f"the run would start over beside them and rewrite its metrics; set "
                                                f"checkpoint.overwrite=true to discard them, or resume them")
    if start_over and not ck.overwrite:
        raise ConfigError("checkpoint.resume", f"is false but {directory} holds checkpoints ({held}); set "
                                               f"checkpoint.overwrite=true to discard them, or resume")
    if not start_over:
        refuse_damaged_only(directory)
    return CheckpointPlan(directory, existing if ck.enabled else (), start_over)


def refuse_damaged_only(directory: str) -> None:
    """ConfigError when `directory` holds damaged steps and no other: a resume has nothing to
    resume, and starting over would discard the run's history unasked."""
    damaged = damaged_steps(directory)
    if damaged and not existing_steps(directory):
        raise ConfigError("checkpoint.resume", f"{directory} holds damaged checkpoints only ({', '.join(damaged)}): "
                                               f"nothing to resume; set checkpoint.resume=false "
                                               f"checkpoint.overwrite=true to start over")


# ---------------------------------------------------------------- found by path (read only)

def find_checkpoint(path: str, warn=None) -> tuple[str, int]:
    """(checkpoint directory, step) that `path` names: a step directory, a directory of steps
    (the newest complete one), or a run directory holding `checkpoints/`. DataError if none:
    one line naming the step, the file and what is wrong with it when every step is damaged.
    Falling back past damaged newer steps is one `warning:` line (to `warn`, default stderr)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise DataError(f"{path}: " + ("a file, not a directory (name a run, its checkpoints or one step)"
                                       if os.path.exists(path) else "no such directory"))
    if os.path.basename(path).isdigit() and os.path.isdir(os.path.join(path, "state")):
        problem = verify(path)
        if problem is not None:
            raise DataError(f"checkpoint step {os.path.basename(path)} in {os.path.dirname(path)} is not usable: "
                            f"{problem}")
        return os.path.dirname(path), int(os.path.basename(path))
    directory = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    damaged = []
    for step in reversed(existing_steps(directory)):
        problem = verify(os.path.join(directory, str(step)))
        if problem is None:
            if damaged:
                (warn or _warn)(f"{_damaged_list(damaged, directory)}; using step {step}")
            return directory, step
        damaged.append((step, problem))
    if damaged:
        raise DataError(f"{path}: holds no complete mtjax checkpoint: {_damaged_list(damaged, directory)}")
    raise DataError(f"{path}: holds no complete mtjax checkpoint")


def _damaged_list(damaged: list[tuple[int, str]], directory: str) -> str:
    """'checkpoint step 8 in D is damaged: <why>' (newest first), one clause per step."""
    first, *rest = damaged
    more = "".join(f"; step {step} too: {problem}" for step, problem in rest)
    return f"checkpoint step {first[0]} in {directory} is damaged: {first[1]}{more}"


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- a resume: damaged steps moved aside

def newest_valid(directory: str, steps: list[int], report, check=None) -> int | None:
    """The newest of `steps` whose files match their manifest. Newer, damaged ones (a missing
    manifest included: a step directory exists only once its save finished) are moved aside
    to `damaged-<step>-<time>` and reported, one line each, saying what is used instead; but
    first `check(step)` (every process) may refuse the step found, and then nothing has moved.
    Process 0 checks and moves; the others wait for it and take its answer."""
    found, damaged = -1, []
    if jax.process_index() == 0:
        for step in reversed(steps):
            problem = verify(os.path.join(directory, str(step)))
            if problem is None:
                found = step
                break
            damaged.append((step, problem))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        barrier("mtjax: checkpoints checked")
        found = int(multihost_utils.broadcast_one_to_all(np.int32(found)))
    if found >= 0 and check is not None:
        check(found)
    for i, (step, problem) in enumerate(damaged):
        aside = move_aside(directory, step)
        then = f"trying step {steps[-i - 2]}" if len(steps) > i + 1 else "no earlier checkpoint remains"
        report(f"checkpoint step {step} in {directory} is damaged: {problem}; moved to "
               f"{os.path.basename(aside)}, {then}")
    barrier("mtjax: damaged checkpoints moved aside")
    return None if found < 0 else found


def move_aside(directory: str, step: int) -> str:
    """Rename a damaged step to `damaged-<step>-<unix time>` (a suffix if that exists); its path."""
    base = os.path.join(directory, f"damaged-{step}-{int(time.time())}")
    aside, n = base, 1
    while os.path.lexists(aside):
        aside, n = f"{base}-{n}", n + 1
    os.rename(os.path.join(directory, str(step)), aside)
    return aside


def refuse_early(checkpointer, cfg: Config, vocab: int) -> None:
    """`checkpointer.check_restorable` on the step a resume would take, before the run compiles
    anything: a resume on another model or other data is refused in seconds, not after the step's
    compile. Read-only. From the newest step down: one that passes ends the search; a failed check
    (a file of it missing, OSError, included) counts if that step is sealed and intact, else the
    resume would move it aside (`newest_valid`) and try the one before, which decides."""
    for step in reversed(checkpointer.steps()):
        try:
            checkpointer.check_restorable(step, cfg, vocab)
            return
        except (CheckpointError, ConfigError, OSError):
            if verify(os.path.join(checkpointer.directory, str(step))) is None:
                raise
