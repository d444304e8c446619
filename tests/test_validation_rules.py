"""The two rules validation applies in every config group (`mtjax.config.validate.common`), at the
config level: nothing compiles, no device is needed beyond the count passed.

- The no-effect rule: a field set away from its default that the layout makes inert is refused
  with one line naming the field and what it needs; left at its default, or given the layout it
  needs, it validates.
- Too few (or too many) devices: the line names --cpu-devices and the count needed.
"""
import pytest

from mtjax.config import Config, ConfigError, ParallelConfig, TrainConfig, load_config, validate

BATCH = ["train.global_batch=8", "train.micro_batch=1"]

# (field override, the layout it needs, devices of that layout, words of the refusal at one device)
NO_EFFECT = [
    ("parallel.sequence_parallel=true", ["parallel.tensor=2"], 2, "parallel.tensor > 1"),
    ("parallel.max_in_flight=2", ["parallel.pipe=2"], 2, "pipeline parallelism"),
    ("parallel.schedule=zb", ["parallel.pipe=2"], 2, "pipeline parallelism"),
    ("parallel.schedule=gpipe", ["parallel.pipe=2"], 2, "pipeline parallelism"),
    ("parallel.virtual_stages=2", ["parallel.pipe=2", "parallel.schedule=interleaved", "model.num_layers=4"], 2,
     "parallel.schedule=interleaved"),
    ("parallel.distributed_optimizer=true", ["parallel.data=2"], 2, "parallel.data > 1"),
    ("parallel.tensor_grid=2d", ["parallel.tensor=4", "train.micro_batch=2"], 4, "parallel.tensor > 1"),
    ("parallel.tensor_depth=2", ["parallel.tensor=8", "parallel.tensor_grid=2.5d", "train.micro_batch=4"], 8,
     "tensor_grid=2.5d"),
    ("train.recompute_layers=1", ["train.recompute=block"], 1, "train.recompute=block"),
    ("train.initial_loss_scale=1024", ["train.precision=fp16"], 1, "train.precision=fp16"),
    ("train.hysteresis=1", ["train.precision=fp16"], 1, "train.precision=fp16"),
    ("train.loss_scale=1024", ["train.precision=fp16"], 1, "train.precision=fp16"),
    # a bool is named as it is written (`true`, not Python's `True`)
    ("model.moe_router_bias=true", ["model.num_experts=2", "model.moe_score=sigmoid"], 1,
     "moe_router_bias = true needs mixture of experts"),
    ("model.moe_renormalize=false", ["model.num_experts=2"], 1, "moe_renormalize = false needs"),
    ("parallel.half_batch_overlap=true", ["parallel.tensor=2", "train.micro_batch=2"], 2,
     "half_batch_overlap = true needs tensor parallelism"),
]


@pytest.mark.parametrize("override,layout,devices,words", NO_EFFECT, ids=[c[0] for c in NO_EFFECT])
def test_a_setting_with_no_effect_is_refused_in_one_line(override, layout, devices, words):
    key = override.split("=")[0]
    cfg = load_config(None, [*BATCH, "parallel.data=1", override])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    message = str(e.value)
    assert e.value.key == key and "\n" not in message, message
    assert words in message and "no effect" in message, message
    # in the layout it needs, the same setting validates
    validate(load_config(None, [*BATCH, override, *layout]), devices)


def test_the_defaults_of_the_rules_fields_validate_on_one_device():
    explicit = ["parallel.sequence_parallel=false", "parallel.max_in_flight=0", "parallel.schedule=1f1b",
                "parallel.virtual_stages=1", "parallel.distributed_optimizer=false", "parallel.tensor_grid=1d",
                "parallel.tensor_depth=1", "train.recompute_layers=0"]
    assert validate(load_config(None, [*BATCH, *explicit]), 1) == (1, 1, 1)


def test_rotary_settings_on_gpt_are_refused():
    """GPT has learned positions: a rotary base or scaling set for it would do nothing."""
    for override in ("model.rope_theta=500000", "model.rope_scaling=linear"):
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, [*BATCH, "model.arch=gpt", override]), 1)
        assert e.value.key == override.split("=")[0] and "arch=llama" in str(e.value)
    validate(load_config(None, [*BATCH, "model.arch=llama", "model.rope_theta=500000"]), 1)


def test_tensor_depth_on_a_2d_grid_is_refused():
    """2d has no depth: once ignored silently, now the no-effect rule's one line."""
    cfg = load_config(None, [*BATCH, "parallel.tensor=4", "parallel.tensor_grid=2d", "parallel.tensor_depth=2"])
    with pytest.raises(ConfigError, match="parallel.tensor_depth: .*tensor_grid=2.5d"):
        validate(cfg, 4)


@pytest.mark.parametrize("overrides,devices,key,needed", [
    (["parallel.tensor=2"], 1, "parallel.data", 2),                 # --cpu-devices forgotten: data = -1
    (["parallel.pipe=2", "parallel.tensor=2"], 6, "parallel.data", 8),   # not a multiple: the next one
    (["parallel.data=4"], 2, "parallel", 4),                        # an explicit mesh
    (["parallel.data=1", "parallel.pipe=2"], 1, "parallel", 2),
])
def test_too_few_devices_name_the_flag_and_the_count(overrides, devices, key, needed):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*BATCH, *overrides]), devices)
    assert e.value.key == key, str(e.value)
    assert f"--cpu-devices {needed}" in str(e.value) and f"{needed} GPUs" in str(e.value), str(e.value)


def test_the_devices_hint_of_a_multi_process_run_is_per_process():
    """--cpu-devices is per process: 2 processes for a mesh of 8 need 4 each (not 8: 16 devices)."""
    dist = ["distributed.coordinator=localhost:1234", "distributed.num_processes=2", "distributed.process_id=0"]
    with pytest.raises(ConfigError, match=r"= 8 differs from the 4 devices \(use --cpu-devices 4 in each of the 2 "):
        validate(load_config(None, [*BATCH, *dist, "parallel.data=2", "parallel.tensor=4"]), 4)
    with pytest.raises(ConfigError, match=r"6 devices do not split evenly over the 4 processes"):
        validate(load_config(None, [*BATCH, *dist[:1], "distributed.num_processes=4", "distributed.process_id=0",
                                    "parallel.data=2", "parallel.tensor=3"]), 4)


@pytest.mark.parametrize("data,batch,words", [
    ("-1", 16, "micro_batch*data = 4*8 (data 8: parallel.data=-1 takes the devices pipe, context and tensor leave); "
               "train.micro_batch=2 would fit"),
    ("8", 16, "micro_batch*data = 4*8; train.micro_batch=2 would fit"),
    ("8", 12, "micro_batch*data = 4*8; train.global_batch=32 would fit"),
])
def test_a_batch_split_by_data_minus_one_says_where_data_came_from(data, batch, words):
    """The default data -1 is a size the user never wrote: a batch it does not divide says what it
    took; and each refusal names a change that fits (a smaller b, else the next B)."""
    with pytest.raises(ConfigError) as info:
        validate(load_config(None, [f"parallel.data={data}", f"train.global_batch={batch}"]), 8)
    assert str(info.value).endswith(words) and str(info.value).startswith(f"train.global_batch: global_batch {batch} ")


def test_interleaved_with_one_virtual_stage_is_refused():
    """interleaved at v = 1 builds 1F1B's table: the schedule would have no effect. The line names
    virtual_stages (the field to raise); at v = 2 the same layout validates. Layers that do not
    split p v ways are still named first (model.num_layers, test_config.py)."""
    layout = [*BATCH, "parallel.pipe=2", "parallel.schedule=interleaved", "model.num_layers=4"]
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*layout, "parallel.virtual_stages=1"]), 2)
    assert e.value.key == "parallel.virtual_stages" and "\n" not in str(e.value), str(e.value)
    assert "virtual_stages >= 2" in str(e.value) and "no effect" in str(e.value), str(e.value)
    validate(load_config(None, [*layout, "parallel.virtual_stages=2"]), 2)
    with pytest.raises(ConfigError) as e:    # without a pipeline the schedule itself is what has no effect
        validate(load_config(None, [*BATCH, "parallel.schedule=interleaved"]), 1)
    assert e.value.key == "parallel.schedule", str(e.value)


M4_AT_DATA_2 = ["train.global_batch=16", "train.micro_batches=4", "parallel.data=2"]     # b = 2


@pytest.mark.parametrize("micro_batch,ok", [(None, True), (2, True), (4, False), (1, False), (8, False)])
def test_a_micro_batch_that_micro_batches_would_ignore_is_refused(micro_batch, ok):
    """B 16, m 4 at data 2 make b = 2: micro_batch left out, or written as 2, agrees; any other
    written value would be ignored, the default 4 too, and is refused in one line naming both
    fields."""
    cfg = load_config(None, [*M4_AT_DATA_2, *([] if micro_batch is None else [f"train.micro_batch={micro_batch}"])])
    if ok:
        validate(cfg, 2)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    assert e.value.key == "train.micro_batch" and "\n" not in str(e.value), str(e.value)
    assert "train.micro_batches 4" in str(e.value) and "16/(4*2) = 2: set train.micro_batch=2" in str(e.value)


def test_a_later_layer_chooses_between_micro_batch_and_micro_batches(tmp_path):
    """micro_batch and micro_batches give b two ways; of the two, a later layer's wins as any later
    key does (base file < file < overrides): the child's micro_batches over its base's
    micro_batch, an override's micro_batches over the file's micro_batch (configs/*.yaml all
    write one), an override's micro_batch over the file's micro_batches. The loser is dropped (at
    its default, not written). A Config built in Python counts what differs from the defaults."""
    from mtjax.config.validate import batch_split
    from mtjax.run import resolve_config
    (tmp_path / "base.yaml").write_text("train:\n  micro_batch: 8\n", encoding="utf-8")
    (tmp_path / "run.yaml").write_text("base: base.yaml\ntrain:\n  global_batch: 16\n  micro_batches: 4\n"
                                       "parallel:\n  data: 2\n", encoding="utf-8")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert "train.micro_batch" not in cfg.written and "train.micro_batches" in cfg.written
    assert cfg.train.micro_batch == TrainConfig.micro_batch and batch_split(cfg, validate(cfg, 2)[0]) == (2, 4)
    over = load_config(str(tmp_path / "run.yaml"), ["train.micro_batch=4"])
    assert over.train.micro_batches == 0 and batch_split(over, validate(over, 2)[0]) == (4, 2)
    unset = load_config(str(tmp_path / "run.yaml"), ["train.micro_batches=0"])   # m from b: the base's b stands
    assert batch_split(unset, validate(unset, 2)[0]) == (8, 1)
    for path in ("configs/tiny.yaml", "configs/gpt1.3b.yaml"):
        cfg = load_config(path, ["train.micro_batches=2", "parallel.data=1"])
        assert batch_split(cfg, validate(cfg, 1)[0]) == (cfg.train.global_batch // 2, 2), path
    built = Config(parallel=ParallelConfig(data=2), train=TrainConfig(global_batch=16, micro_batch=8))
    cfg = resolve_config(built, ["train.micro_batches=4"])
    assert batch_split(cfg, validate(cfg, 2)[0]) == (2, 4)
    with pytest.raises(ConfigError) as e:       # one layer writing both, disagreeing: refused
        validate(resolve_config(built, ["train.micro_batches=4", "train.micro_batch=8"]), 2)
    assert e.value.key == "train.micro_batch", str(e.value)


def test_the_written_record_is_not_part_of_the_config():
    """Configs that differ only in which keys were written are equal, hash alike, and serialise
    alike (config.json, checkpoints); `written` is not a group a file can set."""
    given, default = load_config(None, ["train.micro_batch=4"]), load_config(None, [])
    assert given.written == {"train.micro_batch"} and not default.written
    assert given == default and hash(given) == hash(default) and given.to_dict() == default.to_dict()
    assert "written" not in given.to_dict() and "written" not in repr(given)
    assert given.replace(train=given.train).written == given.written
    with pytest.raises(ConfigError) as e:
        load_config(None, ["written.train=1"])
    assert str(e.value).startswith("written: unknown config group"), str(e.value)


def test_the_api_records_its_overrides_as_written():
    """`mtjax.train(config, overrides)`: a key an override sets is written, as on the command line."""
    from mtjax.run import resolve_config
    cfg = resolve_config(Config(), [*M4_AT_DATA_2, "train.micro_batch=4"])
    assert "train.micro_batch" in cfg.written
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    assert e.value.key == "train.micro_batch", str(e.value)
    validate(resolve_config(cfg.replace(written=frozenset()), []), 2)   # the record kept, not made up


@pytest.mark.parametrize("moe,ok", [
    (["model.moe_ffn_hidden_size=64"], True),                               # every layer MoE: f unused
    (["model.moe_ffn_hidden_size=64", "model.moe_layer_freq=2"], False),    # layer 1 dense
    (["model.moe_ffn_hidden_size=64", "model.moe_first_dense=1"], False),   # layer 0 dense
    ([], False),                                                           # the experts are f wide
])
def test_the_dense_ffn_size_is_checked_only_where_an_mlp_uses_it(moe, ok):
    """An odd f at tensor 2 splits no MLP when every layer holds experts of their own size (it is
    kept, not refused: Hugging Face's Qwen MoE configs carry it as intermediate_size)."""
    cfg = load_config(None, [*BATCH, "parallel.tensor=2", "model.num_experts=4", "model.ffn_hidden_size=131", *moe])
    if ok:
        validate(cfg, 2)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2)
    assert e.value.key == "model.ffn_hidden_size" and "131 is not divisible by parallel.tensor 2" in str(e.value)


@pytest.mark.parametrize("layout,words", [
    (["parallel.tensor=2", "parallel.half_batch_overlap=true"], "half_batch_overlap needs an even micro-batch"),
    (["parallel.tensor=4", "parallel.tensor_grid=2d"], "not divisible by the grid's batch blocks"),
])
def test_a_micro_batch_that_micro_batches_made_is_refused_naming_micro_batches(layout, words):
    """B 12, m 4 at data 1 make b = 3: a refusal of b names train.micro_batches, the field that made
    it (train.micro_batch could not be changed alone: it must agree with micro_batches)."""
    cfg = load_config(None, ["train.global_batch=12", "train.micro_batches=4", *layout])
    with pytest.raises(ConfigError) as e:
        validate(cfg, cfg.parallel.tensor)
    assert e.value.key == "train.micro_batches" and words in str(e.value), str(e.value)
    assert "got 3" in str(e.value) or "micro-batch 3" in str(e.value), str(e.value)
