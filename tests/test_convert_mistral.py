"""Mistral in and out.

The oracle is tests/fixtures/hf/mistral (scripts/make_hf_fixtures.py: a MistralForCausalLM with
head_dim 16 != h/a and a sliding_window of 32 = s, and transformers' logits), whose logits,
to-hf round trip and loading by transformers tests/test_convert.py checks with the other
fixtures. Here: the defaults of MistralConfig for keys config.json leaves out, its window,
to-hf's choice between Llama and Mistral, and the window a conversion keeps (every family's:
recorded, refused past, written back).
"""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mtjax
from test_convert import FIXTURES, _config, converted   # noqa: F401  (converted: from-hf once per module)
from mtjax.commands.convert_hf import from_hf, to_hf
from mtjax.config.errors import ConfigError
from mtjax.convert.hf_config import read_model

# the keys a Mistral config.json cannot leave out; MistralConfig's defaults for the rest
MINIMAL = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 16,
           "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 300}


def test_keys_left_out_take_mistral_configs_defaults():
    """MistralConfig: max_position_embeddings 131072, num_key_value_heads 8 (null: the heads),
    rope_theta 1e4, rms_norm_eps 1e-6, untied, head_dim h/a (null too), sliding_window 4096
    when absent (null: none)."""
    m = read_model({**MINIMAL, "sliding_window": None}, "config.json")
    assert (m.arch, m.seq_len, m.num_kv_heads, m.kv_channels, m.rope_theta, m.norm_eps, m.tied) == \
        ("llama", 131072, 8, 0, 1e4, 1e-6, False)
    assert not (m.qkv_bias or m.qk_norm)
    null = read_model({**MINIMAL, "sliding_window": None, "num_key_value_heads": None, "head_dim": None}, "c")
    assert (null.num_kv_heads, null.kv_channels) == (0, 0)
    # Mistral Nemo's head_dim 128 is not h/a = 160
    nemo = read_model({**MINIMAL, "sliding_window": None, "hidden_size": 5120, "num_attention_heads": 32,
                       "head_dim": 128}, "c")
    assert nemo.kv_channels == 128 and nemo.head_dim == 128
    with pytest.raises(ConfigError) as e:
        read_model(MINIMAL, "c/config.json")
    assert str(e.value).startswith("c/config.json: sliding_window: absent (so 4096) is not supported: layers 0-1 "
                                   "attend within a window of 4096 tokens, fewer than the 131072 positions")
    assert read_model(MINIMAL, "c", seq_len=4096).seq_len == 4096


def test_mistral_v01_window_converts_only_within_it():
    """Mistral 7B v0.1: a window of 4096 over max_position_embeddings 32768 is refused naming
    sliding_window; at --seq-len 4096 the window masks nothing and it converts."""
    v01 = {**MINIMAL, "model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096,
           "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "num_key_value_heads": 2}
    with pytest.raises(ConfigError, match=r"^c: sliding_window: 4096 is not supported: layers 0-1 attend within "
                                          r"a window of 4096 tokens, fewer than the 32768 positions"):
        read_model(v01, "c")
    assert read_model(v01, "c", seq_len=4096) == read_model({**v01, "sliding_window": None}, "c", seq_len=4096)


@pytest.mark.parametrize("changes", [{"sliding_window": None}, {"sliding_window": 1000}, {"attention_bias": True},
                                     {"layer_types": ["sliding_attention"] * 2}, {"architectures": ["MistralModel"]},
                                     {"architectures": None}],
                         ids=["no_window", "wide_window", "attention_bias", "layer_types", "base_class", "model_type"])
def test_keys_mistral_does_not_read_or_that_change_nothing(changes):
    """MistralModel builds one mask for every layer from sliding_window (layer_types unread) and
    fixed, bias-free projections (attention_bias unread); a window >= s masks nothing."""
    base = json.loads((FIXTURES / "mistral" / "config.json").read_text())
    changed = {k: v for k, v in {**base, **changes}.items() if v is not None or k == "sliding_window"}
    assert read_model(changed, "config.json") == read_model(base, "config.json")


def test_mlp_bias_is_read_by_llama_only_and_a_zero_head_dim_is_mistrals_default():
    """transformers' Llama MLP reads mlp_bias; Mistral's, Qwen2's and Qwen3's are bias-free whatever
    it says. MistralAttention (Mixtral's too) takes `head_dim or h / a`; the others refuse 0 (it is no size)."""
    fixture = lambda name: json.loads((FIXTURES / name / "config.json").read_text())    # noqa: E731
    for name in ("mistral", "qwen2", "qwen3"):
        assert read_model({**fixture(name), "mlp_bias": True}, "c") == read_model(fixture(name), "c"), name
    with pytest.raises(ConfigError, match=r"^c: mlp_bias: True is not supported"):
        read_model({**fixture("llama"), "mlp_bias": True}, "c")
    plain = {k: v for k, v in fixture("mistral").items() if k != "head_dim"}
    assert read_model({**plain, "head_dim": 0}, "c") == read_model(plain, "c")
    assert read_model({**fixture("mixtral"), "head_dim": 0}, "c") == read_model(fixture("mixtral"), "c")
    for name, bad in (("mistral", -1), ("llama", 0)):
        with pytest.raises(ConfigError, match=r"^c: head_dim: must be positive"):
            read_model({**fixture(name), "head_dim": bad}, "c")


def test_a_window_narrower_than_the_context_is_refused_and_nothing_written(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mistral", hf)
    _config(sliding_window=16)(hf)
    with pytest.raises(ConfigError) as e:
        from_hf(str(hf), str(tmp_path / "out"))
    assert "config.json: sliding_window: 16 is not supported: layers 0-1 attend within a window of 16 tokens" \
        in str(e.value) and "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# ----------------------------------------------------------------- to-hf: Llama or Mistral

def test_to_hf_writes_a_converted_mistral_as_mistral(converted, tmp_path):
    """The family from-hf recorded decides: MistralForCausalLM, head_dim kept, and the window
    from-hf recorded (32, which covered the 32 positions); --family llama writes the same tensors
    as Llama (no window: the same model over its 32 positions)."""
    mistral_run = converted("mistral")
    config = to_hf(str(mistral_run), str(tmp_path / "hf"))
    assert (config["architectures"], config["model_type"]) == (["MistralForCausalLM"], "mistral")
    assert config["sliding_window"] == 32 and config["head_dim"] == 16 and config["num_key_value_heads"] == 2
    assert "attention_bias" not in config and "layer_types" not in config
    llama = to_hf(str(mistral_run), str(tmp_path / "llama"), family="llama")
    assert llama["architectures"] == ["LlamaForCausalLM"] and "sliding_window" not in llama
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "llama"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_to_hf_family_option(tmp_path):
    """--family mistral writes a plain llama as Mistral; a family that cannot express the model
    (Mistral has no q/k/v biases) or no family at all is one line naming --family, nothing written."""
    from_hf(str(FIXTURES / "llama_plain"), str(tmp_path / "llama"))
    assert to_hf(str(tmp_path / "llama"), str(tmp_path / "plain"))["architectures"] == ["LlamaForCausalLM"]
    assert to_hf(str(tmp_path / "llama"), str(tmp_path / "as_mistral"), "mistral")["model_type"] == "mistral"
    from_hf(str(FIXTURES / "qwen2"), str(tmp_path / "qwen2"))
    for family, text in (("mistral", "--family: mistral cannot express this model, which is written as qwen2"),
                         ("phi", "--family: 'phi' is not one mtjax writes")):
        with pytest.raises(ConfigError) as e:
            to_hf(str(tmp_path / "qwen2"), str(tmp_path / "out"), family)
        assert str(e.value).startswith(text) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_base_mistral_model_converts(tmp_path):
    """Saved by MistralModel (architectures MistralModel, no `model.` prefix), with the output
    layer beside it: from-hf reads it as from_pretrained of MistralForCausalLM does."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mistral", hf)
    _config(architectures=["MistralModel"])(hf)
    tensors = load_file(str(hf / "model.safetensors"))
    save_file({n.removeprefix("model."): x for n, x in tensors.items()}, str(hf / "model.safetensors"),
              metadata={"format": "pt"})
    from_hf(str(hf), str(tmp_path / "out"))
    expected = load_file(str(FIXTURES / "mistral" / "expected.safetensors"))
    assert float(np.abs(mtjax.load(str(tmp_path / "out")).logits(expected["input_ids"]) - expected["logits"]).max()) \
        < 1e-4


# ----------------------------------------------------------------- the window, kept after the conversion

def test_no_run_or_generation_goes_past_the_recorded_window(converted, tmp_path):
    """from-hf records the fixture's window (32, every layer) in the checkpoint's meta: train.init_from,
    a resume (the conversion fine-tuned in place) and generation at model.seq_len 64 are refused in
    one line naming model.seq_len; at 32 (or fewer) they go on."""
    from mtjax.checkpoint import Checkpointer
    from mtjax.checkpoint.init_from import find_source
    from mtjax.checkpoint.params import saved_config
    from mtjax.config import load_config
    run = converted("mistral")
    meta = saved_config(str(run / "checkpoints"), 0)[0]
    assert meta["hf_sliding_window"] == {"window": 32, "layers": [0, 1]}
    from mtjax.checkpoint.compat import carried    # kept by the checkpoints trained from it (run.restore)
    assert carried(meta) == {"hf_family": "mistral", "hf_sliding_window": meta["hf_sliding_window"]}
    text = ("model.seq_len: 64 is longer than the sliding window of 32 tokens that the weights of checkpoint step 0 "
            "attend within")

    def refused(call):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith(text) and "\n" not in str(e.value), str(e.value)

    for seq_len, check in ((64, refused), (32, lambda call: call())):
        cfg = load_config(str(run / "config.yaml"), [f"model.seq_len={seq_len}", f"train.init_from={run}",
                                                     f"train.run_dir={tmp_path / 'ft'}"])
        check(lambda: find_source(cfg))
        checkpointer = Checkpointer(cfg, str(run / "checkpoints"), read_only=True)
        try:
            check(lambda: checkpointer.check_restorable(0, cfg, meta["vocab"]))
        finally:
            checkpointer.close()
    refused(lambda: mtjax.load(str(run), overrides=["model.seq_len=64"]))
    assert mtjax.load(str(run), overrides=["model.seq_len=16"]).seq_len == 16


def test_a_resume_past_the_window_names_the_window_not_data_allow_change(converted):
    """A trained step (> 0) resumed at a longer model.seq_len is refused for its data position
    unless data.allow_change; past the recorded window allow_change cannot help, so the window is
    the refusal given first (it used to say 'set data.allow_change=true', which then met the window)."""
    from mtjax.checkpoint import Checkpointer
    from mtjax.checkpoint.params import saved_config
    from mtjax.config import load_config
    run = converted("mistral")
    meta, saved = saved_config(str(run / "checkpoints"), 0)
    for allow in ("false", "true"):
        cfg = load_config(str(run / "config.yaml"), ["model.seq_len=64", f"data.allow_change={allow}"])
        checkpointer = Checkpointer(cfg, str(run / "checkpoints"), read_only=True)
        checkpointer.saved = lambda step: (meta, saved)     # the conversion's step 0, read as a trained step 5
        try:
            with pytest.raises(ConfigError) as e:
                checkpointer.check_restorable(5, cfg, meta["vocab"])
        finally:
            checkpointer.close()
        assert e.value.key == "model.seq_len" and "sliding window of 32 tokens" in str(e.value), str(e.value)


# (fixture, config.json changes: a window that covers the fixture's context, the sliding layers)
WINDOWS = [("mistral", {"sliding_window": 48}, [0, 1]), ("mixtral", {"sliding_window": 40}, [0, 1]),
           ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "layer_types": None},
            [1]),
           ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0, "layer_types": None},
            [0, 1]),
           ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 32,
                          "layer_types": ["full_attention", "sliding_attention"]}, [1]),
           ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 32}, [0, 1]),
           ("qwen2", {}, None), ("llama", {}, None), ("gpt2", {}, None)]


@pytest.mark.parametrize("name, changes, layers", WINDOWS, ids=[w[0] + ("_window" if w[2] else "") for w in WINDOWS])
def test_each_family_writes_back_the_window_it_was_converted_with(name, changes, layers):
    """The window from-hf records (the sliding layers as transformers reads them) comes back in the
    family's own keys from to-hf's config.json, which reads as the same model and the same window."""
    from mtjax.convert.hf_config import hf_config, recorded_window
    hf = {k: v for k, v in {**json.loads((FIXTURES / name / "config.json").read_text()), **changes}.items()
          if v is not None}
    model, record = read_model(hf, "c"), recorded_window(hf)
    assert record == (None if layers is None else {"window": hf["sliding_window"], "layers": layers})
    back = hf_config(model, model.vocab_size, family=hf["model_type"], window=record)
    assert read_model(back, "c") == model and recorded_window(back) == record
    if record is None:
        assert not back.get("sliding_window") and not back.get("use_sliding_window")
    elif name in ("qwen2", "qwen2_moe"):
        assert back["layer_types"] == ["full_attention", "sliding_attention"] and back["max_window_layers"] == 1
