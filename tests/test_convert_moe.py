"""`python -m mtjax.convert` for mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE (QK-norm),
against transformers.

The oracle is tests/fixtures/hf/{mixtral,qwen2_moe,qwen3_moe} (scripts/make_hf_fixtures.py): tiny random
models saved by transformers (each expert's matrices as tensors of their own), the logits it
computed and the tokens its greedy search added to a prompt. from-hf must reproduce both through
mtjax, at e = 1 and e = 2; to-hf must give back the very same tensors; a random mtjax checkpoint
saved at e = 2 must survive to-hf then from-hf bitwise; an expert tensor missing or beyond E is
an error naming it.
"""
import dataclasses
import json
import shutil
import subprocess

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mtjax
from layouts import VOCAB, build, tiny_config
from mtjax.checkpoint import Checkpointer
from mtjax.commands.convert_hf import from_hf, to_hf
from mtjax.config import load_config
from mtjax.config.errors import ConfigError
from mtjax.config.schema import ModelConfig
from mtjax.convert.hf_config import hf_config, read_model
from mtjax.convert.safetensors_io import read_tensors
from mtjax.data.errors import DataError
from mtjax.mesh import make_mesh
from mtjax.training.trainer import Trainer
from test_convert import (FIXTURES, HF_PYTHON, REPO, VOCAB_AXIS, _config, _tensors, converted,  # noqa: F401 (fixture)
                          leaves, restore)

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
STATS = "['layers']['moe']['stats']"    # the routing statistics' zero parameter: no HF tensor


@pytest.mark.parametrize("name", MOE)
def test_from_hf_reproduces_transformers_and_to_hf_gives_it_back(converted, name, tmp_path):
    """Logits at 1e-4 and greedy generation token for token; then to-hf: every tensor bitwise, and
    its config.json the same model config."""
    model = mtjax.load(str(converted(name)))
    expected = load_file(str(FIXTURES / name / "expected.safetensors"))
    err = float(np.abs(model.logits(expected["input_ids"]) - expected["logits"]).max())
    assert err < 1e-4, f"{name}: max |mtjax - transformers| = {err}"
    assert model.generate([int(i) for i in expected["prompt"]], len(expected["generated"])) == \
        [int(i) for i in expected["generated"]]

    to_hf(str(converted(name)), str(tmp_path / "hf"))
    original, _ = read_tensors(str(FIXTURES / name))
    exported, _ = read_tensors(str(tmp_path / "hf"))
    assert sorted(exported) == sorted(original)
    for key, x in original.items():
        assert exported[key].dtype == x.dtype and np.array_equal(exported[key], x), key
    config = tmp_path / "hf" / "config.json"      # read as from-hf reads it
    assert read_model(json.loads(config.read_text()), str(config)) == \
        load_config(str(converted(name) / "config.yaml")).model


def test_converted_mixtral_runs_at_e2(converted):
    """The experts' stored shape does not depend on e: the converted checkpoint, restored by
    training's Checkpointer with its 4 experts split over e = 2 of 2 data ranks, computes
    transformers' logits."""
    out = converted("mixtral")
    cfg = load_config(str(out / "config.yaml"), ["parallel.data=2", "parallel.expert=2"])
    trainer = Trainer(cfg, make_mesh(2, 1, 1, jax.devices()[:2]), cfg.model.vocab_size)
    checkpointer = Checkpointer(cfg, str(out / "checkpoints"))
    try:
        state = checkpointer.restore(checkpointer.latest_valid(), trainer)
    finally:
        checkpointer.close()
    expected = load_file(str(FIXTURES / "mixtral" / "expected.safetensors"))
    logits = np.asarray(trainer.logits_fn(state.params, expected["input_ids"]))
    assert float(np.abs(logits - expected["logits"]).max()) < 1e-4


E2 = {"Qwen2MoeForCausalLM": ["model.moe_shared_expert_size=48", "model.moe_shared_expert_gate=true",
                               "model.qkv_bias=true", "model.moe_renormalize=false"],
      "Qwen3MoeForCausalLM": ["model.qk_norm=true", "model.kv_channels=8"]}


@pytest.mark.parametrize("architecture", E2)
def test_e2_checkpoint_survives_to_hf_then_from_hf_bitwise(tmp_path, architecture):
    """A Qwen2-MoE-shaped checkpoint (shared expert with its gate, q/k/v biases, top-k not
    renormalised, experts narrower than f), or a Qwen3-MoE one (QK-norm, d != h/a), saved at e = 2
    with every weight random: to-hf then from-hf gives the same model config and the same weights
    bit for bit (the statistics' parameter, which has no HF tensor, comes back as zeros)."""
    cfg = tiny_config("llama", data=2, extra=[
        f"model.vocab_size={VOCAB}", "checkpoint.async_save=false", "model.num_experts=4", "model.moe_top_k=2",
        "model.moe_ffn_hidden_size=32", "parallel.expert=2", *E2[architecture]])
    trainer = build(cfg, 2, 1, 1)
    state = trainer.init_state()
    keys = jax.random.split(jax.random.key(7), 64)
    noisy = jax.jit(lambda params: jax.tree.unflatten(jax.tree.structure(params), [
        jax.random.normal(keys[i], x.shape, x.dtype) for i, x in enumerate(jax.tree.leaves(params))]),
        out_shardings=trainer.state_shardings.params)(state.params)
    state = state.replace(params=noisy)
    checkpointer = Checkpointer(cfg, str(tmp_path / "run" / "checkpoints"))
    checkpointer.save(state, trainer)
    checkpointer.close()

    config = to_hf(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert config["architectures"] == [architecture]
    from_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    trainer_back, back = restore(tmp_path / "back")
    assert trainer_back.cfg.model == cfg.model
    before, after = leaves(state.params), leaves(back.params)
    assert sorted(before) == sorted(after) and not after[STATS].any()
    for path, x in before.items():
        y = after[path]
        if path in VOCAB_AXIS:
            x, y = (np.take(a, np.arange(VOCAB), axis=VOCAB_AXIS[path]) for a in (x, y))
        assert path == STATS or (x.dtype == y.dtype and np.array_equal(x, y)), path


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_dense_layers_among_sparse_ones_round_trip(tmp_path, family):
    """Qwen2-MoE (and Qwen3-MoE, the same keys) with 4 layers, decoder_sparse_step 2 and mlp_only_layers [1] (layers 0-2 dense, 3
    sparse; built from the fixture's tensors and random dense MLPs): from-hf reads it as
    moe_layer_freq 2, moe_first_dense 3 and stores a dense prefix of 2 layers and one unit [dense,
    MoE] (`model/layer_pattern.py`), each tensor where its layer lands; to-hf gives every tensor
    back bitwise with the same sparse layers. No model compile: the weights only travel."""
    from mtjax.convert.checkpoints import load_params
    base = json.loads((FIXTURES / family / "config.json").read_text())
    fixture, _ = read_tensors(str(FIXTURES / family))
    tensors = {n: x for n, x in fixture.items() if not n.startswith("model.layers.")}
    for n, x in fixture.items():
        if n.startswith("model.layers.1."):        # the sparse layer 3
            tensors[n.replace("layers.1.", "layers.3.")] = x
        elif n.startswith("model.layers.0.") and ".mlp." not in n:
            tensors.update({n.replace("layers.0.", f"layers.{i}."): x + i for i in range(3)})
    f, h, rng = base["intermediate_size"], base["hidden_size"], np.random.RandomState(0)
    tensors.update({f"model.layers.{i}.mlp.{name}.weight": rng.standard_normal(shape).astype(np.float32)
                    for i in range(3) for name, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)),
                                                          ("down_proj", (h, f)))})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**base, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                                "mlp_only_layers": [1], "layer_types": ["full_attention"] * 4}))
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})

    m = from_hf(str(hf), str(tmp_path / "mt")).model
    assert (m.moe_layer_freq, m.moe_first_dense) == (2, 3)
    stored = load_params(str(tmp_path / "mt"))[2]
    assert np.array_equal(stored["dense_layers/mlp/gate/kernel"][1], tensors["model.layers.1.mlp.gate_proj.weight"].T)
    assert np.array_equal(stored["layers/dense_0/mlp/fc2/kernel"][0], tensors["model.layers.2.mlp.down_proj.weight"].T)
    assert np.array_equal(stored["layers/dense_0/ln_attn/scale"][0], tensors["model.layers.2.input_layernorm.weight"])
    assert np.array_equal(stored["layers/moe/router"][0], tensors["model.layers.3.mlp.gate.weight"].T)
    assert np.array_equal(stored["layers/ln_attn/scale"][0], tensors["model.layers.3.input_layernorm.weight"])
    config = to_hf(str(tmp_path / "mt"), str(tmp_path / "back"))
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (2, [1])
    back, _ = read_tensors(str(tmp_path / "back"))
    assert sorted(back) == sorted(tensors)
    for key, x in tensors.items():
        assert np.array_equal(back[key], x), key


W2 = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
UP3 = "model.layers.1.mlp.experts.2.up_proj.weight"
BAD = [  # (id, fixture, damage, error, text)
    ("missing_expert", "mixtral", _tensors(lambda t: t.pop(W2)), DataError, f"no tensor {W2}"),
    ("extra_expert", "mixtral", _tensors(lambda t: t.update({W2.replace("experts.3", "experts.4"): t[W2]})),
     DataError, "unexpected tensor model.layers.1.block_sparse_moe.experts.4.w2.weight"),
    ("missing_shared_gate", "qwen2_moe", _tensors(lambda t: t.pop("model.layers.0.mlp.shared_expert_gate.weight")),
     DataError, "no tensor model.layers.0.mlp.shared_expert_gate.weight"),
    ("qwen3_missing_expert", "qwen3_moe", _tensors(lambda t: t.pop(UP3)), DataError, f"no tensor {UP3}"),
    ("qwen3_extra_expert", "qwen3_moe", _tensors(lambda t: t.update({UP3.replace("experts.2", "experts.4"): t[UP3]})),
     DataError, "unexpected tensor model.layers.1.mlp.experts.4.up_proj.weight"),
    ("missing_k_norm", "qwen3_moe", _tensors(lambda t: t.pop("model.layers.0.self_attn.k_norm.weight")),
     DataError, "no tensor model.layers.0.self_attn.k_norm.weight"),
    ("qwen3_attention_bias", "qwen3_moe", _config(attention_bias=True), ConfigError, "attention_bias: True"),
    ("jitter", "mixtral", _config(router_jitter_noise=0.01), ConfigError, "router_jitter_noise: 0.01"),
    ("mixtral_sliding", "mixtral", _config(sliding_window=16), ConfigError, "sliding_window: 16"),
    # a dense layer after a sparse one, and no sparse layer: mtjax's dense layers are the first, then all but
    # every decoder_sparse_step-th (`hf_moe.sparse_layers`)
    ("dense_layers", "qwen2_moe", _config(mlp_only_layers=[1]), ConfigError, "mlp_only_layers: [1]"),
    ("sparse_step", "qwen2_moe", _config(decoder_sparse_step=3), ConfigError, "decoder_sparse_step: 3"),
    ("dense_layer_tensors", "qwen2_moe", _config(mlp_only_layers=[0]), DataError,
     "no tensor model.layers.0.mlp.gate_proj.weight"),
    ("top_k", "mixtral", _config(num_experts_per_tok=5), ConfigError,
     "num_experts_per_tok: top_k 5 is more than num_local_experts 4"),
    ("qwen3_top_k", "qwen3_moe", _config(num_experts_per_tok=5), ConfigError,     # (its count: num_local_experts)
     "num_experts_per_tok: top_k 5 is more than num_local_experts 4"),
]


@pytest.mark.parametrize("case, fixture, damage, error, text", BAD, ids=[b[0] for b in BAD])
def test_bad_moe_input_is_refused(tmp_path, case, fixture, damage, error, text):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / fixture, hf)
    damage(hf)
    with pytest.raises(error) as info:
        from_hf(str(hf), str(tmp_path / "out"))
    assert text in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("change, key", [
    ({"moe_capacity_factor": 1.0}, "model.moe_capacity_factor"), ({"moe_score": "sigmoid"}, "model.moe_score"),
    ({"moe_renormalize": False}, "model.moe_renormalize"), ({"qkv_bias": True}, "model.qkv_bias"),
    ({"moe_shared_expert_size": 32}, "model.moe_shared_expert_gate"), ({"arch": "gpt"}, "model.arch"),
    ({"qk_norm": True, "moe_shared_expert_size": 32, "moe_shared_expert_gate": True}, "model.moe_shared_expert_size"),
    ({"qk_norm": True, "qkv_bias": True}, "model.qkv_bias"),
    ({"qk_norm": True, "qkv_bias": True, "num_experts": 0}, "model.qkv_bias"),      # a dense Qwen3
    ({"moe_first_dense": 2, "num_layers": 4}, "model.moe_first_dense"), ({"moe_layer_freq": 2}, "model.moe_layer_freq")])
def test_to_hf_refuses_what_transformers_cannot_express(change, key):
    m = ModelConfig(**{"arch": "llama", "num_experts": 4, **change})
    with pytest.raises(ConfigError) as info:
        hf_config(m, 256)
    assert info.value.key == key


@pytest.mark.parametrize("name, extra", [
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "moe_renormalize": False, "tie_embeddings": False}),
    ("Qwen3ForCausalLM", {"tie_embeddings": True})])
def test_qk_norm_configs_round_trip(name, extra):
    """Written as Qwen3(-MoE), with head_dim != h/a, and read back to the same model config."""
    m = ModelConfig(arch="llama", qk_norm=True, num_kv_heads=2, kv_channels=32, **extra)
    hf = hf_config(m, 256)
    assert hf["architectures"] == [name] and hf["head_dim"] == 32
    assert read_model(json.loads(json.dumps(hf)), "config.json") == dataclasses.replace(m, vocab_size=256)


@pytest.mark.skipif(HF_PYTHON is None, reason="set MTJAX_HF_PYTHON to a Python with torch and transformers")
def test_transformers_loads_moe_to_hf_output(converted, tmp_path):
    """transformers' from_pretrained finds exactly the expert weights it expects in to-hf's output
    and computes the fixture's logits from them."""
    args = []
    for name in MOE:
        to_hf(str(converted(name)), str(tmp_path / name))
        ids = load_file(str(FIXTURES / name / "expected.safetensors"))["input_ids"]
        save_file({"input_ids": ids}, str(tmp_path / f"{name}.safetensors"))
        args += [str(tmp_path / name), str(tmp_path / f"{name}.safetensors")]
    r = subprocess.run([HF_PYTHON, str(REPO / "tests" / "hf_load.py"), *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in MOE:
        logits = load_file(str(tmp_path / f"{name}.safetensors"))["logits"]
        expected = load_file(str(FIXTURES / name / "expected.safetensors"))["logits"]
        assert float(np.abs(logits - expected).max()) < 1e-4, name
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == name


def test_keys_left_out_take_the_family_defaults_of_transformers():
    """A config.json that leaves a key out means the default of its transformers config class:
    MixtralConfig's rope_theta is 1e6 (also under rope_parameters, transformers 5's default_theta),
    its rms_norm_eps 1e-5 and its num_key_value_heads 8 (null: the number of heads), not Llama's."""
    from mtjax.convert.hf_config import model_fields
    hf = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
    bare = {k: v for k, v in hf.items() if k not in ("rms_norm_eps", "rope_parameters", "num_key_value_heads")}
    fields = model_fields({**bare, "num_attention_heads": 16, "hidden_size": 64})
    assert (fields["rope_theta"], fields["norm_eps"], fields["num_kv_heads"]) == (1e6, 1e-5, 8)
    assert model_fields({**bare, "rope_parameters": {"rope_type": "default"}})["rope_theta"] == 1e6
    assert model_fields({**bare, "num_key_value_heads": None})["num_kv_heads"] == 0        # = a
    llama = {**bare, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert (model_fields(llama)["rope_theta"], model_fields(llama)["norm_eps"]) == (1e4, 1e-6)
