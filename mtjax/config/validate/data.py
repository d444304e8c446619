"""The `data` group and the run's paths: data files and the tokenizer exist, every directory the
run writes is (or can be made) a writable directory, checked before the data is opened."""
from __future__ import annotations

import os

from mtjax.config.data_path import corpora, entry_key
from mtjax.config.schema import Config
from mtjax.config.validate.common import check, no_effect


def validate_data(cfg: Config) -> None:
    dc = cfg.data
    check(dc.seed >= 0, "data.seed", f"must be >= 0, got {dc.seed}")
    check(cfg.train.seed >= 0, "train.seed", f"must be >= 0, got {cfg.train.seed}")
    check(0.0 <= dc.valid_fraction < 1.0, "data.valid_fraction", f"must be in [0, 1), got {dc.valid_fraction}")
    if dc.valid_path:   # validation reads valid_path, and nothing is held out of data.path
        no_effect(dc.valid_fraction == type(dc).valid_fraction, "data.valid_fraction",
                  f"valid_fraction = {dc.valid_fraction}", "data.valid_path empty (valid_path is the validation set)")
    if dc.eod_mask_loss:    # document masking already drops the loss after every EOD input
        no_effect(not dc.document_masking, "data.eod_mask_loss", "true", "data.document_masking=false "
                  "(document masking already drops the loss where the input is the end-of-document token)")
    if dc.tokenizer == "byte":      # the byte tokenizer's ids are fixed: EOD is 256, and it has no BOS
        for key, value in (("data.eod_token", dc.eod_token), ("data.bos_token", dc.bos_token)):
            check(not value, key, f"the byte tokenizer's ids are fixed (EOD 256, no BOS): {value!r} cannot be set")
        check(not dc.add_bos, "data.add_bos", "the byte tokenizer has no beginning-of-document token")
    for path, key in _written_dirs(cfg):    # a name no machine could write to: --print-config refuses it too
        _well_named(path, key)


def _written_dirs(cfg: Config) -> list[tuple[str, str]]:
    """(path, key) of every directory the run writes: the run's, the checkpoints' (when set), and
    the cache where the default corpus is built."""
    dirs = [(cfg.train.run_dir, "train.run_dir")]
    if cfg.checkpoint.enabled and cfg.checkpoint.dir:
        dirs.append((cfg.checkpoint.dir, "checkpoint.dir"))
    if not cfg.data.path:
        dirs.append((cfg.data.cache_dir, "data.cache_dir"))
    return dirs


def _well_named(path: str, key: str) -> None:
    check(bool(path.strip()), key, "must not be empty")
    check(_utf8(path), key, f"{path!r} is not valid UTF-8 (orbax and TensorBoard need UTF-8 paths)")


def _writable_dir(path: str, key: str) -> None:
    """`path` is, or can be made, a directory this process can write: it is not a file, and its
    nearest existing ancestor is a writable directory (checked now: later it would be a traceback
    after the data has been opened)."""
    _well_named(path, key)
    full = os.path.abspath(path)
    if os.path.exists(full):
        check(os.path.isdir(full), key, f"{path} exists and is not a directory")
        check(os.access(full, os.W_OK | os.X_OK), key, f"{path} is not writable")
        return
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    check(os.path.isdir(parent), key, f"cannot create {path}: {parent} is a file, not a directory")
    check(os.access(parent, os.W_OK | os.X_OK), key, f"cannot create {path}: {parent} is not writable")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:      # undecodable bytes of a command line arrive as lone surrogates
        return False
    return True


def _step_dir(path: str) -> bool:
    """An mtjax checkpoint step: `<step>/state` (as `checkpoint/policy.py` finds one)."""
    return os.path.basename(path).isdigit() and os.path.isdir(os.path.join(path, "state"))


def _not_in_checkpoints(cfg: Config) -> None:
    """The run's directories are not another run's checkpoints: files written into a step
    directory (tb/, checkpoints/) leave it failing its manifest, so that its run's next resume
    moves it aside as damaged; a run directory that holds steps is a checkpoints directory,
    which `mtjax.load` would then read as this run's directory (its `checkpoints/`)."""
    dirs = _written_dirs(cfg)[:2 if cfg.checkpoint.enabled and cfg.checkpoint.dir else 1]
    for path, key in dirs:
        at = os.path.abspath(path)
        while True:
            where = "a checkpoint step" if at == os.path.abspath(path) else f"inside the checkpoint step {at}"
            check(not _step_dir(at), key, f"{path} is {where}: name a directory of its own")
            at, child = os.path.dirname(at), at
            if at == child:
                break
    run = os.path.abspath(cfg.train.run_dir)
    own = cfg.checkpoint.enabled and cfg.checkpoint.dir and os.path.abspath(cfg.checkpoint.dir) == run
    steps = sorted(n for n in os.listdir(run) if _step_dir(os.path.join(run, n))) if os.path.isdir(run) else []
    check(own or not steps, "train.run_dir", f"{cfg.train.run_dir} holds checkpoint step {steps[0] if steps else ''}: "
                                             "it is a run's checkpoints directory; name its run directory or a new one")


# what a run writes inside train.run_dir: (name, must be a directory)
RUN_DIR_ENTRIES = (("config.json", False), ("metrics.jsonl", False), ("tb", True))


def validate_data_files(cfg: Config) -> None:
    """The files the run reads exist on this machine: the corpora and the tokenizer."""
    dc = cfg.data
    for key, value in (("data.path", dc.path), ("data.valid_path", dc.valid_path)):
        for i, corpus in enumerate(corpora(value)):
            for ext in (".bin", ".idx"):
                check(os.path.isfile(corpus.path + ext), entry_key(key, value, i),
                      f"missing data file {corpus.path + ext}")
    if dc.tokenizer != "byte":
        check(os.path.isfile(dc.tokenizer), "data.tokenizer",
              f"must be 'byte' or a tokenizer.json file; {dc.tokenizer} not found")


def validate_paths(cfg: Config) -> None:
    """Every directory the run writes, and what it writes inside the run directory."""
    for path, key in _written_dirs(cfg):     # (sample indices are cached in data.cache_dir too)
        _writable_dir(path, key)
    _not_in_checkpoints(cfg)
    for name, is_dir in RUN_DIR_ENTRIES:
        path = os.path.join(cfg.train.run_dir, name)
        check(not os.path.exists(path) or os.path.isdir(path) == is_dir, "train.run_dir",
              f"{path} exists and is {'not ' if is_dir else ''}a directory")
    if cfg.data.path and cfg.data.cache_dir:
        check(not os.path.exists(cfg.data.cache_dir) or os.path.isdir(cfg.data.cache_dir), "data.cache_dir",
              f"{cfg.data.cache_dir} exists and is not a directory")
