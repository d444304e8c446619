"""`python -m mtjax.convert`: Hugging Face models in and out, checked against transformers itself.

The oracle is tests/fixtures/hf (scripts/make_hf_fixtures.py): tiny random models saved by
transformers with the logits transformers computed. from-hf must reproduce those logits through
mtjax's own forward (Trainer.logits_fn) from the checkpoint it wrote, to-hf must give back the
very same tensors, and an mtjax checkpoint must survive to-hf then from-hf bitwise.

Loading to-hf's output in transformers needs torch and transformers, which mtjax does not
depend on: those tests run where MTJAX_HF_PYTHON names a Python that has them (or this
Python has them), e.g.
    MTJAX_HF_PYTHON=/path/to/hfenv/bin/python python -m pytest tests/test_convert.py -k transformers_loads
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from layouts import VOCAB, build, tiny_config
from test_cli import child_env, cli_forked
from mtjax.commands.convert_hf import from_hf, to_hf
from mtjax.config import load_config
from mtjax.config.errors import ConfigError, RunFault
from mtjax.config.schema import ModelConfig
from mtjax.convert.safetensors_io import read_tensors
from mtjax.data.errors import DataError
from mtjax.mesh import make_mesh
from mtjax.checkpoint import Checkpointer
from mtjax.training.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "hf"
ALL = ["gpt2", "llama", "qwen2", "qwen2_yarn", "gpt2_gelu_untied", "llama_plain", "qwen3", "mistral"]    # scripts/make_hf_fixtures.py


def _hf_python():
    if os.environ.get("MTJAX_HF_PYTHON"):
        return os.environ["MTJAX_HF_PYTHON"]
    have = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    return sys.executable if have else None


HF_PYTHON = _hf_python()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> the directory from-hf wrote for that fixture (converted once per module)."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = tmp_path_factory.mktemp(name) / "mtjax"
            from_hf(str(FIXTURES / name), str(done[name]))
        return done[name]
    return get


def restore(out: Path):
    """(trainer, state) from a from-hf directory, the way training reads it: its config.yaml
    and mtjax's Checkpointer, on one device."""
    cfg = load_config(str(out / "config.yaml"), ["parallel.data=1"])
    trainer = Trainer(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), cfg.model.vocab_size)
    checkpointer = Checkpointer(cfg, str(out / "checkpoints"))
    try:
        state = checkpointer.restore(checkpointer.latest_valid(), trainer)
    finally:
        checkpointer.close()
    return trainer, state


def leaves(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


VOCAB_AXIS = {"['embed']['embedding']": 0, "['lm_head']['kernel']": 1}


# ----------------------------------------------------------------- from-hf against transformers

@pytest.mark.parametrize("name", ALL)
def test_from_hf_reproduces_transformers_logits(converted, name):
    trainer, state = restore(converted(name))
    expected = load_file(str(FIXTURES / name / "expected.safetensors"))
    logits = np.asarray(trainer.logits_fn(state.params, expected["input_ids"]))
    assert logits.shape == expected["logits"].shape
    err = float(np.abs(logits - expected["logits"]).max())
    assert err < 1e-4, f"{name}: max |mtjax - transformers| = {err} (logits up to {np.abs(logits).max():.1f})"
    v = trainer.vocab
    for path, x in leaves(state.params).items():
        if path in VOCAB_AXIS:       # the padded vocabulary rows are zeros
            assert not np.take(x, np.arange(v, x.shape[VOCAB_AXIS[path]]), axis=VOCAB_AXIS[path]).any()


@pytest.mark.parametrize("name", ALL)
def test_to_hf_gives_back_the_same_tensors(converted, name, tmp_path):
    """from-hf then to-hf: every tensor bitwise (sharded in, one file out), the same model config."""
    to_hf(str(converted(name)), str(tmp_path / "hf"))
    original, _ = read_tensors(str(FIXTURES / name))
    exported, _ = read_tensors(str(tmp_path / "hf"))
    assert sorted(exported) == sorted(original)
    for key, x in original.items():
        assert exported[key].dtype == x.dtype and np.array_equal(exported[key], x), key
    from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert load_config(str(tmp_path / "back" / "config.yaml")).model == \
        load_config(str(converted(name) / "config.yaml")).model


@pytest.mark.skipif(HF_PYTHON is None, reason="set MTJAX_HF_PYTHON to a Python with torch and transformers")
def test_transformers_loads_to_hf_output(converted, tmp_path):
    """transformers' from_pretrained finds exactly the weights it expects, and computes the
    fixture's logits from them; so does the Llama (llama3 rope, head_dim != h/a) written as
    Mistral (--family mistral). Every fixture in one process: starting torch and transformers
    is most of the cost."""
    args, runs = [], [(name, name, "") for name in ALL] + [("llama_as_mistral", "llama", "mistral")]
    for label, name, family in runs:
        (tmp_path / label).mkdir()
        config = to_hf(str(converted(name)), str(tmp_path / label / "hf"), family)
        stated = json.loads((FIXTURES / name / "config.json").read_text())["model_type"]
        assert config["model_type"] == (family or stated)
        io = tmp_path / label / "io.safetensors"
        save_file({"input_ids": load_file(str(FIXTURES / name / "expected.safetensors"))["input_ids"]}, str(io))
        args += [str(tmp_path / label / "hf"), str(io)]
    r = subprocess.run([HF_PYTHON, str(REPO / "tests" / "hf_load.py"), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for label, name, _ in runs:
        logits = load_file(str(tmp_path / label / "io.safetensors"))["logits"]
        err = float(np.abs(logits - load_file(str(FIXTURES / name / "expected.safetensors"))["logits"]).max())
        assert err < 1e-4, (label, err)


# ----------------------------------------------------------------- mtjax -> HF -> mtjax

ROUNDTRIP = [
    pytest.param("gpt", [], id="gpt"),
    pytest.param("llama", [], id="llama"),
    pytest.param("gpt", ["model.activation=gelu_tanh", "model.tie_embeddings=false"], id="gpt_tanh_untied"),
    pytest.param("llama", ["model.qkv_bias=true", "model.kv_channels=8", "model.rope_scaling=llama3",
                           "model.rope_scaling_factor=8.0", "model.rope_original_positions=16",
                           "model.tie_embeddings=true"], id="qwen2_like"),
]


@pytest.mark.parametrize("arch, extra", ROUNDTRIP)
def test_checkpoint_survives_to_hf_then_from_hf_bitwise(tmp_path, arch, extra):
    """A checkpoint saved on a tensor=2 layout (V padded to 512) with every weight random,
    biases and padding rows included: to-hf then from-hf gives the same model config and
    the same weights bit for bit (the padding rows, which to-hf drops, come back as zeros)."""
    cfg = tiny_config(arch, tensor=2, extra=[f"model.vocab_size={VOCAB}", "checkpoint.async_save=false", *extra])
    trainer = build(cfg, 1, 1, 2)
    state = trainer.init_state()
    keys = jax.random.split(jax.random.key(7), 64)
    # the draws of an eager tree.map (a key per leaf, in leaf order) as one program, not one per shape
    noisy = jax.jit(lambda params: jax.tree.unflatten(jax.tree.structure(params), [
        jax.random.normal(keys[i], x.shape, x.dtype) for i, x in enumerate(jax.tree.leaves(params))]),
        out_shardings=trainer.state_shardings.params)(state.params)
    state = state.replace(params=jax.device_put(noisy, trainer.state_shardings.params))
    checkpointer = Checkpointer(cfg, str(tmp_path / "run" / "checkpoints"))
    checkpointer.save(state, trainer)
    checkpointer.close()

    to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    trainer_back, back = restore(tmp_path / "back")
    assert trainer_back.cfg.model == cfg.model
    before, after = leaves(state.params), leaves(back.params)
    assert sorted(before) == sorted(after)
    for path, x in before.items():
        y = after[path]
        if path in VOCAB_AXIS:
            axis = VOCAB_AXIS[path]
            assert not np.take(y, np.arange(VOCAB, y.shape[axis]), axis=axis).any()
            x, y = (np.take(a, np.arange(VOCAB), axis=axis) for a in (x, y))
        assert x.dtype == y.dtype and np.array_equal(x, y), path


# ----------------------------------------------------------------- bad input: refused, nothing written

def _config(**changes):
    def edit(d: Path):
        path = d / "config.json"
        cfg = json.loads(path.read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        path.write_text(json.dumps(cfg))
    return edit


def _tensors(edit_fn):
    def edit(d: Path):
        tensors = load_file(str(d / "model.safetensors"))
        edit_fn(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def _truncate(d: Path):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garble_header(d: Path):
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:40] = b"#" * 32                       # the JSON header starts after its 8-byte length
    (d / "model.safetensors").write_bytes(bytes(data))


def _float8(d: Path):
    """Q0's bytes relabelled F8_E4M3 (one byte an element, so four times the columns)."""
    data = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header[Q0].update(dtype="F8_E4M3", shape=[header[Q0]["shape"][0], header[Q0]["shape"][1] * 4])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


def _pickle_only(d: Path):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read")


def _index_missing_shard(d: Path):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    names = load_file(str(d / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


Q0 = "model.layers.0.self_attn.q_proj.weight"
# the qwen2_yarn fixture's rope_parameters (scripts/make_hf_fixtures.py)
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 4.0, "beta_slow": 0.5}
# (id, fixture, how it is damaged, error type, text the message must hold)
BAD = [
    ("unknown_architecture", "llama_plain", _config(architectures=["PhiForCausalLM"], model_type="phi"),
     ConfigError, "architectures: PhiForCausalLM is not supported"),
    ("unknown_model_type", "llama_plain", _config(architectures=None, model_type="phi"),
     ConfigError, "model_type: 'phi' is not supported"),
    # (transformers' Auto classes would build a Llama, without the q/k/v biases, from these Qwen2 weights)
    ("model_type_disagrees", "qwen2", _config(model_type="llama"), ConfigError,
     "model_type: 'llama' disagrees with architectures Qwen2ForCausalLM"),
    ("rope_longrope", "llama_plain", _config(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
     ConfigError, "rope_parameters.rope_type: 'longrope' is not supported"),
    ("rope_dynamic_v4", "llama_plain", _config(rope_parameters=None, rope_theta=1e4,
                                                rope_scaling={"type": "dynamic", "factor": 2.0}),
     ConfigError, "rope_scaling.type: 'dynamic' is not supported"),
    ("rope_longrope_v4", "llama_plain", _config(rope_parameters=None, rope_theta=1e4,
                                                 rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     ConfigError, "rope_scaling.rope_type: 'longrope' is not supported"),
    # yarn's forms mtjax does not compute, a zero attention factor (transformers would multiply cos and
    # sin by it), and transformers 4's spelling saying another factor than 5's
    ("yarn_mscale", "qwen2_yarn", _config(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}), ConfigError,
     "rope_parameters.mscale: 1.0 is not supported"),
    ("yarn_truncate_false", "qwen2_yarn", _config(rope_parameters={**YARN, "truncate": False}), ConfigError,
     "rope_parameters.truncate: False is not supported"),
    ("yarn_attention_factor_0", "qwen2_yarn", _config(rope_parameters={**YARN, "attention_factor": 0.0}), ConfigError,
     "rope_parameters.attention_factor: must be positive, got 0.0"),
    ("yarn_spellings_disagree", "qwen2_yarn", _config(rope_scaling={**YARN, "factor": 2.0}), ConfigError,
     "disagrees with rope_parameters"),
    ("yarn_beta_negative", "qwen2_yarn", _config(rope_parameters={**YARN, "beta_slow": -1.0}), ConfigError,
     "rope_parameters.beta_slow: must be a finite positive number, got -1.0"),
    ("rope_theta_v5", "llama_plain", _config(rope_parameters={"rope_type": "default", "rope_theta": 0.5}),
     ConfigError, "config.json: rope_parameters.rope_theta: must be > 1"),
    # (transformers 5 reads parameters per layer type, and a top-level original_max_position_embeddings first)
    ("rope_per_layer_type", "llama_plain", _config(layer_types=["full_attention"] * 2, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e5}}), ConfigError,
     "rope_parameters.full_attention: rotary parameters per layer type are not supported"),
    ("rope_original_twice", "llama", _config(original_max_position_embeddings=32), ConfigError,
     "original_max_position_embeddings: 32 disagrees with rope_parameters.original_max_position_embeddings 16"),
    ("partial_rotary", "llama_plain", _config(partial_rotary_factor=0.5), ConfigError, "partial_rotary_factor: 0.5"),
    # (layer 1 slides: use_sliding_window and 1 >= max_window_layers; windows that change nothing convert,
    # tests/test_convert_accepts.py)
    ("sliding_window", "qwen2", _config(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                        layer_types=None),
     ConfigError, "sliding_window: 16 is not supported: layer 1 attends within a window of 16 tokens"),
    ("layer_types", "llama_plain", _config(layer_types=["sliding_attention", "full_attention"]),
     ConfigError, "layer_types:"),
    ("attention_bias", "llama_plain", _config(attention_bias=True), ConfigError, "attention_bias: True"),
    ("mlp_bias", "llama_plain", _config(mlp_bias=True), ConfigError, "mlp_bias: True"),
    ("llama_gelu", "llama_plain", _config(hidden_act="gelu"), ConfigError, "hidden_act: 'gelu'"),
    ("gpt2_relu", "gpt2_gelu_untied", _config(activation_function="relu"), ConfigError,
     "activation_function: 'relu' is not supported"),
    ("gpt2_cross_attention", "gpt2_gelu_untied", _config(add_cross_attention=True), ConfigError,
     "add_cross_attention: True"),
    ("missing_size", "llama_plain", _config(hidden_size=None), ConfigError, "hidden_size: missing"),
    ("tie_a_string", "llama_plain", _config(tie_word_embeddings="no"), ConfigError,
     "tie_word_embeddings: expected true or false, got 'no'"),
    ("eos_a_string", "llama_plain", _config(eos_token_id="2"), ConfigError,
     "eos_token_id: must be a token id (a whole number) or a list of them, got '2'"),
    ("pad_a_float_in_a_list", "llama_plain", _config(pad_token_id=[1, 2.0]), ConfigError,
     "pad_token_id: must be a token id (a whole number) or a list of them, got [1, 2.0]"),
    ("bad_json", "llama_plain", lambda d: (d / "config.json").write_text("{"), DataError, "not readable JSON"),
    ("no_weights", "llama_plain", lambda d: (d / "model.safetensors").unlink(), DataError, "no model.safetensors"),
    ("pickle_only", "llama_plain", _pickle_only, DataError, "pytorch_model.bin is a pickle"),
    ("truncated", "llama_plain", _truncate, DataError, "not a readable safetensors file"),
    ("garbled_header", "llama_plain", _garble_header, DataError, "not a readable safetensors file"),
    ("missing_shard", "llama_plain", _index_missing_shard, DataError, "lists the shard model-00002-of-00002"),
    ("index_not_a_map", "llama", lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": [["model.norm.weight", "model.safetensors"]]}'),
     DataError, "weight_map must map tensor names to file names"),
    ("missing_tensor", "llama_plain", _tensors(lambda t: t.pop("model.norm.weight")), DataError,
     "no tensor model.norm.weight"),
    ("wrong_shape", "llama_plain", _tensors(lambda t: t.update({Q0: t[Q0][:, :31].copy()})), DataError,
     f"{Q0} has shape [32, 31], config.json implies [32, 32]"),
    ("extra_tensor", "llama_plain", _tensors(lambda t: t.update({"model.layers.0.mlp.up_proj.bias": t["model.norm.weight"]})),
     DataError, "unexpected tensor model.layers.0.mlp.up_proj.bias"),
    ("int_tensor", "llama_plain", _tensors(lambda t: t.update({Q0: t[Q0].astype(np.int8)})), DataError,
     "has dtype int8"),
    ("float8_tensor", "llama_plain", _float8, DataError, f"{Q0} has dtype F8_E4M3; only float weights convert"),
    ("nan_tensor", "llama_plain", _tensors(lambda t: t.update({Q0: np.full_like(t[Q0], np.nan)})), DataError, "non-finite"),
    ("broken_tokenizer", "llama_plain", lambda d: (d / "tokenizer.json").write_text("{not json"), DataError,
     "tokenizer.json: cannot load tokenizer"),
    ("tokenizer_is_a_directory", "llama_plain", lambda d: (d / "tokenizer.json").mkdir(), DataError,
     "tokenizer.json: is not a file"),
    ("tokenizer_config_not_json", "llama_plain", lambda d: (d / "tokenizer_config.json").write_text("{"), DataError,
     "tokenizer_config.json: not readable JSON"),
]


@pytest.mark.parametrize("case, fixture, damage, error, text", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_nothing_is_written(tmp_path, case, fixture, damage, error, text):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / fixture, hf)
    damage(hf)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(error) as info:
        from_hf(str(hf), str(tmp_path / "out"))
    assert text in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert sorted(os.listdir(tmp_path)) == before


def test_sharded_and_single_file_read_the_same(tmp_path):
    """An index over two shards reads as the one file it was split from."""
    single, _ = read_tensors(str(FIXTURES / "llama_plain"))
    names = sorted(single)
    shards = {f"model-0000{k + 1}-of-00002.safetensors": names[k::2] for k in range(2)}
    for file, part in shards.items():
        save_file({n: single[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, source = read_tensors(str(tmp_path))
    assert source.endswith("model.safetensors.index.json")
    assert sorted(sharded) == names and all(np.array_equal(sharded[n], single[n]) for n in names)
    # beside an index, a model.safetensors is the one transformers' from_pretrained reads
    save_file({n: x + 1 for n, x in single.items()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    both, source = read_tensors(str(tmp_path))
    assert source == str(tmp_path / "model.safetensors")
    assert sorted(both) == names and all(np.array_equal(both[n], single[n] + 1) for n in names)


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    import mtjax.convert.checkpoints as checkpoints

    def fail(trainer, leaves, directory, meta=None):
        os.makedirs(directory)
        open(os.path.join(directory, "partial"), "w").close()
        raise OSError("disk full")
    monkeypatch.setattr(checkpoints, "save_params", fail)
    with pytest.raises(RunFault, match=r"--out: cannot write .*/out: disk full; nothing was written"):
        from_hf(str(FIXTURES / "llama_plain"), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_an_existing_output_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(ConfigError, match="--out: .* already exists"):
        from_hf(str(FIXTURES / "llama_plain"), str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == ["keep"]


def test_to_hf_refuses_what_gpt2_cannot_express():
    from mtjax.convert.hf_config import hf_config
    with pytest.raises(ConfigError, match="model.num_kv_heads: GPT-2 has no grouped-query attention"):
        hf_config(ModelConfig(arch="gpt", num_heads=4, num_kv_heads=2), 300)


def test_other_names_of_the_same_activations():
    """transformers' ACT2FN aliases: swish is silu; gelu_fast the tanh GeLU, gelu_python the erf one."""
    from mtjax.convert.hf_config import model_fields
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 300}
    assert model_fields({**llama, "hidden_act": "swish"}) == model_fields({**llama, "hidden_act": "silu"})
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 300}
    for alias, same in (("gelu_fast", "gelu_new"), ("gelu_python", "gelu")):
        assert model_fields({**gpt2, "activation_function": alias}) == \
            model_fields({**gpt2, "activation_function": same}), alias
    assert model_fields({**gpt2, "activation_function": "gelu_fast"})["activation"] == "gelu_tanh"


def test_transformers_4_names_and_rope_keys(tmp_path):
    """GPT-2 checkpoints saved by GPT2Model (no `transformer.` prefix, with the attention mask
    buffers older transformers saved) and Llama configs in transformers 4's rope_theta +
    rope_scaling form convert as their transformers 5 equivalents."""
    from mtjax.convert.hf_config import model_fields
    v5 = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 300,
          "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    v4 = {**v5, "rope_parameters": None, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert model_fields(v4) == model_fields(v5)
    assert model_fields(v5)["rope_scaling"] == "linear" and model_fields(v5)["rope_theta"] == 5e5
    # both spellings (as to-hf writes them) must agree; where they disagree neither is guessed
    assert model_fields({**v4, "rope_parameters": v5["rope_parameters"]}) == model_fields(v5)
    for key, legacy in (("rope_theta", {"rope_theta": 1e4}),
                        ("rope_scaling", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
                        ("rope_scaling", {"rope_scaling": {"rope_type": "default"}})):
        with pytest.raises(ConfigError) as e:
            model_fields({**v5, **legacy})
        assert e.value.key == key and "disagrees with rope_parameters" in str(e.value), str(e.value)

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "gpt2_gelu_untied", hf)
    tensors = load_file(str(hf / "model.safetensors"))
    old = {n.removeprefix("transformer."): x for n, x in tensors.items()}
    old["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    save_file(old, str(hf / "model.safetensors"), metadata={"format": "pt"})
    from_hf(str(hf), str(tmp_path / "old"))
    from_hf(str(FIXTURES / "gpt2_gelu_untied"), str(tmp_path / "new"))
    a, b = leaves(restore(tmp_path / "old")[1].params), leaves(restore(tmp_path / "new")[1].params)
    assert all(np.array_equal(a[k], b[k]) for k in b)


# ----------------------------------------------------------------- the command line

def convert_cli(args, cwd):
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "mtjax.convert", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


CLI_BAD = [
    ("unknown_architecture", "/hf/config.json: architectures: PhiForCausalLM is not supported"),
    ("rope_longrope", "/hf/config.json: rope_parameters.rope_type: 'longrope' is not supported"),
    ("truncated", "not a readable safetensors file"),
    ("no_checkpoint", "holds no complete mtjax checkpoint"),
    ("no_out", "error: arguments: the following arguments are required: --out"),
    ("no_command", "error: arguments: the command must be from-hf or to-hf, got 'export'"),
]


def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    damage = {b[0]: b[2] for b in BAD}
    runs = {}
    for case, _ in CLI_BAD:
        d = tmp_path / case
        shutil.copytree(FIXTURES / "llama_plain", d / "hf")
        if case in damage:
            damage[case](d / "hf")
        runs[case] = {"no_checkpoint": ["to-hf", "--checkpoint", str(d / "hf"), "--out", str(d / "out")],
                      "no_out": ["from-hf", "--hf-dir", str(d / "hf")],
                      "no_command": ["export", "--hf-dir", str(d / "hf")]}.get(
            case, ["from-hf", "--hf-dir", str(d / "hf"), "--out", str(d / "out")])
    (tmp_path / "streams").mkdir()
    env = child_env(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    forked = cli_forked([(args, tmp_path, "mtjax.convert") for args in runs.values()], str(tmp_path / "streams"),
                        env=env)      # as convert_cli, from one interpreter (see test_cli.FORKED)
    results = dict(zip(runs, forked))
    for case, text in CLI_BAD:
        r = results[case]
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], \
            (case, r.returncode, r.stderr)
        assert sorted(os.listdir(tmp_path / case)) == ["hf"], case


def test_training_resumes_from_a_converted_model(tmp_path):
    """from-hf's output is a run directory: `mtjax.train --config OUT/config.yaml` resumes at step 0."""
    from test_cli import train_cli, write_corpus
    r = convert_cli(["from-hf", "--hf-dir", str(FIXTURES / "llama_plain"), "--out", str(tmp_path / "run")], tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    corpus = write_corpus(tmp_path / "corpus")        # byte ids < 257 <= V = 300
    r = train_cli(["--config", str(tmp_path / "run" / "config.yaml"), f"data.path={corpus}",
                   f"data.cache_dir={tmp_path}/cache", "train.steps=1", "train.global_batch=2", "train.micro_batch=2",
                   "train.eval_interval=0", "train.progress=false"], tmp_path, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "resumed from checkpoint step 0" in r.stdout
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["0", "1"]


# ----------------------------------------------------------------- the tokenizer across a conversion

def test_from_hf_copies_the_tokenizer_and_to_hf_writes_its_ids(tmp_path):
    """from-hf copies the tokenizer files beside the model into the run and points data.tokenizer
    at them (data made with that tokenizer then needs no flag); to-hf writes its BOS and EOS ids
    and copies the files back out. (The model's config.json states no ids here: where it does,
    they win, the test below.)"""
    pytest.importorskip("tokenizers")
    from tokenizer_fixture import FIXTURE
    from mtjax.data.tokenizer import config_tokenizer
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama_plain", hf)
    stated = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**stated, "bos_token_id": None, "eos_token_id": None}))
    shutil.copyfile(FIXTURE, hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    cfg = from_hf(str(hf), str(tmp_path / "run"))
    copied = tmp_path / "run" / "tokenizer"
    assert sorted(os.listdir(copied)) == ["tokenizer.json", "tokenizer_config.json"]
    assert (copied / "tokenizer.json").read_bytes() == Path(FIXTURE).read_bytes()
    saved = load_config(str(tmp_path / "run" / "config.yaml"))
    assert saved.data.tokenizer == cfg.data.tokenizer == str(copied / "tokenizer.json")
    tokenizer = config_tokenizer(saved)
    assert (tokenizer.bos_id, tokenizer.eod_id) == (0, 1)        # <|begin_of_text|>, <|end_of_text|>
    config = to_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == 1
    assert sorted(os.listdir(tmp_path / "back")) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    (copied / "tokenizer.json").write_text('{"broken')        # never passed on: refused, nothing written
    with pytest.raises(DataError, match=r"run/tokenizer/tokenizer\.json: cannot load tokenizer"):
        to_hf(str(tmp_path / "run"), str(tmp_path / "again"))
    (copied / "tokenizer.json").unlink()
    (copied / "tokenizer.json").mkdir()
    with pytest.raises(DataError, match=r"run/tokenizer/tokenizer\.json: is not a file"):
        to_hf(str(tmp_path / "run"), str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("name,eos", [("llama_plain", 2), ("gpt2", None), ("llama_plain", [2, 7])],
                         ids=["stated", "unstated", "several"])
def test_a_model_converted_without_a_tokenizer_gives_back_its_own_ids(tmp_path, name, eos):
    """No tokenizer.json beside the model: the run's tokenizer is a placeholder ("byte", whose EOS
    is 256), so to-hf of the untrained conversion writes the ids the model's config.json stated
    (or none), not the byte tokenizer's; its padding id too."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / name, hf)
    stated = json.loads((hf / "config.json").read_text())
    pad = eos[1] if isinstance(eos, list) else eos
    (hf / "config.json").write_text(json.dumps({**stated, "eos_token_id": eos, "pad_token_id": pad}))
    from_hf(str(hf), str(tmp_path / "run"))
    config = to_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (stated.get("bos_token_id"), eos)
    assert config["pad_token_id"] == pad


def test_to_hf_of_a_byte_tokenizer_model_writes_its_eos():
    """A GPT on the byte tokenizer: config.json says EOS is id 256, and there is no BOS (to-hf's
    wiring of the ids is the test above)."""
    from mtjax.config.schema import DataConfig
    from mtjax.convert import hf_config, tokenizer_files
    config = hf_config.hf_config(ModelConfig(arch="gpt"), 257, tokenizer_files.token_ids(DataConfig()))
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, 256)
