"""The config is discoverable: one source for every field's meaning (the schema's `doc` metadata)
feeds `python -m mtjax.config` and docs/config.md; `--print-config` prints the resolved config
as YAML without starting anything; an unknown key names the nearest known one.

Nothing here compiles: the commands run in-process up to argument parsing, and one subprocess
checks that `--print-config` imports no JAX.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import yaml

from mtjax import cli
from mtjax.config import ConfigError, load_config
from mtjax.commands import config as config_main
from mtjax.config import reference
from mtjax.config.load import from_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
ALL_KEYS = [f"{g}.{f.name}" for g, cls in reference.groups().items() for f in dataclasses.fields(cls)]


def test_every_field_has_a_meaning():
    for g, cls in reference.groups().items():
        assert reference.group_help(cls), g
        for f in dataclasses.fields(cls):
            meaning = f.metadata.get("help", "")
            assert meaning.strip() and "\n" not in meaning, f"{g}.{f.name} has no one-line meaning"


def test_docs_config_md_is_the_generated_reference():
    """docs/config.md lists every field of every group, with the schema's default and meaning;
    regenerate it with `python -m mtjax.config --markdown > docs/config.md`."""
    with open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8") as f:
        text = f.read()
    missing = [k for k in ALL_KEYS if f"| `{k}` |" not in text]
    assert not missing, f"docs/config.md lacks {missing}; regenerate it with python -m mtjax.config --markdown"
    assert text == reference.markdown(), \
        "docs/config.md differs from the schema: python -m mtjax.config --markdown > docs/config.md"


def test_listing_names_every_field_with_its_default(capsys):
    assert cli.report(config_main.main, []) == 0
    out = capsys.readouterr().out
    for row in (r for g in reference.groups() for r in reference.fields(g)):
        assert f"{row.key} = {row.default} " in out and row.help in out, row.key
    assert "train.steps = 100 " in out and 'data.path = "" ' in out and "model.tie_embeddings = null " in out


def test_listing_of_one_group_and_a_wrong_group(capsys):
    assert cli.report(config_main.main, ["optim"]) == 0
    out = capsys.readouterr().out
    assert "optim.lr = 0.001 " in out and "model." not in out
    assert cli.report(config_main.main, ["optimm"]) == 2
    assert capsys.readouterr().err == "error: optimm: unknown config group; did you mean optim?\n"


def test_markdown_of_chosen_groups_whole_descriptions_and_each_group_once(capsys):
    """--markdown with GROUPs prints their tables only (an unknown one is one line, exit 2); a
    group's description is its docstring's whole first paragraph; a group named twice, once."""
    assert cli.report(config_main.main, ["--markdown", "optim"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## `optim`") and "`optim.lr`" in out and "## `model`" not in out
    assert cli.report(config_main.main, ["--markdown", "optimm"]) == 2
    assert capsys.readouterr().err == "error: optimm: unknown config group; did you mean optim?\n"
    assert cli.report(config_main.main, ["parallel", "parallel"]) == 0
    out = capsys.readouterr().out
    assert out.count("parallel.tensor = ") == 1 and "the tensor grid." in out.splitlines()[0]


def test_one_field_is_listed_alone_and_a_wrong_one_names_the_nearest(capsys):
    """`python -m mtjax.config model.num_layers`: its group's line and that field's, nothing else;
    a group named whole beside one of its fields lists it whole; a misspelt field suggests."""
    assert cli.report(config_main.main, ["optim.lr", "train.steps", "optim.min_lr"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" = ")[0].strip() for line in lines if " = " in line] == ["optim.lr", "optim.min_lr",
                                                                                 "train.steps"]
    assert cli.report(config_main.main, ["optim.lr", "optim"]) == 0
    assert capsys.readouterr().out == reference.listing(["optim"])
    assert cli.report(config_main.main, ["--markdown", "optim.lr"]) == 0
    assert capsys.readouterr().out.count("| `optim.") == 1
    assert cli.report(config_main.main, ["optim.lrr"]) == 2
    assert capsys.readouterr().err == "error: optim.lrr: unknown field of optim; did you mean optim.lr?\n"
    assert cli.report(config_main.main, [""]) == 2
    assert capsys.readouterr().err == "error: '': unknown config group\n"
    # a field named without its group names the group; a removed key says so, as loading does
    assert cli.report(config_main.main, ["global_batch"]) == 2
    assert capsys.readouterr().err == "error: global_batch: unknown config group; did you mean train.global_batch?\n"
    assert cli.report(config_main.main, ["train.state_layout"]) == 2
    assert capsys.readouterr().err.startswith("error: train.state_layout: was removed: ")


@pytest.mark.parametrize("key", ["train.foo", "train.zzzzzz", "train.setps", "model.layers", "optim.lrr"])
def test_a_wrong_field_gets_the_guess_loading_gives(capsys, key):
    """`python -m mtjax.config train.foo` guesses as `train.foo=1` in a run does: the field's name
    against its group's fields, so the shared `train.` prefix alone suggests nothing (it used to
    suggest train.init_from)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{key}=1"])
    hint = str(info.value).partition("unknown key")[2]
    assert cli.report(config_main.main, [key]) == 2
    assert capsys.readouterr().err == f"error: {key}: unknown field of {key.split('.')[0]}{hint}\n"


def test_search_lists_the_fields_whose_name_or_meaning_holds_a_word(capsys):
    """`--search WORD` (any case) keeps the fields whose key or meaning holds it, within the
    groups named; nothing found is one line, status 2; a bare word that is no group points to it."""
    assert cli.report(config_main.main, ["--search", "DROPOUT"]) == 0
    keys = [line.split(" = ")[0].strip() for line in capsys.readouterr().out.splitlines() if " = " in line]
    assert {"model.dropout", "model.attention_dropout", "parallel.sequence_parallel"} <= set(keys)
    assert "model.arch" not in keys
    assert cli.report(config_main.main, ["train", "--search", "interval"]) == 0
    assert [line.split(" = ")[0].strip() for line in capsys.readouterr().out.splitlines() if " = " in line] == \
        ["train.log_interval", "train.eval_interval"]
    assert cli.report(config_main.main, ["--markdown", "--search", "interval"]) == 0
    out = capsys.readouterr().out
    assert "`checkpoint.interval`" in out and "`train.log_interval`" in out and "## `model`" not in out
    assert cli.report(config_main.main, ["optim", "--search", "zzz"]) == 2
    assert capsys.readouterr().err == "error: --search: no field's name or meaning holds 'zzz' in optim\n"
    assert cli.report(config_main.main, ["scale"]) == 2
    assert capsys.readouterr().err == ("error: scale: unknown config group; --search scale lists the fields whose "
                                       "name or meaning holds it\n")


def test_help_points_to_the_field_reference(capsys):
    """`--help` of the commands that take overrides says where the fields are listed."""
    from mtjax import train
    with pytest.raises(SystemExit) as info:
        train.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0 and "(data, pipe, context, tensor) mesh" in out
    assert "`python -m mtjax.config [GROUP | GROUP.FIELD]` lists the fields" in out and "--config FILE" in out


# ---------------------------------------------------------------- did you mean

@pytest.mark.parametrize("override,message", [
    ("train.setps=10", "train.setps: unknown key; did you mean train.steps?"),
    ("model.hiden_size=8", "model.hiden_size: unknown key; did you mean model.hidden_size?"),
    ("parallel.sequence_paralel=true",
     "parallel.sequence_paralel: unknown key; did you mean parallel.sequence_parallel?"),
    ("modle.hidden_size=64", "modle: unknown config group; did you mean model?"),
    ("train.zzzzzz=1", "train.zzzzzz: unknown key"),           # nothing near: no guess
])
def test_unknown_key_names_the_nearest(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value) == message


def test_unknown_key_in_a_yaml_file_names_the_nearest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\n  global_bach: 8\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == "train.global_bach: unknown key; did you mean train.global_batch?"
    path.write_text("optimizer:\n  lr: 0.1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == "optimizer: unknown config group; did you mean optim?"


# ---------------------------------------------------------------- --print-config

def printed_config(main, argv, capsys, text=False):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    return out if text else yaml.safe_load(out)


@pytest.mark.parametrize("overrides", [
    [],
    ["train.steps=7", "parallel.tensor=2", "model.tie_embeddings=false", "optim.eps=1e-6"],
    ["data.path=0.7 data/web 0.3 data/code", "data.valid_path=data/held_out"],
])
def test_print_config_is_the_loaded_config(capsys, tmp_path, overrides):
    """Every group and field printed; the YAML is a config file that loads back to the same Config."""
    from mtjax import train
    printed = printed_config(train.main, ["--config", TINY, "--print-config", *overrides], capsys, text=True)
    raw = yaml.safe_load(printed)
    assert {g: set(v) for g, v in raw.items()} == \
        {g: {f.name for f in dataclasses.fields(cls)} for g, cls in reference.groups().items()}
    assert from_dict(raw) == load_config(TINY, overrides)
    (tmp_path / "printed.yaml").write_text(printed, encoding="utf-8")
    assert load_config(str(tmp_path / "printed.yaml")) == load_config(TINY, overrides)


@pytest.mark.parametrize("overrides,devices,micro_batch", [
    (["parallel.data=2"], 2, 2),                            # b = B/(m d) = 16/(4*2), not the unused 4
    (["parallel.data=-1"], 4, None),                        # b follows the devices: left out, derived again
    (["parallel.data=2", "train.micro_batch=2"], 2, 2),     # written (and agreeing): as written
])
def test_print_config_with_micro_batches_prints_the_micro_batch_the_run_uses(capsys, tmp_path, overrides, devices,
                                                                             micro_batch):
    """With train.micro_batches set, the printed train.micro_batch is the b the run uses (or is
    absent where the devices decide it); the print loads back, with every key now written, to a
    config that validates and splits the batch as the given one does."""
    from mtjax import train
    from mtjax.config import validate
    from mtjax.config.validate import batch_split
    overrides = ["train.global_batch=16", "train.micro_batches=4", *overrides]
    printed = printed_config(train.main, ["--print-config", "--cpu-devices", str(devices), *overrides], capsys,
                             text=True)
    assert yaml.safe_load(printed)["train"].get("micro_batch") == micro_batch
    (tmp_path / "printed.yaml").write_text(printed, encoding="utf-8")
    again, given = load_config(str(tmp_path / "printed.yaml")), load_config(None, overrides)
    d = validate(given, devices)[0]
    assert validate(again, devices)[0] == d and batch_split(again, d) == batch_split(given, d) == (16 // (4 * d), 4)


def test_a_micro_batch_written_beside_micro_batches_is_one_line_and_status_2(capsys, tmp_path):
    """A config file's micro_batch at the default 4 beside disagreeing micro_batches: refused as
    any other value is, naming both fields, before anything is printed."""
    from mtjax import train
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  global_batch: 16\n  micro_batch: 4\n  micro_batches: 2\n", encoding="utf-8")
    assert cli.report(train.main, ["--config", str(path), "--print-config", "parallel.data=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("error: train.micro_batch: 4 as written disagrees with train.micro_batches 2"), \
        captured.err


def test_print_config_in_inspect_and_its_errors(capsys):
    from mtjax import inspect
    raw = printed_config(inspect.main, ["--print-config", "train.seed=3"], capsys)
    assert from_dict(raw) == load_config(None, ["train.seed=3"])
    assert cli.report(inspect.main, ["--print-config", "train.setps=3"]) == 2
    assert capsys.readouterr().err == "error: train.setps: unknown key; did you mean train.steps?\n"


def test_print_config_starts_no_jax():
    code = ("import sys, runpy; sys.argv = ['mtjax.train', '--config', sys.argv[1], '--print-config']\n"
            "try:\n    runpy.run_module('mtjax.train', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'jax' not in sys.modules, 'jax was imported'\n")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code, TINY], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["train"]["run_dir"] == "runs/tiny"


@pytest.mark.parametrize("override,line", [
    ("model.num_layers=0", "error: model.num_layers: "),
    ("train.global_batch=3", "error: train.global_batch: "),
    ("parallel.tensor=3", "error: "),                  # 4 heads do not split 3 ways
    ("train.run_dir=", "error: train.run_dir: must not be empty"),     # no machine could write there
    ("data.cache_dir=", "error: data.cache_dir: must not be empty"),
    ("distributed.process_id=-5", "error: distributed.process_id: "),       # checked as the run joins its job
    ("--cpu-devices=0", "error: --cpu-devices: must be in [1, "),             # the command line no run takes
    ("--cpu-devices=8", "error: train.global_batch: global_batch 16 is not divisible by micro_batch*data = 4*8 "
                        "(data 8: parallel.data=-1 takes the devices pipe, context and tensor leave); "
                        "train.micro_batch=2 would fit"),
])
def test_print_config_refuses_what_a_run_would(capsys, override, line):
    """A config no run could start is one line and status 2, not printed; the data files and
    run directories are not checked (the config may be meant for another machine)."""
    from mtjax import train
    assert cli.report(train.main, ["--config", TINY, "--print-config", override]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(line) and captured.err.count("\n") == 1, captured


def test_print_config_checks_the_devices_the_command_line_names(capsys):
    """`--cpu-devices N` (or inspect's `--gpus N`) says how many devices the run has: data -1 is
    resolved against them, as the run does, not counted as 1."""
    from mtjax import inspect, train
    raw = printed_config(train.main, ["--config", TINY, "--cpu-devices", "8", "parallel.tensor=2", "--print-config"],
                         capsys)
    assert raw["parallel"]["data"] == -1
    assert cli.report(inspect.main, ["--print-config", "--target", "h100", "--gpus", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: train.global_batch: global_batch 16 is not divisible by "
                                              "micro_batch*data = 4*3")


def test_print_config_with_json_prints_json(capsys):
    from mtjax import inspect
    printed = printed_config(inspect.main, ["--json", "--print-config", "train.seed=3"], capsys, text=True)
    assert from_dict(json.loads(printed)) == load_config(None, ["train.seed=3"])


@pytest.mark.parametrize("argv,line", [
    (["--gpus", "8"], "error: --gpus: needs --target\n"),
    (["--gpus", "0", "--target", "h100"], "error: --gpus: must be in [1, 4096], got 0\n"),
    (["--target", "h100", "--cpu-devices", "2"],
     "error: --cpu-devices: cannot be combined with --target (the devices are the target's GPUs)\n"),
])
def test_print_config_in_inspect_refuses_what_inspect_would(capsys, argv, line):
    """inspect's own options are checked before --print-config prints: `--gpus` counts a
    target's GPUs, so without `--target` no inspect run takes it."""
    from mtjax import inspect
    assert cli.report(inspect.main, ["--print-config", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == line, captured


def test_the_layout_line_counts_its_devices_in_words():
    from mtjax.training.metrics import devices_text
    assert devices_text(1, "cpu") == "1 cpu device"
    assert devices_text(8, "cpu") == "8 cpu devices"
    assert devices_text(1, "cpu", "h100") == "1 h100 GPU (compile-only)"
    assert devices_text(16, "cpu", "h100") == "16 h100 GPUs (compile-only)"
