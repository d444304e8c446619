"""from-hf on checkpoints that transformers loads and runs although config.json carries keys that
look like options mtjax lacks, and on base models' checkpoints; and what such a conversion holds
in memory.

Each accepted config.json is a fixture's (tests/fixtures/hf, logits computed by transformers)
with keys that, as transformers reads them, change nothing: from-hf must read it as the very
model it reads the fixture as (whose logits tests/test_convert.py checks against transformers'),
or, where the weights' names change, convert to transformers' logits. What stays refused is
one line naming config.json's key.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mtjax
from test_convert import FIXTURES, REPO, YARN, _config, restore
from mtjax.commands.convert_hf import from_hf
from mtjax.config.errors import ConfigError
from mtjax.convert.hf_config import read_model
from mtjax.data.errors import DataError

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 1e4}
# (id, fixture, config.json changes, --seq-len): the same model as the fixture's
SAME = [
    # transformers' Qwen2: layer i slides when use_sliding_window and i >= max_window_layers (default 28)
    ("window_below_max_window_layers", "qwen2", {"use_sliding_window": True, "sliding_window": 16}, None),
    ("window_max_window_layers_2", "qwen2", {"use_sliding_window": True, "sliding_window": 16,
                                            "max_window_layers": 2}, None),
    # every layer slides, but a window of 64 masks nothing in 64 positions
    ("window_covers_context", "qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
     None),
    # transformers 5 reads layer_types, 4 the window keys: where the window covers the context they may differ
    ("layer_types_differ_wide_window", "qwen2", {"use_sliding_window": True, "sliding_window": 64,
                                                 "max_window_layers": 0, "layer_types": ["full_attention"] * 2}, None),
    ("window_off_sliding_window_set", "qwen3", {"use_sliding_window": False, "sliding_window": 4}, None),
    ("mixtral_window_covers_context", "mixtral", {"sliding_window": 32}, None),
    # Mixtral and Qwen3-MoE build one mask for every layer from sliding_window: layer_types is unread
    ("mixtral_layer_types_unread", "mixtral", {"layer_types": ["sliding_attention"] * 2}, None),
    ("qwen3_moe_layer_types_unread", "qwen3_moe", {"layer_types": ["sliding_attention"] * 2}, None),
    # Qwen2's q/k/v biases and Mixtral's none are fixed in transformers' classes, whatever attention_bias says
    ("qwen2_attention_bias", "qwen2", {"attention_bias": True}, None),
    ("mixtral_attention_bias", "mixtral", {"attention_bias": True}, None),
    ("qwen2_moe_attention_bias", "qwen2_moe", {"attention_bias": True}, None),
    # only weights drawn afresh read it, and a conversion draws none
    ("initializer_range_0", "llama", {"initializer_range": 0.0}, None),
    ("gpt2_initializer_range_0", "gpt2", {"initializer_range": 0}, None),
    # transformers 5's llama3 fallbacks for original_max_position_embeddings: the top-level key, else
    # max_position_embeddings (the fixture's is 16, its max_position_embeddings 64: --seq-len keeps 64)
    ("llama3_original_top_level", "llama", {"rope_parameters": LLAMA3, "original_max_position_embeddings": 16}, None),
    ("llama3_original_from_max_positions", "llama", {"rope_parameters": LLAMA3, "max_position_embeddings": 16}, 64),
    ("llama3_v4_original_from_max_positions", "llama", {"rope_parameters": None, "rope_theta": 1e4,
                                                        "rope_scaling": LLAMA3, "max_position_embeddings": 16}, 64),
    # yarn in transformers 4's spelling (type or rope_type); its factor, when absent, is transformers 5's
    # max_position_embeddings / original_max_position_embeddings (64 / 16); the original context at the top
    # level; betas null (transformers' 32 and 1) the same as written out
    ("yarn_v4", "qwen2_yarn", {"rope_parameters": None, "rope_theta": 100.0,
                               "rope_scaling": {**YARN, "rope_type": None, "type": "yarn"}}, None),
    ("yarn_factor_from_max_positions", "qwen2_yarn", {"rope_parameters": {**YARN, "factor": None}}, None),
    ("yarn_original_top_level", "qwen2_yarn", {"rope_parameters": {**YARN, "original_max_position_embeddings": None},
                                               "original_max_position_embeddings": 16}, None),
]


@pytest.mark.parametrize("case, fixture, changes, seq_len", SAME, ids=[s[0] for s in SAME])
def test_keys_transformers_reads_as_no_change_give_the_fixture_model(case, fixture, changes, seq_len):
    base = json.loads((FIXTURES / fixture / "config.json").read_text())
    changed = {k: v for k, v in {**base, **changes}.items() if v is not None}
    assert read_model(changed, "config.json", seq_len) == read_model(base, "config.json")


@pytest.mark.parametrize("name", ["qwen2", "gpt2"])
def test_a_base_model_checkpoint_converts_with_its_tied_embedding(tmp_path, name):
    """Saved by Qwen2Model / GPT2Model (architectures names the base class, no `model.` /
    `transformer.` prefix, no lm_head) with tie_word_embeddings: AutoModelForCausalLM builds the
    *ForCausalLM of model_type, adds the prefix and ties the output layer; from-hf computes
    transformers' logits from it (with a sliding window in every layer that covers the context,
    for Qwen2)."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / name, hf)
    _config(architectures=["Qwen2Model" if name == "qwen2" else "GPT2Model"])(hf)
    prefix = "model." if name == "qwen2" else "transformer."
    tensors = load_file(str(hf / "model.safetensors"))
    save_file({n.removeprefix(prefix): x for n, x in tensors.items() if n != "lm_head.weight"},
              str(hf / "model.safetensors"), metadata={"format": "pt"})
    if name == "qwen2":
        _config(use_sliding_window=True, sliding_window=64, max_window_layers=0)(hf)
    assert_converts_to_the_fixtures_logits(hf, name, tmp_path / "out")


def assert_converts_to_the_fixtures_logits(hf, fixture: str, out) -> None:
    """from-hf of the altered copy `hf` gives the fixture's transformers logits (to 1e-4)."""
    from_hf(str(hf), str(out))
    expected = load_file(str(FIXTURES / fixture / "expected.safetensors"))
    logits = mtjax.load(str(out)).logits(expected["input_ids"])
    assert float(np.abs(logits - expected["logits"]).max()) < 1e-4


def _base_model(d):
    tensors = load_file(str(d / "model.safetensors"))
    save_file({n.removeprefix("model."): x for n, x in tensors.items() if n != "lm_head.weight"},
              str(d / "model.safetensors"), metadata={"format": "pt"})


REFUSED = [
    ("window_narrower", "qwen2", _config(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                         layer_types=None), None,
     ConfigError, "config.json: sliding_window: 16 is not supported: layer 1 attends within a window of 16 tokens"),
    ("window_narrower_layer_types", "qwen2", _config(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                                     layer_types=["full_attention", "sliding_attention"]), None,
     ConfigError, "config.json: sliding_window: 16 is not supported: layer 1 attends within a window of 16 tokens"),
    ("layer_types_disagree", "qwen2", _config(use_sliding_window=True, sliding_window=16, max_window_layers=0), None,
     ConfigError, "config.json: layer_types: its sliding layers [] disagree with use_sliding_window and "
                  "max_window_layers (layers [0, 1])"),
    ("window_default_4096", "qwen2", _config(use_sliding_window=True, sliding_window=None, max_window_layers=0,
                                             layer_types=None),
     8192, ConfigError, "config.json: use_sliding_window: True is not supported: layers 0-1 attend within a window "
                        "of 4096 tokens, fewer than the 8192 positions"),
    ("window_narrower_than_seq_len_flag", "qwen2", _config(use_sliding_window=True, sliding_window=64,
                                                           max_window_layers=0, layer_types=None), 128,
     ConfigError, "sliding_window: 64 is not supported: layers 0-1 attend within a window of 64 tokens"),
    ("sliding_layer_without_window", "qwen2", _config(layer_types=["full_attention", "sliding_attention"]), None,
     ConfigError, "layer_types: lists layer 1 as sliding_attention, but config.json sets no sliding_window"),
    # (layer_types unread: every layer slides, as MixtralModel's and Qwen3MoeModel's one mask does)
    ("mixtral_window_despite_layer_types", "mixtral", _config(sliding_window=16, layer_types=["full_attention"] * 2),
     None, ConfigError, "config.json: sliding_window: 16 is not supported: layers 0-1 attend within a window of 16"),
    ("qwen3_moe_window_despite_layer_types", "qwen3_moe", _config(use_sliding_window=True, sliding_window=16,
                                                                  layer_types=["full_attention"] * 2),
     None, ConfigError, "config.json: sliding_window: 16 is not supported: layers 0-1 attend within a window of 16"),
    ("qwen3_attention_bias", "qwen3", _config(attention_bias=True), None, ConfigError, "attention_bias: True"),
    ("base_model_untied", "llama_plain", _base_model, None, DataError,
     "no tensor lm_head.weight: the file holds a base model's weights (names without 'model.'), which have no "
     "output layer, and config.json's tie_word_embeddings is false"),
]


@pytest.mark.parametrize("case, fixture, damage, seq_len, error, text", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_mtjax_cannot_compute_is_one_line_naming_the_key(tmp_path, case, fixture, damage, seq_len, error, text):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / fixture, hf)
    damage(hf)
    with pytest.raises(error) as info:
        from_hf(str(hf), str(tmp_path / "out"), seq_len)
    assert text in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# ----------------------------------------------------------------- biases transformers drops

def _biases(projections: str, seed: int = 0):
    """Random biases of the named attention projections in every layer (as a file whose
    config.json says attention_bias: true would hold them)."""
    def edit(d):
        tensors = load_file(str(d / "model.safetensors"))
        rng = np.random.default_rng(seed)
        for i in range(2):
            for x in projections:
                out = tensors[f"model.layers.{i}.self_attn.{x}_proj.weight"].shape[0]
                tensors[f"model.layers.{i}.self_attn.{x}_proj.bias"] = rng.standard_normal(out).astype(np.float32)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


@pytest.mark.parametrize("fixture, projections", [("qwen2", "o"), ("mistral", "qkvo")])
def test_attention_biases_the_class_does_not_build_are_dropped(tmp_path, fixture, projections):
    """attention_bias: true with its bias tensors, in a family whose attention does not read the
    key (Qwen2: q/k/v biases always, o_proj never; Mistral: none): transformers'
    from_pretrained drops the biases its class lacks (unexpected keys) and computes the fixture's
    logits, and so does from-hf."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / fixture, hf)
    _config(attention_bias=True)(hf)
    _biases(projections)(hf)
    assert_converts_to_the_fixtures_logits(hf, fixture, tmp_path / "out")


def _extra_mlp_bias(d):
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.bias"] = tensors["model.norm.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case, damage, text", [
    # without attention_bias: true the file contradicts its config.json
    ("o_bias_without_attention_bias", _biases("o"), "unexpected tensor model.layers.0.self_attn.o_proj.bias "
                                                    "(and 1 more)"),
    # with it, only the attention biases are dropped: anything else stays unexpected
    ("other_tensor_with_attention_bias", lambda d: (_config(attention_bias=True)(d), _biases("o")(d),
                                                    _extra_mlp_bias(d)),
     "unexpected tensor model.layers.0.mlp.up_proj.bias: the config.json model has no such parameter"),
])
def test_other_unexpected_tensors_are_still_refused(tmp_path, case, damage, text):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "qwen2", hf)
    damage(hf)
    with pytest.raises(DataError) as e:
        from_hf(str(hf), str(tmp_path / "out"))
    assert text in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# ----------------------------------------------------------------- memory

def test_the_step_0_optimizer_state_is_adamw_fresh_state(tmp_path):
    """from-hf writes the optimizer state from zeros without building it: it must be what
    AdamW's init gives for these weights (every leaf, moments and counts)."""
    from_hf(str(FIXTURES / "qwen2"), str(tmp_path / "out"))
    trainer, state = restore(tmp_path / "out")
    fresh = trainer.tx.init(state.params)
    assert jax.tree.structure(fresh) == jax.tree.structure(state.opt_state)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(state.opt_state)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


MEASURE = """
import json, sys
from mtjax.commands.convert_hf import from_hf
import mtjax.convert.checkpoints, mtjax.training.trainer  # (imported by from_hf: not counted)
def kib(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
before = kib("VmHWM:")
from_hf(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "after": kib("VmHWM:")}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak resident memory from /proc")
def test_from_hf_holds_about_the_weights_once(tmp_path):
    """A 25M-parameter Llama (bf16 on disk, 100 MB in fp32): the conversion's peak resident
    memory grows by less than three fp32 copies of the weights. Building fp32 weights on the
    device with AdamW's two moments, then orbax's host copies of all three, took about 6 (now 2.3)."""
    h, f, v, layers = 512, 1024, 16384, 4
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": h, "num_hidden_layers": layers, "intermediate_size": f,
        "vocab_size": v, "num_attention_heads": 8, "max_position_embeddings": 64}))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(layers):
        shapes |= {f"model.layers.{i}.self_attn.{x}_proj.weight": (h, h) for x in "qkvo"}
        shapes |= {f"model.layers.{i}.mlp.{x}_proj.weight": (f, h) for x in ("gate", "up")}
        shapes |= {f"model.layers.{i}.mlp.down_proj.weight": (h, f), f"model.layers.{i}.input_layernorm.weight": (h,),
                   f"model.layers.{i}.post_attention_layernorm.weight": (h,)}
    import ml_dtypes
    save_file({n: rng.standard_normal(s, np.float32).astype(ml_dtypes.bfloat16) for n, s in shapes.items()},
              str(hf / "model.safetensors"), metadata={"format": "pt"})
    weights = 4 * sum(int(np.prod(s)) for s in shapes.values())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", MEASURE, str(hf), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    peak = json.loads(r.stdout.strip().splitlines()[-1])
    grew = (peak["after"] - peak["before"]) * 1024
    assert grew < 3 * weights, f"peak grew by {grew / weights:.2f} times the fp32 weights ({weights >> 20} MiB)"


def test_yarn_keys_written_read_back_in_both_spellings():
    """to-hf's yarn keys (betas, an attention factor given) give the same rope fields read from
    transformers 5's rope_parameters or from 4's rope_theta + rope_scaling alone."""
    from mtjax.config.schema import ModelConfig
    from mtjax.convert.hf_config import _get
    from mtjax.convert.hf_rope import rope_fields, rope_keys
    m = ModelConfig(arch="llama", rope_theta=1e6, rope_scaling="yarn", rope_scaling_factor=8.0,
                    rope_original_positions=4096, rope_beta_fast=16.0, rope_beta_slow=2.0, rope_attention_factor=1.3)
    keys = rope_keys(m)
    assert keys["rope_parameters"]["attention_factor"] == 1.3 and keys["rope_scaling"]["rope_type"] == "yarn"
    want = {f: getattr(m, f) for f in ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_positions",
                                       "rope_beta_fast", "rope_beta_slow", "rope_attention_factor")}
    assert rope_fields(keys, _get) == want
    assert rope_fields({k: v for k, v in keys.items() if k != "rope_parameters"}, _get) == want
    derived = rope_keys(ModelConfig(arch="llama", rope_scaling="yarn", rope_scaling_factor=4.0))
    assert "attention_factor" not in derived["rope_parameters"]       # (0: transformers derives it too)
