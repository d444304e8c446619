"""Checkpoints: asynchronous orbax saves that are complete or invisible, and restorable on any layout.

A checkpoint is the directory `<checkpoint dir>/<step>/` holding three orbax items:
  state  the TrainState (parameters, optimizer state, step, data position,
         RNG key, loss-scale state), each array stored once in its global shape;
  config the resolved Config (JSON), for the reader and for model-shape checks;
  meta   {"step", "vocab", "padded_vocab", "layout", "data"}: what a restore on another
         layout needs to know, and what identifies the data it was trained on (the
         corpora's fingerprint, a blend's weights, the tokenizer, the split seed and
         fraction): a resume on
         other data is refused unless `data.allow_change=true`.

Complete or invisible. Orbax writes into `<step>.orbax-checkpoint-tmp` and renames
it when every file is on disk; a crash before the rename leaves only the tmp
directory, which orbax never lists as a step and the next run deletes (see "What
is deleted" below). Into that tmp directory, just before the rename, we
write `mtjax_manifest.json`: the size and CRC-32 of every item file. Synchronous
saves are asynchronous ones waited for, so every save is sealed before its rename.
A checkpoint counts only with a manifest whose sizes and CRCs all match, so a
missing manifest, a truncated file or flipped bits make it invalid. A step
directory was renamed into place only once complete, so one that no longer
verifies (even without its manifest: a partial copy, a stray `rm`) is damaged,
never unfinished: a resume reports it in one line, moves it aside
(`damaged-<step>-<time>`) and takes the previous one.

What is deleted under the checkpoint directory, and by whom:
  - `<step>.orbax-checkpoint-tmp*`: an unfinished save (orbax, when a run opens the directory);
  - the steps beyond the newest `checkpoint.keep`: orbax, only once a newer save has sealed;
  - with `checkpoint.resume=false checkpoint.overwrite=true`: every step, tmp and damaged
    directory (the user asked for it, `CheckpointPlan.clear_if_starting_over`);
  - the lock file `.mtjax.lock` at exit, and directories a refused run created, when empty
    (`training/workspace.py`).
Nothing else: damaged steps are moved aside, never removed.

A save that cannot happen is an error, never skipped: a step already saved, too little free
space for the state (checked before writing, so a full disk costs nothing but the new
checkpoint), or any failure while orbax writes raises `CheckpointFault`, one line naming
the step and the directory. The previous sealed checkpoint is untouched; the half-written
tmp directory is removed when the next run opens the directory.

After a signal. `unsealed()` names the saves started but not yet sealed, and `sealed_steps`
the steps on disk with a manifest: `mtjax.interrupts` waits for the first to empty when a
second signal arrives during a save, and prints what the second says was kept.

Found by path. `find_checkpoint` turns a run directory, a checkpoints directory or one step's
directory into (directory, newest complete step), for the converters, `mtjax.generate` and
`train.init_from`. It only reads: damaged newer steps are passed over with one warning line,
and with no usable step the one error line names the step, the file and what is wrong.

Any layout. Arrays are stored in their global shapes with the layers in canonical
order, and the distributed optimizer changes only where the shards live, so
orbax restores onto the new shardings directly. The one shape that depends on the
layout is the padded vocabulary (a multiple of vocab_multiple * t): those leaves
are read at their stored size and cut or zero-padded to the new one. Rows beyond
the true vocabulary never carry probability (their logits are masked), so they
do not change the loss.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.config.errors import ConfigError, RunFault
from mtjax.config.schema import Config, ModelConfig
from mtjax.data.errors import DataError
from mtjax.training import loss_scale
from mtjax.training import state as state_lib
from mtjax.training.loss_scale import init_loss_scale
from mtjax.training.plan import global_model

MANIFEST = "mtjax_manifest.json"
UNSEALED = "no manifest"
MODEL_KEYS_FREE = ("vocab_multiple", "dropout", "attention_dropout")   # may differ on resume


class CheckpointError(DataError):
    """A checkpoint that cannot be used; the message is one line naming it."""


class CheckpointFault(RunFault):
    """A checkpoint that could not be written; the message is one line naming step and directory."""


def checkpoint_dir(cfg: Config) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(cfg.train.run_dir, "checkpoints"))


# ---------------------------------------------------------------- the plan, before anything is written

def existing_steps(directory: str) -> list[int]:
    """Step directories present (complete or not), without creating anything."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


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
        _barrier("mtjax: checkpoints planned")
        if self.start_over and jax.process_index() == 0:
            for name in os.listdir(self.directory):
                if name.split(".")[0].isdigit() or name.startswith("damaged-"):
                    shutil.rmtree(os.path.join(self.directory, name))
        _barrier("mtjax: old checkpoints removed")


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def plan_checkpoints(cfg: Config) -> CheckpointPlan:
    """Where checkpoints go, and whether this run may proceed: resume=false over existing
    checkpoints needs overwrite=true (ConfigError otherwise, before anything is written)."""
    directory = checkpoint_dir(cfg)
    existing = tuple(existing_steps(directory)) if cfg.checkpoint.enabled else ()
    start_over = bool(existing) and not cfg.checkpoint.resume
    if start_over and not cfg.checkpoint.overwrite:
        raise ConfigError("checkpoint.resume", f"is false but {directory} holds checkpoints (newest step "
                          f"{existing[-1]}); set checkpoint.overwrite=true to discard them, or resume")
    return CheckpointPlan(directory, existing, start_over)


def find_checkpoint(path: str, warn=None) -> tuple[str, int]:
    """(checkpoint directory, step) that `path` names: a step directory, a directory of steps
    (the newest complete one), or a run directory holding `checkpoints/`. DataError if none:
    one line naming the step, the file and what is wrong with it when every step is damaged.
    Falling back past damaged newer steps is one `warning:` line (to `warn`, default stderr)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such directory")
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


# ---------------------------------------------------------------- manifest

def _files(step_dir: str) -> list[str]:
    """The item files (state/, config/, meta/). Orbax rewrites its top-level metadata after
    the callback that writes the manifest, so those few bytes are not covered."""
    out = []
    for root, _, names in os.walk(step_dir):
        if root != step_dir:
            out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
    return sorted(out)


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(step_dir: str) -> None:
    """Size and CRC-32 of every file, written atomically (tmp file, fsync, rename)."""
    entries = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _crc(os.path.join(step_dir, rel))]
               for rel in _files(step_dir)}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": entries}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify(step_dir: str) -> str | None:
    """None when every file matches the manifest; otherwise what is wrong, in a few words."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return UNSEALED
    try:
        with open(path, encoding="utf-8") as f:
            entries = {str(rel): (int(size), int(crc)) for rel, (size, crc) in json.load(f)["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "unreadable manifest"
    on_disk = set(_files(step_dir))
    if not entries or set(entries) != on_disk:    # every item file listed, and only those
        unlisted, missing = sorted(on_disk - set(entries)), sorted(set(entries) - on_disk)
        return (f"missing file {missing[0]}" if missing else
                f"file {unlisted[0]} is not in the manifest" if unlisted else "the manifest lists no files")
    for rel, (size, crc) in entries.items():
        full = os.path.join(step_dir, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, expected {size} (truncated)"
        if _crc(full) != crc:
            return f"{rel} fails its CRC-32 check (corrupted)"
    return None


# ---------------------------------------------------------------- restore targets

def _restore_target(trainer, padded_vocab: int):
    """(what to read, what the new layout wants). Leaves are read onto the new layout's
    shardings, except those whose stored shape differs (the vocabulary axis, when the saved
    run padded V differently), which are read whole (replicated) and then fitted by `_fit`."""
    cfg = trainer.cfg
    stored = state_lib.abstract_state(global_model(cfg, padded_vocab), trainer.tx, cfg.model.seq_len,
                                      init_loss_scale(cfg))
    want = jax.eval_shape(trainer.init_state)
    whole = NamedSharding(trainer.mesh, P())

    def one(s, w, sharding):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding if s.shape == w.shape else whole)
    return jax.tree.map(one, stored, want, trainer.state_shardings), want


def _fit(tree, want, vocab: int, shardings):
    """Cut or zero-pad each vocabulary axis to the wanted padded size; every other leaf as is."""

    def resize(x, w):
        if x.shape == w.shape:
            return x
        axes = [a for a, (m, n) in enumerate(zip(x.shape, w.shape)) if m != n]
        if len(x.shape) != len(w.shape) or len(axes) != 1 or min(x.shape[axes[0]], w.shape[axes[0]]) < vocab:
            raise CheckpointError(f"checkpoint leaf of shape {x.shape} does not fit {w.shape}")
        a = axes[0]
        x = jax.lax.slice_in_dim(x, 0, vocab, axis=a)
        pad = [(0, 0)] * x.ndim
        pad[a] = (0, w.shape[a] - vocab)
        return jnp.pad(x, pad)
    return jax.jit(lambda t: jax.tree.map(resize, t, want), out_shardings=shardings)(tree)


# ---------------------------------------------------------------- the checkpointer

class Checkpointer:
    """Saves every `checkpoint.interval` steps and at the end, keeps the newest `checkpoint.keep`.

    The loop decides when to save. With `async_save`, `save` returns once the arrays are
    copied off the device and a background thread writes the files while training goes on;
    without it, `save` returns when the checkpoint is on disk and sealed.
    """

    def __init__(self, cfg: Config, directory: str | None = None, data: dict | None = None,
                 read_only: bool = False):
        self.directory = directory or checkpoint_dir(cfg)
        self.cfg = cfg
        self.data = data          # what identifies the training data (Datasets.identity), or None
        self._pending: list[int] = []
        self._failed: int | None = None        # a step whose sealing failed (reported by a later call)
        self._lock = threading.Lock()
        self._main = jax.process_index() == 0
        self._started: list[int] = []          # saves started and not yet seen sealed (`unsealed`)
        # read_only: restore only, and touch nothing (a converter reading a running job's checkpoints
        # must not remove the tmp directory of a save in flight)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else cfg.checkpoint.keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, cleanup_tmp_directories=not read_only, read_only=read_only,
            # Every save goes through orbax's asynchronous path (a synchronous one is waited for in
            # `save`): orbax calls this callback when every item is written, before it renames the tmp
            # directory, so the manifest appears together with the checkpoint, never after it.
            enable_async_checkpointing=not read_only,
            async_options=None if read_only else ocp.AsyncOptions(post_finalization_callback=self._finalized))
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # -- saving

    def save(self, state, trainer, precheck=None) -> None:
        """Start saving `state` (at its step); CheckpointFault when it cannot be saved. The step
        counts as unsealed (`unsealed`) from the start, `precheck(state)` (which may raise) included."""
        step = int(state.step)
        if step in self.manager.all_steps():
            raise CheckpointFault(f"checkpoint step {step} already exists in {self.directory}; another run "
                                  f"has written there (the checkpoint directory is locked while a run uses it)")
        with self._lock:
            self._started.append(step)
        try:
            if precheck is not None:
                precheck(state)
            self._check_space(state, step)
            self._start(step, state, trainer)
        except BaseException:
            with self._lock:
                self._started.remove(step)
            raise
        if not self.cfg.checkpoint.async_save:
            self.wait()

    def _start(self, step: int, state, trainer) -> None:
        """Hand the save of `state` to orbax (layers in canonical order, so that any layout restores them)."""
        meta = {"step": step, "vocab": trainer.vocab, "padded_vocab": trainer.padded_vocab,
                "layout": [trainer.plan.data, trainer.plan.pipe, trainer.plan.tensor], "data": self.data}
        args = ocp.args.Composite(state=ocp.args.StandardSave(trainer.canonical(state)),
                                  config=ocp.args.JsonSave(self.cfg.to_dict()), meta=ocp.args.JsonSave(meta))
        with self._lock:
            self._pending.append(step)
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
        if free < need and self._pending:      # the saves in flight may still free space (keep): let them end
            self.wait()
            free = shutil.disk_usage(self.directory).free
        if free < need:
            raise CheckpointFault(f"checkpoint step {step} needs about {need / 2**20:.1f} MiB but {self.directory} "
                                  f"has {free / 2**20:.1f} MiB free; nothing was written, "
                                  f"{self._kept()}")

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
            with self._lock:
                step = self._failed if self._failed is not None else self._pending[0] if self._pending else "(in flight)"
            raise CheckpointFault(f"checkpoint step {step} could not be written to {self.directory}: "
                                  f"{_first_line(e)}; {self._kept()}") from None

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
            self._failed = step          # orbax raises this later, from another call: name the right step
            raise

    def wait(self) -> None:
        """Block until every started save is on disk (and sealed)."""
        with self._faults():
            self.manager.wait_until_finished()

    def unsealed(self) -> list[int]:
        """Steps whose save has started and is not yet sealed in place (renamed, with its manifest).
        Safe from any thread: it reads the directory, not orbax's state."""
        with self._lock:
            started = list(self._started)
        sealed = {s for s in started if os.path.isfile(os.path.join(self.directory, str(s), MANIFEST))}
        with self._lock:
            self._started = [s for s in self._started if s not in sealed]
            return list(self._started)

    def sealed_steps(self) -> list[int]:
        """Steps on disk with their manifest (not checked against it: that is `verify`'s work)."""
        return [s for s in existing_steps(self.directory)
                if os.path.isfile(os.path.join(self.directory, str(s), MANIFEST))]

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

    # -- restoring

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_valid(self, report=print) -> int | None:
        """The newest checkpoint whose files match their manifest. Newer, damaged ones (a missing
        manifest included: a step directory exists only once its save finished) are moved aside
        to `damaged-<step>-<time>` and reported, one line each, saying what is used instead.
        Process 0 checks and moves; the others wait for it, reload the step list and take its answer."""
        found = -1
        if self._main:
            steps = self.steps()
            for i in reversed(range(len(steps))):
                step_dir = os.path.join(self.directory, str(steps[i]))
                problem = verify(step_dir)
                if problem is None:
                    found = steps[i]
                    break
                aside = self._move_aside(steps[i])
                then = f"trying step {steps[i - 1]}" if i else "no earlier checkpoint remains"
                report(f"checkpoint step {steps[i]} in {self.directory} is damaged: {problem}; moved to "
                       f"{os.path.basename(aside)}, {then}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            _barrier("mtjax: checkpoints checked")
            found = int(multihost_utils.broadcast_one_to_all(np.int32(found)))
        self.manager.reload()
        return None if found < 0 else found

    def _move_aside(self, step: int) -> str:
        """Rename a damaged step to `damaged-<step>-<unix time>` (a suffix if that exists); its path."""
        base = os.path.join(self.directory, f"damaged-{step}-{int(time.time())}")
        aside, n = base, 1
        while os.path.lexists(aside):
            aside, n = f"{base}-{n}", n + 1
        os.rename(os.path.join(self.directory, str(step)), aside)
        return aside

    def saved(self, step: int) -> tuple[dict, dict]:
        """(meta, config) of the checkpoint at `step`: its `meta` item and the Config it was saved
        with (as a dict); CheckpointError when they cannot be read."""
        try:
            items = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                                       config=ocp.args.JsonRestore()))
            meta, saved = items["meta"], items["config"]
            for value in (meta["padded_vocab"], meta["vocab"]):
                int(value)
            if not isinstance(saved["model"], dict) or not isinstance(saved["train"]["precision"], str):
                raise TypeError("no model group or train.precision in the saved config")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} has unreadable metadata: "
                                  f"{_first_line(e)}") from None
        return meta, saved

    def restore(self, step: int, trainer):
        """The TrainState saved at `step`, on `trainer`'s layout (any layout)."""
        meta, saved = self.saved(step)
        padded, vocab, precision = int(meta["padded_vocab"]), int(meta["vocab"]), saved["train"]["precision"]
        check_same_model(saved["model"], trainer.cfg, step)
        check_same_data(meta.get("data"), self.data, self.cfg, step)
        if vocab != trainer.vocab:
            raise CheckpointError(f"checkpoint step {step} was saved with a vocabulary of {vocab} tokens, "
                                  f"this run's tokenizer has {trainer.vocab}")
        target, want = _restore_target(trainer, padded)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} cannot be restored: "
                                  f"{_first_line(e)}") from None
        state = restored["state"]
        if precision != trainer.plan.precision:
            state = _fresh_loss_scale(state, trainer)
        if any(a.shape != b.shape for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want))):
            state = _fit(state, want, vocab, trainer.state_shardings)
        return trainer.run_order(state)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _fresh_loss_scale(state, trainer):
    """A run that changes precision starts the loss scaler afresh (S = 1 outside fp16, the
    initial scale in fp16); the count of skipped steps carries on."""
    fresh = init_loss_scale(trainer.cfg).replace(skipped=state.loss_scale.skipped)
    sharding = trainer.state_shardings.loss_scale
    return state.replace(loss_scale=jax.tree.map(jax.device_put, fresh, sharding))


def _model_fields(model: dict) -> dict:
    """A saved `model` group as the model it describes: fields it lacks (saved before they existed)
    at their defaults, and the arch's defaults resolved (tie_embeddings null, activation "")."""
    known = {f.name for f in fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in model.items() if k in known})
    return {**model, **asdict(m), "tie_embeddings": m.tied, "activation": m.mlp_activation}


def check_same_model(saved: dict, cfg: Config, step: int) -> None:
    """A checkpoint restores only into the model it was saved from (vocabulary padding aside)."""
    saved, now = _model_fields(saved), _model_fields(cfg.to_dict()["model"])
    for key, value in saved.items():
        if key not in MODEL_KEYS_FREE and now.get(key) != value:
            raise CheckpointError(f"checkpoint step {step} was saved with model.{key}={value!r}, "
                                  f"the config says {now.get(key)!r}")


DATA_KEYS = {"fingerprint": "data.path", "weights": "data.path", "tokenizer": "data.tokenizer", "seed": "data.seed",
             "valid_fraction": "data.valid_fraction"}


def check_same_data(saved: dict | None, now: dict | None, cfg: Config, step: int) -> None:
    """A resume continues on the data the checkpoint was trained on, unless data.allow_change=true:
    the corpora's content (fingerprint), the blend's weights, the tokenizer, the split seed and
    the held-out fraction. A blend and a single corpus differ in their fingerprints."""
    if not saved or not now or cfg.data.allow_change:
        return
    for item, key in DATA_KEYS.items():
        if item in saved and saved[item] != now.get(item):
            what = ("the token files differ" if item == "fingerprint" else
                    f"it was trained with the blend weights {_weights(saved[item])}, this run's are "
                    f"{_weights(now.get(item))}" if item == "weights" else
                    f"it was trained with {key}={saved[item]!r}, this run has {now.get(item)!r}")
            raise ConfigError(key, f"checkpoint step {step} was trained on other data: {what}; set "
                                   f"data.allow_change=true to go on with this data")


def _weights(shares) -> str:
    return "none (one corpus)" if shares is None else " ".join(f"{w:.4g}" for w in shares)


def all_finite(state) -> bool:
    """True when every leaf of the parameters and optimizer state is finite. One
    jitted program: with several processes, eager per-leaf reductions could be matched out of
    order across processes and hang."""
    return bool(jax.device_get(_finite((state.params, state.opt_state))))


_finite = jax.jit(loss_scale.all_finite)   # integer leaves (step counts) are finite by definition


__all__ = ["Checkpointer", "CheckpointError", "checkpoint_dir", "find_checkpoint", "verify", "write_manifest",
           "all_finite"]
