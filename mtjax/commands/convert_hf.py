"""from-hf and to-hf: the two conversions, each complete or invisible.

Everything that can be refused (config.json, the weight files, every tensor's name, dtype and
shape, the output path) is checked before anything is written; the output is then built in a
staging directory beside `out` and renamed to `out` at the end (`mtjax.staging`), so a failure,
a fault or an interrupt leaves nothing, and a kill -9's leftovers are swept by the next run.
"""
from __future__ import annotations

import dataclasses
import json
import os

import yaml

from mtjax.cli_checks import output_path
from mtjax.checkpoint.compat import CARRIED_META
from mtjax.config.errors import ConfigError
from mtjax.config.schema import Config, DataConfig, TrainConfig
from mtjax.convert import hf_config, hf_families, hf_moe, tokenizer_files, weights
from mtjax.convert.safetensors_io import WEIGHTS, read_tensors, write_tensors
from mtjax.data.errors import DataError, one_line
from mtjax.staging import staged, sweep

CONFIG_YAML = "config.yaml"
SOURCE_FAMILY, SOURCE_WINDOW = CARRIED_META  # the meta entries from-hf writes: the family it converted, its window


def check_out(out: str) -> str:
    """`out` as an absolute path, if it can be created (`cli_checks.output_path`: not there, or
    an empty directory; a writable parent). What a killed conversion left beside it is swept
    first, even if `out` is then refused (one killed between its rename and its unlock)."""
    if out.strip():
        sweep(os.path.abspath(out))
    return output_path("--out", out, empty_dir_ok=True)


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise DataError(f"{hf_dir}: {'not a directory' if os.path.exists(hf_dir) else 'no such directory'}")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except (OSError, ValueError, RecursionError) as e:     # RecursionError: nested too deeply
        raise DataError(f"{path}: not readable JSON ({one_line(e)})") from None
    if not isinstance(hf, dict):
        raise DataError(f"{path}: must hold a JSON object")
    return hf


def from_hf(hf_dir: str, out: str, seq_len: int | None = None) -> Config:
    """A Hugging Face model directory -> `out`/checkpoints/0 (an mtjax checkpoint at step 0) and
    `out`/config.yaml (its `model` group, and `train.run_dir: out`, so that training resumes from
    it). `seq_len` sets model.seq_len of a rotary model (default: max_position_embeddings).
    Returns the Config. ConfigError or DataError, with nothing written, when it cannot convert."""
    from mtjax.convert.checkpoints import model_leaf_shapes, one_device_trainer, save_params
    full = check_out(out)
    hf = read_hf_config(hf_dir)
    model = hf_config.read_model(hf, os.path.join(hf_dir, "config.json"), seq_len)
    tokenizer_files.check_source_token_ids(hf, os.path.join(hf_dir, "config.json"))
    tokenizer_files.check_hf_tokenizer(hf_dir)
    cfg = Config(model=model, train=TrainConfig(run_dir=full),
                 data=DataConfig(tokenizer=tokenizer_files.run_tokenizer(hf_dir, full)))
    family, tied = hf_families.hf_family(hf), model.tied
    tensors, source = read_tensors(hf_dir)
    trainer = one_device_trainer(cfg, model.vocab_size)
    shapes = hf_moe.flat_shapes(model_leaf_shapes(trainer), model)    # per layer kind when mixed
    covered = weights.covered(family, tied, hf_moe.mixed(model))
    if covered != set(shapes):
        raise RuntimeError(f"the {family} table and mtjax's model disagree on {sorted(covered ^ set(shapes))}")
    leaves = hf_moe.to_tree(weights.to_leaves(tensors, family, tied, model.num_layers, shapes, model.vocab_size,
                                              source, model, hf_families.unbuilt_tensors(hf, family)), model)
    del tensors
    window = hf_config.recorded_window(hf)
    meta = {tokenizer_files.SOURCE_IDS: tokenizer_files.source_token_ids(hf), SOURCE_FAMILY: family,
            **({SOURCE_WINDOW: window} if window else {})}
    with staged(full, "--out") as tmp:
        save_params(trainer, leaves, os.path.join(tmp, "checkpoints"), meta=meta)
        tokenizer_files.copy_from_hf(hf_dir, tmp)
        _write_config_yaml(os.path.join(tmp, CONFIG_YAML), cfg, hf_dir, out)
    return cfg


def _write_config_yaml(path: str, cfg: Config, hf_dir: str, out: str) -> None:
    body = {"model": dataclasses.asdict(cfg.model), "train": {"run_dir": cfg.train.run_dir},
            **tokenizer_files.data_group(cfg.data)}
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# python -m mtjax.train --config {os.path.join(out, CONFIG_YAML)} data.path=PREFIX"
                f"{tokenizer_files.train_hint(cfg.data)}\n"
                f"# Converted from {os.path.abspath(hf_dir)} by `python -m mtjax.convert from-hf`. Training resumes\n"
                "# from the step-0 checkpoint in train.run_dir; give it data made with the model's tokenizer.\n")
        yaml.safe_dump(body, f, sort_keys=False)


def to_hf(checkpoint: str, out: str, family: str = "") -> dict:
    """An mtjax checkpoint (a step directory, a directory of steps, or a run directory) ->
    `out`/config.json and `out`/model.safetensors (fp32, the vocabulary padding cut, no output
    layer when it is tied), which transformers' from_pretrained loads, and the run's tokenizer
    files (`tokenizer_files.copy_to_hf`). `family` (--family): the transformers family to write
    (`hf_config.model_family`); by default the one a conversion not trained since came from, where
    it can express the model, else the one the model's fields imply. Returns config.json."""
    from mtjax.convert.checkpoints import load_params
    full = check_out(out)
    cfg, vocab, leaves, meta = load_params(checkpoint)
    tokenizer_files.check_run_tokenizer(cfg.data)
    m = cfg.model
    config = hf_config.hf_config(m, vocab, tokenizer_files.token_ids(cfg.data, meta),
                                 family or _recorded_family(m, meta), meta.get(SOURCE_WINDOW))
    # (model_type names the family, as `hf_families` does)
    tensors = weights.from_leaves(hf_moe.to_flat(leaves, m), config["model_type"], m.tied, m.num_layers, vocab, m)
    with staged(full, "--out") as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        write_tensors(os.path.join(tmp, WEIGHTS), tensors)
        tokenizer_files.copy_to_hf(cfg.data, tmp)
    return config


def _recorded_family(m, meta: dict) -> str:
    """The family from-hf recorded in the checkpoint's meta (from-hf's step 0, carried on by the
    checkpoints trained from it: `checkpoint.compat.carried`), where it can express `m`; else ""
    (the fields decide)."""
    recorded = meta.get(SOURCE_FAMILY)
    try:
        return hf_config.model_family(m, recorded) if isinstance(recorded, str) else ""
    except ConfigError:
        return ""
