"""Tests for mtjax.config: YAML with a base file, dotted overrides, strict types, one validation pass.

Everything runs in-process; `validate(cfg, num_devices)` gets explicit device
counts, so no test depends on how many devices JAX was started with. Every
error must be a ConfigError whose `key` and message name the offending key.
"""

import dataclasses
import glob
import os

import pytest

from mtjax.config import Config, ConfigError, ModelConfig, load_config, validate
from mtjax.config.load import parse_override, to_yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
BASE = os.path.join(REPO, "configs", "base.yaml")


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def config_error(key, fn, *args):
    """Run fn(*args), expect a ConfigError for `key`; returns its one-line message."""
    with pytest.raises(ConfigError) as info:
        fn(*args)
    msg = str(info.value)
    assert info.value.key == key
    assert msg.startswith(f"{key}: ")
    assert "\n" not in msg
    return msg


def invalid(key, overrides, num_devices=1):
    """The message of the ConfigError that validating the overridden defaults raises for `key`."""
    cfg = load_config(None, overrides)
    return config_error(key, validate, cfg, num_devices)


# ---------------------------------------------------------------- loading

def test_defaults_load_and_validate():
    cfg = load_config(None)
    assert cfg == Config()
    assert validate(cfg, 1) == (1, 1, 1)


def test_shipped_configs_load_and_validate():
    base, tiny = load_config(BASE), load_config(TINY)
    assert validate(base, 1) == (1, 1, 1)
    assert validate(tiny, 1) == (1, 1, 1)
    assert tiny.model.hidden_size == 128 and tiny.train.run_dir == "runs/tiny"   # from tiny.yaml
    assert tiny.optim == base.optim and tiny.data == base.data                   # groups tiny does not name


def test_base_overrides_group_by_group(tmp_path):
    write(tmp_path / "base.yaml", "model:\n  hidden_size: 32\n  num_heads: 2\ntrain:\n  steps: 5\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\nmodel:\n  num_heads: 8\n")
    cfg = load_config(child)
    assert cfg.model == ModelConfig(hidden_size=32, num_heads=8)   # merged within the group
    assert cfg.train.steps == 5                                     # group only the base names
    assert cfg.optim == Config().optim                              # group neither names


def test_nested_base_chain_resolves_relative_to_each_file(tmp_path):
    write(tmp_path / "sub" / "root.yaml", "model:\n  hidden_size: 32\n  num_heads: 2\ntrain:\n  steps: 5\n")
    write(tmp_path / "sub" / "mid.yaml", "base: root.yaml\nmodel:\n  num_heads: 4\noptim:\n  lr: 0.002\n")
    child = write(tmp_path / "child.yaml", "base: sub/mid.yaml\ntrain:\n  steps: 7\n")
    cfg = load_config(child)
    assert (cfg.model.hidden_size, cfg.model.num_heads) == (32, 4)
    assert cfg.optim.lr == 0.002
    assert cfg.train.steps == 7
    assert cfg.train.global_batch == Config().train.global_batch


def test_overrides_beat_files(tmp_path):
    path = write(tmp_path / "c.yaml", f"base: {TINY}\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["train.steps=9", "model.num_layers=3"])
    assert cfg.train.steps == 9 and cfg.model.num_layers == 3
    assert cfg.model.hidden_size == 128


@pytest.mark.parametrize("chain", [{"a.yaml": "a.yaml"},
                                   {"a.yaml": "b.yaml", "b.yaml": "c.yaml", "c.yaml": "a.yaml"}])
def test_circular_base_chain(tmp_path, chain):
    for name, base in chain.items():
        write(tmp_path / name, f"base: {base}\ntrain:\n  steps: 3\n")
    assert "circular" in config_error("base", load_config, str(tmp_path / "a.yaml"))


def test_override_values_are_yaml_scalars():
    assert parse_override("parallel.tensor=2") == ("parallel", "tensor", 2)
    assert parse_override("parallel.sequence_parallel=true") == ("parallel", "sequence_parallel", True)
    assert parse_override("parallel.data=-1") == ("parallel", "data", -1)
    assert parse_override("data.path=") == ("data", "path", "")
    cfg = load_config(None, ["parallel.tensor=2", "parallel.sequence_parallel=true", "optim.lr=0.0003",
                             "model.dropout=1", "data.tokenizer=byte"])
    assert cfg.parallel.tensor == 2 and type(cfg.parallel.tensor) is int
    assert cfg.parallel.sequence_parallel is True
    assert cfg.optim.lr == 0.0003
    assert cfg.model.dropout == 1.0 and type(cfg.model.dropout) is float   # int widens to float
    assert cfg.data.tokenizer == "byte"


@pytest.mark.parametrize("text", ["3e-4", "3E-4", "1e3"])
def test_exponent_floats_without_a_dot(tmp_path, text):
    # YAML 1.1 (PyYAML) reads "3e-4" as a string; a float field must still accept it,
    # from an override and from a file alike.
    assert load_config(None, [f"optim.lr={text}"]).optim.lr == float(text)
    path = write(tmp_path / "c.yaml", f"optim:\n  lr: {text}\n")
    assert load_config(path).optim.lr == float(text)


def test_config_is_frozen():
    cfg = load_config(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden_size = 1


# ---------------------------------------------------------------- load errors

@pytest.mark.parametrize("override,key", [
    ("model.hidden=64", "model.hidden"),
    ("train.stepz=3", "train.stepz"),
    ("modle.hidden_size=64", "modle"),
])
def test_unknown_key_or_group(override, key):
    msg = config_error(key, load_config, None, [override])
    assert "unknown" in msg


@pytest.mark.parametrize("value", ["megatron", "lean"])
def test_a_removed_key_says_it_was_removed(tmp_path, value):
    """train.state_layout (Megatron's persistent buffers) is gone: from a file or an override, one
    line that names it and says so, not 'unknown key'."""
    msg = config_error("train.state_layout", load_config, None, [f"train.state_layout={value}"])
    assert "was removed" in msg
    path = write(tmp_path / "c.yaml", f"train:\n  state_layout: {value}\n")
    assert "was removed" in config_error("train.state_layout", load_config, path)


def test_unknown_key_in_file(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  hidden_size: 64\n  hiden_size: 32\n")
    assert "unknown key" in config_error("model.hiden_size", load_config, path)


@pytest.mark.parametrize("override,key,expected", [
    ("model.hidden_size=abc", "model.hidden_size", "int"),      # string for int
    ("model.num_layers=2.5", "model.num_layers", "int"),        # float for int
    ("model.num_layers=true", "model.num_layers", "int"),       # bool for int
    ("model.tie_embeddings=1", "model.tie_embeddings", "bool"),  # int for bool
    ("model.dropout=high", "model.dropout", "float"),           # string for float
    ("model.dropout=false", "model.dropout", "float"),          # bool for float
    ("model.arch=[gpt]", "model.arch", "str"),                   # list for str
])
def test_wrong_type(override, key, expected):
    assert f"expected {expected}" in config_error(key, load_config, None, [override])


@pytest.mark.parametrize("override,key", [("model", "model"), ("model.hidden_size", "model.hidden_size"),
                                          ("hidden_size=64", "hidden_size"), ("a.b.c=1", "a.b.c"),
                                          ("=64", "'=64'"), (" =1", "' =1'"),    # no key: the whole text
                                          ("", "''"), (" ", "' '")])        # was no key, or ' : ...'
def test_malformed_override(override, key):
    config_error(key, load_config, None, [override])


def test_group_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path / "c.yaml", "model: 64\n")
    config_error("model", load_config, path)
    config_error("model", load_config, path, ["model.hidden_size=64"])


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert path in config_error("--config", load_config, path)


def test_missing_base_file(tmp_path):
    # the problem is the `base:` key of c.yaml, not the --config file, which exists
    path = write(tmp_path / "c.yaml", "base: nope.yaml\n")
    msg = config_error("base", load_config, path)
    assert "nope.yaml" in msg and path in msg
    write(tmp_path / "bad.yaml", "- a list\n")
    assert "bad.yaml" in config_error("base", load_config, write(tmp_path / "d.yaml", "base: bad.yaml\n"))


@pytest.mark.parametrize("text,expect", [
    ("model:\n  hidden_size: [64\n", "malformed YAML"),
    ("model:\n  arch: gpt\n\thidden_size: 64\n", "malformed YAML"),
    ("- model\n- train\n", "mapping"),
    ("just a string\n", "mapping"),
    ("", "is empty"),                                     # as a failed `> c.yaml` leaves it: not the defaults
    ("# model:\n#   num_layers: 4\n", "is empty"),
    ("? [1, 2]\n: 3\n", "malformed YAML"),                # a key that is a list: no traceback
    ("model:\n  ? {a: 1}\n  : 2\n", "malformed YAML"),
])
def test_bad_yaml(tmp_path, text, expect):
    path = write(tmp_path / "c.yaml", text)
    msg = config_error("--config", load_config, path)
    assert expect in msg and path in msg


def test_yaml_merge_keys_are_read_and_keys_given_twice_refused(tmp_path):
    # `<<: *anchor` is YAML, not a key given twice: the mapping's own keys replace the merged ones
    path = write(tmp_path / "c.yaml", "model: &m\n  num_layers: 3\n  hidden_size: 32\n"
                                      "train:\n  <<: {steps: 3, seed: 2}\n  steps: 5\n")
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.train.seed, cfg.model.num_layers) == (5, 2, 3)
    twice = write(tmp_path / "d.yaml", "train:\n  <<: {seed: 2}\n  steps: 5\n  steps: 6\n")
    assert "'steps' twice" in config_error("--config", load_config, twice)


def test_unreadable_config(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00model: 1\n")
    config_error("--config", load_config, str(tmp_path / "bin.yaml"))
    config_error("--config", load_config, str(tmp_path))   # a directory


@pytest.mark.parametrize("base", ["3", "''", "' '"])
def test_base_must_be_a_path(tmp_path, base):
    path = write(tmp_path / "c.yaml", f"base: {base}\n")
    assert "must be a file path" in config_error("base", load_config, path)


# ---------------------------------------------------------------- validation errors

@pytest.mark.parametrize("override,key", [
    ("model.dropout=-0.1", "model.dropout"),
    ("model.attention_dropout=1.0", "model.attention_dropout"),
    ("optim.lr=0", "optim.lr"),
    ("optim.min_lr=0.01", "optim.min_lr"),
    ("model.hidden_size=0", "model.hidden_size"),
    ("model.num_kv_heads=-2", "model.num_kv_heads"),
    ("train.steps=0", "train.steps"),
    ("train.micro_batch=0", "train.micro_batch"),
    ("optim.beta2=1.0", "optim.beta2"),
    ("data.valid_fraction=1.0", "data.valid_fraction"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("data.seed=-1", "data.seed"),            # GPTDataset rejects it only after the corpus is built
    ("model.arch=bert", "model.arch"),
    ("parallel.schedule=zigzag", "parallel.schedule"),
    ("train.precision=fp8", "train.precision"),
    ("train.recompute=some", "train.recompute"),
    ("parallel.virtual_stages=2", "parallel.virtual_stages"),   # needs schedule=interleaved
])
def test_out_of_range(override, key):
    invalid(key, [override])


def test_hidden_not_divisible_by_heads():
    msg = invalid("model.hidden_size", ["model.hidden_size=64", "model.num_heads=3"])
    assert "64" in msg and "3" in msg


def test_heads_not_divisible_by_kv_heads():
    invalid("model.num_kv_heads", ["model.num_heads=4", "model.num_kv_heads=3", "model.hidden_size=48"])


def test_heads_not_divisible_by_tensor():
    msg = invalid("model.num_heads", ["parallel.tensor=3", "model.num_heads=4"], num_devices=3)
    assert "parallel.tensor 3" in msg


@pytest.mark.parametrize("overrides,words", [
    (["model.ffn_hidden_size=34"], "ffn size 34 is not divisible by parallel.tensor 3"),
    # f left at 0 (llama's 64 * round(8h / 3 / 64) = 128 for h = 48): the line says where 128 came from
    (["model.arch=llama"], "ffn size 128 (derived from hidden_size 48: the multiple of 64 nearest 8h/3) is not "
                           "divisible by parallel.tensor 3; set model.ffn_hidden_size to a multiple of 3"),
], ids=["set", "derived"])
def test_ffn_not_divisible_by_tensor(overrides, words):
    msg = invalid("model.ffn_hidden_size", ["parallel.tensor=3", "model.num_heads=6", "model.hidden_size=48",
                                            "train.global_batch=4", *overrides], num_devices=3)
    assert msg.endswith(words), msg


@pytest.mark.parametrize("heads,kv,tensor,ok", [
    (12, 4, 6, False),   # neither 4 | 6 nor 6 | 4
    (12, 3, 4, False),   # neither 3 | 4 nor 4 | 3
    (8, 2, 4, True),     # kv heads replicated over tensor
    (8, 4, 2, True),     # kv heads split over tensor
])
def test_kv_heads_vs_tensor(heads, kv, tensor, ok):
    overrides = [f"model.num_heads={heads}", f"model.num_kv_heads={kv}", f"model.hidden_size={8 * heads}",
                 f"parallel.tensor={tensor}", f"train.global_batch={4}", "train.micro_batch=4"]
    if ok:
        assert validate(load_config(None, overrides), tensor) == (1, 1, tensor)
    else:
        assert "one must divide the other" in invalid("model.num_kv_heads", overrides, num_devices=tensor)


@pytest.mark.parametrize("layers,pipe,virtual", [(2, 3, 1), (4, 2, 4), (6, 4, 1)])
def test_layers_not_divisible_by_pipe_times_virtual(layers, pipe, virtual):
    overrides = [f"model.num_layers={layers}", f"parallel.pipe={pipe}", f"parallel.virtual_stages={virtual}",
                 "parallel.schedule=interleaved", "train.global_batch=64", "train.micro_batch=1"]
    assert f"{pipe * virtual}" in invalid("model.num_layers", overrides, num_devices=pipe)


@pytest.mark.parametrize("schedule,virtual,most", [("zbv", 1, 2), ("interleaved", 2, 2), ("1f1b", 1, 4)])
def test_block_recomputation_stays_within_a_model_chunk(schedule, virtual, most):
    """N counts layers of one model chunk: l / (p v), and zbv's stage holds two chunks (a run of
    more recomputed rows than its chunk holds once computed another model)."""
    overrides = ["model.num_layers=8", "parallel.pipe=2", f"parallel.schedule={schedule}",
                 f"parallel.virtual_stages={virtual}", "train.recompute=block", "train.global_batch=8",
                 "train.micro_batch=1"]
    validate(load_config(None, [*overrides, f"train.recompute_layers={most}"]), 2)
    msg = invalid("train.recompute_layers", [*overrides, f"train.recompute_layers={most + 1}"], num_devices=2)
    assert f"<= {most}" in msg


def test_virtual_stages_zero_is_a_config_error():
    invalid("parallel.virtual_stages", ["parallel.virtual_stages=0", "parallel.schedule=interleaved"])


@pytest.mark.parametrize("global_batch,micro,devices", [(16, 3, 1), (16, 4, 8), (12, 2, 4)])
def test_global_batch_not_divisible(global_batch, micro, devices):
    overrides = [f"train.global_batch={global_batch}", f"train.micro_batch={micro}"]
    msg = invalid("train.global_batch", overrides, num_devices=devices)
    assert f"{micro}*{devices}" in msg


def test_too_few_micro_batches_for_the_pipeline():
    overrides = ["parallel.pipe=2", "train.global_batch=4", "train.micro_batch=4"]
    invalid("train.global_batch", overrides, num_devices=2)
    # m given as train.micro_batches is named as that (it named train.global_batch, which fits)
    invalid("train.micro_batches", ["parallel.pipe=2", "train.global_batch=4", "train.micro_batches=1"], num_devices=2)
    invalid("train.micro_batches", ["parallel.pipe=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                    "model.num_layers=4", "train.global_batch=6", "train.micro_batches=3"], num_devices=2)


def test_mesh_size_must_equal_device_count():
    msg = invalid("parallel", ["parallel.data=2", "parallel.tensor=2"], num_devices=8)
    assert "2*1*2 = 4" in msg and "8 devices" in msg
    invalid("parallel", ["parallel.data=4"], num_devices=2)
    invalid("parallel.data", ["parallel.tensor=3"], num_devices=8)   # -1 cannot fill 8 devices


def test_mesh_resolves_data_axis():
    cfg = load_config(None, ["parallel.tensor=2", "parallel.pipe=2", "train.global_batch=8", "train.micro_batch=2"])
    assert validate(cfg, 8) == (2, 2, 2)


def test_sequence_parallel_needs_seq_len_divisible_by_tensor():
    overrides = ["parallel.tensor=4", "parallel.sequence_parallel=true", "model.seq_len=66"]
    invalid("model.seq_len", overrides + ["train.global_batch=4"], num_devices=4)


def test_missing_data_files(tmp_path):
    prefix = tmp_path / "corpus"
    msg = invalid("data.path", [f"data.path={prefix}"])
    assert f"{prefix}.bin" in msg
    (tmp_path / "corpus.bin").write_bytes(b"")
    assert f"{prefix}.idx" in invalid("data.path", [f"data.path={prefix}"])
    (tmp_path / "corpus.idx").write_bytes(b"")
    validate(load_config(None, [f"data.path={prefix}"]), 1)


def test_missing_tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    assert str(path) in invalid("data.tokenizer", [f"data.tokenizer={path}"])


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(os.path.dirname(TINY), "*.yaml"))))
def test_documented_commands_validate(path):
    """Each config file's header names the commands that run it; they must pass validation, on
    the devices `--cpu-devices` or `--gpus` names, else on as many as the layout needs (data -1
    taken as 1, as `mtjax.inspect --target` counts them)."""
    commands = [line[2:].split("#")[0].split() for line in open(path, encoding="utf-8")
                if line.startswith("# python -m mtjax.")]
    assert commands, "no command in the header"
    for argv in commands:
        args = argv[3:]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        cfg = load_config(path, overrides)
        par = cfg.parallel
        devices = max(par.data, 1) * par.pipe * par.context * par.tensor
        for flag in ("--cpu-devices", "--gpus"):
            devices = int(args[args.index(flag) + 1]) if flag in args else devices
        validate(cfg, devices)


def test_micro_batches_sets_the_micro_batch_size():
    from mtjax.config.validate import batch_split
    cfg = load_config(None, ["train.global_batch=32", "train.micro_batches=4"])
    assert batch_split(cfg, 2) == (4, 4)                       # B = b m d: 32 = 4 * 4 * 2
    assert batch_split(load_config(None, ["train.global_batch=32", "train.micro_batch=2"]), 2) == (2, 8)
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["train.global_batch=30", "train.micro_batches=4"]), 1)
    assert e.value.key == "train.micro_batches"


# ---------------------------------------------------------------- model options of the real families

def test_arch_defaults_resolve_once():
    """tie_embeddings null and activation "" mean the arch's: gpt tied with GeLU, llama untied with SwiGLU;
    kv_channels 0 means h/a."""
    gpt, llama = load_config(None).model, load_config(None, ["model.arch=llama"]).model
    assert gpt.tie_embeddings is None and gpt.tied and gpt.mlp_activation == "gelu"
    assert llama.tie_embeddings is None and not llama.tied and llama.mlp_activation == "swiglu"
    assert gpt.head_dim == 64 // 4
    explicit = load_config(None, ["model.arch=llama", "model.tie_embeddings=true", "model.kv_channels=48"]).model
    assert explicit.tied and explicit.head_dim == 48
    assert load_config(BASE, ["model.arch=llama"]).model.tied is False      # base.yaml leaves it to the arch


def test_optional_field_takes_null(tmp_path):
    """A `bool | None` field: true/false, or null (override or file) for the arch's default."""
    assert load_config(None, ["model.tie_embeddings=false", "model.tie_embeddings=null"]).model.tie_embeddings is None
    assert load_config(None, ["model.tie_embeddings=~"]).model.tie_embeddings is None
    path = write(tmp_path / "c.yaml", "model:\n  arch: llama\n  tie_embeddings: null\n")
    assert load_config(path).model.tie_embeddings is None
    assert load_config(path, ["model.tie_embeddings=true"]).model.tie_embeddings is True
    assert "expected bool or null, got str" in config_error("model.tie_embeddings", load_config, None,
                                                            ["model.tie_embeddings=yes please"])
    with pytest.raises(ConfigError, match="expected int, got NoneType"):   # null only where the type says so
        load_config(None, ["model.kv_channels=null"])


def test_kv_channels_frees_hidden_from_heads():
    """With kv_channels set, h need not be a multiple of a (projections h -> a d)."""
    cfg = load_config(None, ["model.hidden_size=60", "model.num_heads=4", "model.kv_channels=16"])
    assert validate(cfg, 1) == (1, 1, 1) and cfg.model.head_dim == 16
    assert "or set model.kv_channels" in invalid("model.hidden_size", ["model.hidden_size=60", "model.num_heads=8"])
    invalid("model.kv_channels", ["model.kv_channels=-1"])


@pytest.mark.parametrize("overrides,key,expect", [
    (["model.arch=llama", "model.kv_channels=15"], "model.kv_channels", "even head dimension, got 15"),
    (["model.arch=llama", "model.hidden_size=60", "model.num_heads=4"], "model.hidden_size", "even head dimension"),
    (["model.activation=swiglu"], "model.activation", "arch gpt takes gelu or gelu_tanh"),
    (["model.arch=llama", "model.activation=gelu"], "model.activation", "arch llama takes swiglu"),
    (["model.activation=relu"], "model.activation", "'relu'"),
    (["model.qkv_bias=true"], "model.qkv_bias", "arch=llama"),
    (["model.arch=llama", "model.rope_scaling=longrope"], "model.rope_scaling", "none, linear, llama3, yarn"),
    (["model.rope_scaling=yarn", "model.rope_scaling_factor=4"], "model.rope_scaling", "learned positions"),
    (["model.arch=llama", "model.rope_beta_fast=16"], "model.rope_beta_fast", "only used with model.rope_scaling=yarn"),
    (["model.arch=llama", "model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_attention_factor=1.2"],
     "model.rope_attention_factor", "only used with model.rope_scaling=yarn"),
    (["model.arch=llama", "model.rope_scaling=yarn", "model.rope_scaling_factor=0.5"], "model.rope_scaling_factor",
     ">= 1, got 0.5"),
    (["model.arch=llama", "model.rope_scaling=yarn", "model.rope_original_positions=0"],
     "model.rope_original_positions", "positive"),
    (["model.arch=llama", "model.rope_scaling=yarn", "model.rope_beta_slow=0"], "model.rope_beta_slow",
     "finite positive"),
    (["model.arch=llama", "model.rope_scaling=yarn", "model.rope_beta_fast=-2"], "model.rope_beta_fast",
     "finite positive"),
    (["model.arch=llama", "model.rope_scaling=yarn", "model.rope_attention_factor=-1"], "model.rope_attention_factor",
     ">= 0"),
    (["model.rope_scaling=linear", "model.rope_scaling_factor=2"], "model.rope_scaling", "learned positions"),
    (["model.arch=llama", "model.rope_scaling_factor=2"], "model.rope_scaling_factor", "only used with"),
    (["model.arch=llama", "model.rope_scaling=linear", "model.rope_scaling_factor=0.5"],
     "model.rope_scaling_factor", ">= 1, got 0.5"),
    (["model.arch=llama", "model.rope_scaling=linear", "model.rope_scaling_factor=2",
      "model.rope_original_positions=4096"], "model.rope_original_positions", "rope_scaling=llama3"),
    (["model.arch=llama", "model.rope_low_freq_factor=2"], "model.rope_low_freq_factor", "rope_scaling=llama3"),
    (["model.arch=llama", "model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_low_freq_factor=0"],
     "model.rope_low_freq_factor", "positive"),
    (["model.arch=llama", "model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_low_freq_factor=4"],
     "model.rope_high_freq_factor", "greater than rope_low_freq_factor 4.0"),
    (["model.arch=llama", "model.rope_scaling=llama3", "model.rope_scaling_factor=8",
      "model.rope_original_positions=0"], "model.rope_original_positions", "positive"),
])
def test_model_option_errors(overrides, key, expect):
    assert expect in invalid(key, overrides)


def test_qk_norm_is_for_llama_on_the_1d_layout():
    assert "arch=llama" in invalid("model.qk_norm", ["model.qk_norm=true"])
    assert "tensor_grid=2d" in invalid("model.qk_norm", ["model.arch=llama", "model.qk_norm=true", "parallel.tensor=4",
                                                         "parallel.tensor_grid=2d"], num_devices=4)


@pytest.mark.parametrize("overrides", [
    ["model.activation=gelu_tanh"],                                           # GPT-2
    ["model.arch=llama", "model.qkv_bias=true", "model.num_kv_heads=2"],      # Qwen2
    ["model.arch=llama", "model.qk_norm=true", "model.num_kv_heads=2", "model.kv_channels=32"],   # Qwen3
    ["model.arch=llama", "model.rope_scaling=linear", "model.rope_scaling_factor=4"],
    ["model.arch=llama", "model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_theta=500000",   # Llama 3.1
     "model.rope_low_freq_factor=1", "model.rope_high_freq_factor=4", "model.rope_original_positions=8192"],
    ["model.arch=llama", "model.rope_scaling=yarn", "model.rope_scaling_factor=4", "model.rope_theta=1000000",  # Qwen2.5
     "model.rope_original_positions=32768", "model.qkv_bias=true"],
])
def test_model_options_of_the_families_validate(overrides):
    assert validate(load_config(None, overrides), 1) == (1, 1, 1)


@pytest.mark.parametrize("overrides,key,words", [
    (["parallel.max_in_flight=-1"], "parallel.max_in_flight", ">= 0"),
    (["parallel.max_in_flight=2"], "parallel.max_in_flight", "needs pipeline parallelism"),
    # gpipe's order needs N >= m: the table builder's refusal, named for the field
    (["parallel.pipe=2", "parallel.schedule=gpipe", "parallel.max_in_flight=2"], "parallel.max_in_flight", "too small"),
    (["parallel.pipe=2", "parallel.schedule=zbv", "model.num_layers=2"], "model.num_layers", "zbv holds 2 chunks"),
    (["parallel.pipe=2", "parallel.schedule=zbv", "parallel.virtual_stages=2", "model.num_layers=4"],
     "parallel.virtual_stages", "interleaved"),
])
def test_split_schedules_and_the_cap(overrides, key, words):
    pipe = next((int(o.split("=")[1]) for o in overrides if o.startswith("parallel.pipe=")), 1)
    msg = invalid(key, ["train.global_batch=8", "train.micro_batch=1", *overrides], num_devices=pipe)
    assert words in msg, msg


@pytest.mark.parametrize("schedule,layers,cap", [("zb", 2, 0), ("zb", 2, 1), ("zbv", 4, 0), ("zbv", 4, 2)])
def test_split_schedules_validate(schedule, layers, cap):
    cfg = load_config(None, ["parallel.pipe=2", f"parallel.schedule={schedule}", f"model.num_layers={layers}",
                             f"parallel.max_in_flight={cap}", "train.global_batch=8", "train.micro_batch=1"])
    assert validate(cfg, 2) == (1, 2, 1)


@pytest.mark.parametrize("text", ["inf", "-Infinity", "nan", ".inf", "-.inf"])
def test_non_finite_floats_are_refused_however_spelled(text):
    """YAML reads `inf` and `nan` as strings (it spells them .inf, .nan): a float field takes every
    spelling as the number and refuses it as such, not as a string."""
    assert "must be a finite number" in config_error("optim.lr", load_config, None, [f"optim.lr={text}"])
    assert load_config(None, ["data.tokenizer=inf"]).data.tokenizer == "inf"      # a string field keeps it


@pytest.mark.parametrize("text", ["007", "0123", "1.10", "1e3", "1:30", "0x1F", "1_000", ".inf", "2024-06-01"])
def test_text_fields_keep_a_number_as_written(tmp_path, text):
    """A str field given what YAML reads as a number (or a date) takes the text as written:
    `train.run_dir=007` is the directory 007, not 7 (nor 0123 the octal 83)."""
    cfg = load_config(None, [f"train.run_dir={text}", f"checkpoint.dir={text}", f"data.cache_dir={text}"])
    assert (cfg.train.run_dir, cfg.checkpoint.dir, cfg.data.cache_dir) == (text, text, text)
    path = write(tmp_path / "c.yaml", f"train:\n  run_dir: {text}\ndata:\n  tokenizer: {text}\n")
    cfg = load_config(path)
    assert (cfg.train.run_dir, cfg.data.tokenizer) == (text, text)
    assert load_config(None, [f"data.path={text}"]).data.path == text


@pytest.mark.parametrize("text", ["yes", "No", "ON", "off"])
def test_text_fields_keep_yaml11_boolean_words_as_written(tmp_path, text):
    """YAML 1.1's yes/no/on/off are text (YAML 1.2's booleans are true and false): a str field
    takes them as written (`train.run_dir=on` is the directory "on", which was refused as a bool),
    and a bool field still reads them as YAML 1.1 did."""
    cfg = load_config(None, [f"train.run_dir={text}", f"data.path={text}"])
    assert (cfg.train.run_dir, cfg.data.path) == (text, text)
    cfg = load_config(write(tmp_path / "c.yaml", f"train:\n  run_dir: {text}\ncheckpoint:\n  enabled: {text}\n"))
    assert cfg.train.run_dir == text and cfg.checkpoint.enabled is (text.lower() in ("yes", "on"))
    assert load_config(None, [f"checkpoint.enabled={text}"]).checkpoint.enabled is (text.lower() in ("yes", "on"))
    assert load_config(write(tmp_path / "d.yaml", to_yaml(cfg))) == cfg      # written back quoted
    assert "expected bool" in config_error("checkpoint.enabled", load_config, None, ["checkpoint.enabled=yess"])


@pytest.mark.parametrize("text,why", [("010", "octal"), ("-010", "octal"), ("1:30", "base 60"), ("1:30.5", "base 60")])
def test_yaml11_octal_and_base60_numbers_are_refused(tmp_path, text, why):
    """YAML 1.1 reads 010 as 8 and 1:30 as 90: a number field refuses them rather than take a value no
    one meant; hex, underscores and signs read as written."""
    assert why in config_error("train.steps", load_config, None, [f"train.steps={text}"])
    assert why in config_error("optim.lr", load_config, write(tmp_path / "c.yaml", f"optim:\n  lr: {text}\n"))
    cfg = load_config(None, ["train.steps=0x10", "train.seed=1_000", "train.log_interval=+3", "train.eval_batches=0"])
    assert (cfg.train.steps, cfg.train.seed, cfg.train.log_interval, cfg.train.eval_batches) == (16, 1000, 3, 0)
    assert type(cfg.train.steps) is int


@pytest.mark.parametrize("overrides,devices,key,words", [
    (["model.vocab_size=2147483647"], 1, "model.vocab_size", "token ids are int32"),
    (["model.vocab_multiple=1073741824", "parallel.tensor=2"], 2, "model.vocab_multiple", "below 2**31"),
    (["model.num_experts=33554432"], 1, "model.num_experts", "indexed in int32"),
    (["train.global_batch=2147483647", "train.micro_batch=1"], 1, "train.global_batch", "token ids"),
])
def test_sizes_past_int32_indexing_or_the_host_are_refused(overrides, devices, key, words):
    """Sizes within the int range whose step would trace into an OverflowError (a vocabulary or
    expert slots past int32) or whose host batch alone would exhaust memory: refused by name
    before anything is built."""
    assert words in invalid(key, overrides, devices)
    validate(load_config(None, ["model.vocab_size=2147483000", "model.num_experts=8388608",
                                "train.global_batch=2048", "train.micro_batch=1"]), 1)


def test_an_override_with_a_line_break_is_refused():
    """YAML folds a scalar's line break into a space: `train.run_dir=$'a\\nb'` would train in `a b`."""
    assert "line break" in config_error("train.run_dir", load_config, None, ["train.run_dir=a\nb"])
    assert "line break" in config_error("data.path", load_config, None, ["data.path=x\r\ny"])

