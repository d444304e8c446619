"""The orbax side: asynchronous saves that are complete or invisible, and restores.

A checkpoint is the directory `<checkpoint dir>/<step>/` holding three orbax items:
  state  the TrainState (parameters, optimizer state, step, data position,
         RNG key, loss-scale state), each array stored once in its global shape;
  config the resolved Config (JSON), for the reader and for model-shape checks;
  meta   {"step", "vocab", "padded_vocab", "layout", "data", "data_position"}: what a
         restore on another layout needs to know (and the exact samples consumed: the
         state's int32 wraps past 2^31), and what identifies the data it was trained on (the
         corpora's fingerprint, a blend's weights, the tokenizer, the split seed and
         fraction): a resume on other data is refused unless `data.allow_change=true`;
         a conversion adds its own entries (`meta=`: from-hf's source token ids).

Complete or invisible. Orbax writes into `<step>.orbax-checkpoint-tmp` and renames it when
every file is on disk; a crash before the rename leaves only the tmp directory, which orbax
never lists as a step and the next run deletes (`policy`). Into that tmp directory, just
before the rename, the post-finalization callback writes the manifest (`manifest`).
Synchronous saves are asynchronous ones waited for, so every save is sealed before its rename.

A save that cannot happen is an error, never skipped: a step already saved, too little free
space for the state (checked before writing, so a full disk costs nothing but the new
checkpoint), or any failure while orbax writes (one in its background threads at the loop's
next step, `check`) raises `CheckpointFault`, one line naming the step and the directory. The
previous sealed checkpoint is untouched; the half-written tmp directory is removed at `close`
(else when the next run opens the directory).

A first signal while orbax runs its event loop in the main thread (the start of a save, a
restore) is held until the call returns (`interrupts.deferred`), then raised: raised inside the
loop, it would close the loop under tensorstore's writer threads, each of which would print a
traceback, where the command promises one line.

After a signal. `unsealed()` names the saves started but not yet sealed, and `sealed_steps`
the steps on disk with a manifest: `mtjax.interrupts` waits for the first to empty when a
second signal arrives during a save, and prints what the second says was kept.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import threading

import jax
import orbax.checkpoint as ocp

from mtjax.checkpoint import restore as layout
from mtjax.checkpoint.barrier import Barrier
from mtjax.checkpoint.compat import (CARRIED_META, check_same_data, check_same_model, check_same_seed, check_vocab,
                                     check_window_record)
from mtjax.checkpoint.errors import CheckpointError, CheckpointFault, first_line, unrestorable
from mtjax.checkpoint.manifest import has_manifest, write_manifest
from mtjax.checkpoint.policy import checkpoint_dir, existing_steps, newest_valid
from mtjax.checkpoint.stored import check_stored_shapes
from mtjax.config.errors import is_fault
from mtjax.config.schema import Config
from mtjax.interrupts import deferred


class Checkpointer:
    """Saves the steps the loop hands it (every `checkpoint.interval` steps and at the end) and
    keeps the newest `checkpoint.keep`; restores a saved step onto any layout.

    With `async_save`, `save` returns once the arrays are copied off the device and a background
    thread writes the files while training goes on; without it, once they are on disk and sealed.
    """

    def __init__(self, cfg: Config, directory: str | None = None, data: dict | None = None,
                 read_only: bool = False, meta: dict | None = None):
        self.directory = directory or checkpoint_dir(cfg)
        self.cfg = cfg
        self.data = data          # what identifies the training data (Datasets.identity), or None
        self.extra_meta = meta or {}           # more of the `meta` item (a conversion's source token ids)
        self._pending: list[int] = []
        self._failed: int | None = None        # a step whose sealing failed (reported by a later call)
        self._broken = False                   # a save failed: its tmp directory is removed at `close`
        self._lock = threading.Lock()
        self._main = jax.process_index() == 0
        self._started: list[int] = []          # saves started and not yet seen sealed (`unsealed`)
        self._barrier = Barrier()              # orbax's, not waited at after a failed write (`check`)
        # read_only: restore only, touch nothing (a converter must not remove the tmp directory of a
        # running job's save in flight)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else cfg.checkpoint.keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, cleanup_tmp_directories=not read_only, read_only=read_only,
            # Every save goes through orbax's asynchronous path (a synchronous one is waited for in
            # `save`): orbax calls this callback when every item is written, before it renames the tmp
            # directory, so the manifest appears together with the checkpoint, never after it.
            enable_async_checkpointing=not read_only,
            async_options=None if read_only else ocp.AsyncOptions(post_finalization_callback=self._finalized,
                                                                  barrier_sync_fn=self._barrier))
        with deferred():
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    # -- saving

    def save(self, state, trainer, precheck=None, position: int | None = None) -> None:
        """Start saving `state` (at its step); CheckpointFault when it cannot be saved. The step
        counts as unsealed (`unsealed`) from the start, `precheck(state)` (which may raise) included.
        `position`: the exact data position (the loop's), kept in `meta` (`compat.data_position`)."""
        step = int(state.step)
        # on disk, not only orbax's list: orbax's forced save would remove a file of that name
        if step in self.manager.all_steps() or os.path.lexists(os.path.join(self.directory, str(step))):
            raise CheckpointFault(f"checkpoint step {step} already exists in {self.directory}; another run "
                                  f"has written there (the checkpoint directory is locked while a run uses it)")
        with self._lock:
            self._started.append(step)
        try:
            if precheck is not None:
                precheck(state)
            self._check_space(state, step)
            self._start(step, state, trainer, position)
        except BaseException:
            with self._lock:
                self._started.remove(step)
            raise
        if not self.cfg.checkpoint.async_save:
            self.wait()

    def _start(self, step: int, state, trainer, position: int | None) -> None:
        """Hand the save of `state` to orbax (layers in canonical order, so that any layout restores them)."""
        meta = {"step": step, "vocab": trainer.vocab, "padded_vocab": trainer.padded_vocab,
                "layout": [trainer.plan.data, trainer.plan.pipe, trainer.plan.tensor], "data": self.data,
                **({} if position is None else {"data_position": int(position)}), **self.extra_meta}
        args = ocp.args.Composite(state=ocp.args.StandardSave(trainer.canonical(state)),
                                  config=ocp.args.JsonSave(self.cfg.to_dict()), meta=ocp.args.JsonSave(meta))
        with self._lock:
            self._pending.append(step)
        # A signal is held while orbax runs its event loop here (`interrupts.deferred`), and raised
        # once the save has started or failed, so `_pending` stays right either way.
        with deferred():
            try:
                with self._faults():
                    if not self.manager.save(step, args=args, force=True):
                        raise CheckpointFault(f"checkpoint step {step}: orbax declined to save it in {self.directory}")
            except BaseException:
                with self._lock:
                    self._pending.remove(step)      # no callback will come for it
                raise

    def _check_space(self, state, step: int) -> None:
        """CheckpointFault unless the file system has room for this process's part of the state
        (with a margin for metadata): failing now writes nothing, failing halfway leaves debris."""
        need = sum(x.nbytes for x in jax.tree.leaves(state)) // jax.process_count()
        need = int(need * 1.05) + (1 << 20)
        free = shutil.disk_usage(self.directory).free
        if free < need:     # a save in flight (or one being sealed, no longer pending) may still free space
            self.wait()     # (keep) or seal its step: let it end, so the line names the last sealed step
            free = shutil.disk_usage(self.directory).free
        if free < need:
            raise CheckpointFault(f"checkpoint step {step} needs about {need / 2**20:.1f} MiB but {self.directory} "
                                  f"has {free / 2**20:.1f} MiB free; nothing was written, {self._kept()}")

    def _kept(self) -> str:
        sealed = self.sealed_steps()
        return f"the last sealed checkpoint (step {sealed[-1]}) is intact" if sealed else "no earlier checkpoint exists"

    @contextlib.contextmanager
    def _faults(self):
        """Any failure of orbax's (a full disk, an unwritable directory) as one CheckpointFault line.
        Orbax reports an asynchronous save's failure at the next call, so the step named is the
        oldest one not yet sealed."""
        try:
            yield
        except CheckpointFault:
            raise
        except Exception as e:   # orbax and tensorstore raise ValueError/RuntimeError/OSError for I/O errors
            self._broken = True
            with self._lock:
                pending = self._pending[0] if self._pending else "(in flight)"
                step = self._failed if self._failed is not None else pending
            raise CheckpointFault(f"checkpoint step {step} could not be written to {self.directory}: "
                                  f"{first_line(e)}; {self._kept()}") from None

    def _finalized(self) -> None:   # called by orbax's finalize thread
        """Seal the oldest pending save with its manifest (process 0 writes it). Orbax saves
        one checkpoint at a time, so the oldest pending step is the one just written."""
        with self._lock:
            step = self._pending.pop(0) if self._pending else None
        if step is None or not self._main:
            return
        tmp = glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*"))
        step_dir = tmp[0] if tmp else os.path.join(self.directory, str(step))
        try:
            if not os.path.isdir(step_dir):
                raise CheckpointFault(f"checkpoint step {step}: no directory to seal in {self.directory}")
            write_manifest(step_dir)
        except BaseException:
            with self._lock:             # orbax raises this later, from another call: name the right step
                self._failed = step
            raise

    def wait(self) -> None:
        """Block until every started save is on disk (and sealed)."""
        with self._faults():
            self.manager.wait_until_finished()

    def check(self) -> None:
        """CheckpointFault once a save failed in orbax's background (`barrier`), which orbax reports
        only at the next save or wait: asked every step, so every process of a job ends at once."""
        if self._barrier.failed:
            self._barrier.failed = False
            self.wait()

    def unsealed(self) -> list[int]:
        """Steps whose save has started and is not yet sealed in place (renamed, with its manifest).
        Safe from any thread: it reads the directory, not orbax's state."""
        with self._lock:
            started = list(self._started)
        sealed = {s for s in started if has_manifest(self.directory, s)}
        with self._lock:
            self._started = [s for s in self._started if s not in sealed]
            return list(self._started)

    def sealed_steps(self) -> list[int]:
        """Steps on disk with their manifest (not checked against it: that is `verify`'s work)."""
        return [s for s in existing_steps(self.directory) if has_manifest(self.directory, s)]

    def close(self, quiet: bool = False) -> None:
        """Finish the saves in flight and stop orbax's threads. `quiet`: while another error is
        already on its way out, a failed save is not raised over it."""
        try:
            self.wait()
        except CheckpointFault:
            if not quiet:
                raise
        finally:
            with contextlib.suppress(Exception):
                self.manager.close()
            if self._broken and self._main:     # a failed save's debris (else removed at the next open)
                for tmp in glob.glob(os.path.join(glob.escape(self.directory), "*.orbax-checkpoint-tmp*")):
                    shutil.rmtree(tmp, ignore_errors=True)

    # -- restoring

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def reload(self) -> None:
        """Read the step list again (after `CheckpointPlan.clear_if_starting_over` emptied it)."""
        self.manager.reload()

    def latest_valid(self, report=print, check=None) -> int | None:
        """The newest checkpoint whose files match their manifest; newer, damaged ones are moved
        aside and reported (`policy.newest_valid`), once `check(step)` has passed on the one found
        (a refused resume moves nothing). Every process then reloads the step list."""
        found = newest_valid(self.directory, self.steps() if self._main else [], report, check)
        self.manager.reload()
        return found

    def saved(self, step: int) -> tuple[dict, dict]:
        """(meta, config) of the checkpoint at `step`: its `meta` item and the Config it was saved
        with (as a dict); CheckpointError when they cannot be read."""
        try:
            with deferred():
                items = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                                           config=ocp.args.JsonRestore()))
            meta, saved = items["meta"], items["config"]
            if not isinstance(saved["model"], dict) or not isinstance(saved["train"]["precision"], str):
                raise TypeError("no model group or train.precision in the saved config")
            check_vocab(meta["vocab"], meta["padded_vocab"], saved["model"].get("vocab_size"))
            check_window_record(meta.get(CARRIED_META[1]), saved["model"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} has unreadable metadata: "
                                  f"{first_line(e)}") from None
        return meta, saved

    def check_restorable(self, step: int, cfg: Config, vocab: int) -> tuple[dict, dict]:
        """(meta, config) of `step` after the checks a restore makes before reading any array: the
        same model, the same data (unless data.allow_change), the same train.seed, the tokenizer's
        vocabulary, a seq_len within the weights' sliding window."""
        meta, saved = self.saved(step)
        check_same_model(saved["model"], cfg, step, resumes=True, meta=meta)
        check_same_data(meta.get("data"), self.data, self.cfg, step)
        check_same_seed(saved, cfg, step)
        if int(meta["vocab"]) != vocab:
            raise CheckpointError(f"checkpoint step {step} was saved with a vocabulary of {meta['vocab']} tokens, "
                                  f"this run's tokenizer has {vocab}")
        return meta, saved

    def restore(self, step: int, trainer):
        """The TrainState saved at `step`, on `trainer`'s layout (any layout)."""
        meta, saved = self.check_restorable(step, trainer.cfg, trainer.vocab)
        padded, vocab, precision = int(meta["padded_vocab"]), int(meta["vocab"]), saved["train"]["precision"]
        target, want = layout.restore_target(trainer, padded)
        check_stored_shapes(os.path.join(self.directory, str(step), "state"), target, step, self.directory)
        try:
            with deferred():
                restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:      # noqa: BLE001  (a damaged array: orbax's bare Exception)
            if is_fault(e):
                raise
            raise unrestorable(e, step, self.directory) from None
        return layout.fitted(restored["state"], want, vocab, precision, trainer)
