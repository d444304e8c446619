"""config.json <-> the `model` config group, for GPT-2, Llama, Mistral, Qwen2 and Qwen3 (the MoE keys in
`hf_moe.py`).

from-hf reads the family (`hf_families.py`: `architectures[0]`, else `model_type`), then every config.json
key that shapes the function the model computes: it maps to a model field, or it is refused
with a ConfigError naming the key (an option mtjax lacks: a sliding window narrower than the
context (`hf_window.py`), an MLP bias, a rope scaling other than linear, llama3 or yarn, ...). The
dropout rates and initializer_range carry over too (an initializer_range init_std refuses, as 0,
is the default: a conversion initialises nothing); keys that change neither the logits nor
training (token ids, cache, dtype), or that the family's transformers class ignores
(attention_bias of Qwen2, Qwen2-MoE, Mixtral, Mistral), are ignored.
to-hf writes max_position_embeddings = model.seq_len, the tokenizer's BOS/EOS ids and a recorded window.

    GPT2LMHeadModel   -> arch gpt  (learned positions, LayerNorm, biases everywhere, GeLU)
    LlamaForCausalLM  -> arch llama (RoPE, RMSNorm, SwiGLU, no biases)
    MistralForCausalLM -> arch llama: Llama's layer, its head_dim free of h/a, a sliding_window in
                         every layer (converted where it covers the context: `hf_window.py`)
    Qwen2ForCausalLM  -> arch llama with qkv_bias (Llama plus biases on Q, K and V)
    Qwen3ForCausalLM  -> arch llama with qk_norm (Llama plus an RMSNorm of each head of Q and K)
    MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM -> arch llama with experts (`hf_moe.py`)

Fields equal to their derived default are written as the default (num_kv_heads 0 when k = a,
kv_channels 0 when d = h/a, activation "" for the arch's own, ffn_hidden_size 0 when f is
the arch's formula), so a config round-trips through to-hf and from-hf unchanged. A dense llama
without biases or QK-norm is Llama's and Mistral's model alike: to-hf writes it as Llama unless
asked for Mistral (`model_family`), as the recorded source family of a conversion does.
to-hf writes the keys transformers 5 saves, and, for rotary settings, transformers 4's
`rope_theta`/`rope_scaling` beside 5's `rope_parameters`, so that either version loads it.
"""
from __future__ import annotations

import re

from mtjax.config.errors import ConfigError
from mtjax.config.load import coerce
from mtjax.config.schema import Config, ModelConfig
from mtjax.convert import hf_families, hf_moe, hf_rope, hf_window
from mtjax.convert.hf_families import ATTENTION_BIAS, KV_HEADS, NORM_EPS, ROPE_THETA, SEQ_LEN

REQUIRED = object()
# transformers' ACT2FN names for the two GeLUs mtjax has: gelu_fast is the tanh form (its constant
# sqrt(2/pi) to 10 digits), gelu_python the erf form written out
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                    "gelu": "gelu", "gelu_python": "gelu"}


# ---------------------------------------------------------------- reading config.json values

def _get(hf: dict, key: str, typ, default=REQUIRED, where: str = "", size: bool = False):
    """hf[key] as `typ` under the rules of config values (`coerce`: int32 range, finite fp32,
    strict types), or `default` when it is absent or null; `size`: a count, which must be
    positive. Errors name `where` (default: the key)."""
    where = where or key
    value = hf.get(key)
    if value is None:
        if default is REQUIRED:
            raise ConfigError(where, "missing from config.json")
        return default
    if typ is bool and not isinstance(value, bool):   # JSON true/false only: to transformers "no" is truthy
        raise ConfigError(where, f"expected true or false, got {value!r}")
    value = coerce(where, value, typ)
    if size and value < 1:
        raise ConfigError(where, f"must be positive, got {value}")
    return value


def _require(hf: dict, key: str, ok, default, why: str) -> None:
    value = default if hf.get(key) is None else hf[key]
    if not ok(value):
        raise ConfigError(key, f"{value!r} is not supported: {why}")


def _init_std(hf: dict) -> float:
    """initializer_range as model.init_std. Only weights drawn afresh read it, and a conversion
    draws none, so a value model.init_std refuses (0, or above 1) is taken as 0.02, the default,
    rather than refusing the checkpoint."""
    std = _get(hf, "initializer_range", float, 0.02)
    return std if 0 < std <= 1 else 0.02


def _gpt2(hf: dict) -> dict:
    h, l, a = (_get(hf, key, int, size=True) for key in ("n_embd", "n_layer", "n_head"))
    act = _get(hf, "activation_function", str, "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ConfigError("activation_function", f"{act!r} is not supported (mtjax has {', '.join(GPT2_ACTIVATIONS)})")
    _require(hf, "scale_attn_weights", lambda v: v is True, True, "mtjax scales scores by 1/sqrt(d)")
    _require(hf, "scale_attn_by_inverse_layer_idx", lambda v: v is False, False, "mtjax does not scale by layer")
    _require(hf, "add_cross_attention", lambda v: v is False, False, "mtjax is decoder-only")
    return {"arch": "gpt", "num_layers": l, "hidden_size": h, "num_heads": a,
            "ffn_hidden_size": _get(hf, "n_inner", int, 4 * h, size=True),
            "seq_len": _get(hf, "n_positions", int, 1024, size=True),
            "vocab_size": _get(hf, "vocab_size", int, size=True),
            "activation": "" if GPT2_ACTIVATIONS[act] == "gelu" else GPT2_ACTIVATIONS[act],
            "norm_eps": _get(hf, "layer_norm_epsilon", float, 1e-5),
            "tie_embeddings": _get(hf, "tie_word_embeddings", bool, True),
            "dropout": _get(hf, "resid_pdrop", float, 0.1), "attention_dropout": _get(hf, "attn_pdrop", float, 0.1),
            "init_std": _init_std(hf)}


def _llama(hf: dict, family: str) -> dict:
    h, a = _get(hf, "hidden_size", int, size=True), _get(hf, "num_attention_heads", int, size=True)
    # (Qwen3Config's head_dim defaults to 128; the others' to h/a, Mistral's and Mixtral's also when null
    # or 0: MixtralAttention is MistralAttention, which takes `head_dim or h / a`)
    zero_is_default = family in ("mistral", "mixtral") and hf.get("head_dim") == 0 and \
        not isinstance(hf["head_dim"], bool)
    d = h // a if zero_is_default else _get(hf, "head_dim", int, 128 if family == "qwen3" else h // a, size=True)
    k = _get(hf, "num_key_value_heads", int, KV_HEADS.get(family, a) if "num_key_value_heads" not in hf else a,
             size=True)
    _require(hf, "hidden_act", lambda v: v in ("silu", "swish"), "silu", "mtjax's llama MLP is SwiGLU (silu, "
                                                                         "also named swish)")
    if family in ATTENTION_BIAS:     # (the other families fix their biases and ignore the key)
        _require(hf, "attention_bias", lambda v: v is False, False, "it biases the output projection too")
    if family == "llama":            # (the others' MLPs are bias-free whatever the key says)
        _require(hf, "mlp_bias", lambda v: v is False, False, "mtjax's llama MLP has no biases")
    hf_window.sliding_layers(hf, family, _get)      # (the keys read here; the windows against seq_len in read_model)
    fields = {"arch": "llama", "num_layers": _get(hf, "num_hidden_layers", int, size=True), "hidden_size": h,
              "num_heads": a, "num_kv_heads": 0 if k == a else k, "kv_channels": 0 if d * a == h else d,
              "ffn_hidden_size": _get(hf, "intermediate_size", int, size=True),
              "seq_len": _get(hf, "max_position_embeddings", int, SEQ_LEN[family], size=True),
              "vocab_size": _get(hf, "vocab_size", int, size=True),
              "norm_eps": _get(hf, "rms_norm_eps", float, NORM_EPS.get(family, 1e-6)),
              "tie_embeddings": _get(hf, "tie_word_embeddings", bool, False), "qkv_bias": family == "qwen2",
              "qk_norm": family == "qwen3",
              "attention_dropout": _get(hf, "attention_dropout", float, 0.0), "init_std": _init_std(hf)}
    if family in hf_moe.FAMILIES.values():
        fields |= hf_moe.moe_fields(hf, family, _get, _require)
    return fields | hf_rope.rope_fields(hf, _get, ROPE_THETA.get(family, 10000.0), fields["seq_len"])


def model_fields(hf: dict) -> dict:
    """The `model` fields config.json describes (ConfigError naming the key when it cannot)."""
    family = hf_families.hf_family(hf)
    return _gpt2(hf) if family == "gpt2" else _llama(hf, family)


def model_config(fields: dict, seq_len: int | None = None) -> ModelConfig:
    """A ModelConfig of `fields` (from `model_fields`); `seq_len` replaces the context of a rotary
    model (a learned position table fixes GPT-2's)."""
    fields = dict(fields)
    if seq_len is not None:
        if fields["arch"] == "gpt" and seq_len != fields["seq_len"]:
            raise ConfigError("--seq-len",
                              f"GPT-2's learned position table fixes it at n_positions = {fields['seq_len']}")
        fields["seq_len"] = seq_len
    arch_default = ModelConfig(arch=fields["arch"], hidden_size=fields["hidden_size"]).ffn_size
    if fields["ffn_hidden_size"] == arch_default:
        fields["ffn_hidden_size"] = 0
    dense = ModelConfig(arch=fields["arch"], hidden_size=fields["hidden_size"],
                        ffn_hidden_size=fields["ffn_hidden_size"])
    if fields.get("moe_ffn_hidden_size") == dense.ffn_size:     # an expert as wide as the dense f
        fields["moe_ffn_hidden_size"] = 0
    return ModelConfig(**fields)


# config.json's own key for each model field it sets, per family (the rope keys under
# rope_parameters, or transformers 4's rope_scaling)
GPT2_KEYS = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "ffn_hidden_size": "n_inner",
             "seq_len": "n_positions", "vocab_size": "vocab_size", "norm_eps": "layer_norm_epsilon",
             "dropout": "resid_pdrop", "attention_dropout": "attn_pdrop", "init_std": "initializer_range",
             "activation": "activation_function", "tie_embeddings": "tie_word_embeddings"}
LLAMA_KEYS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
              "num_kv_heads": "num_key_value_heads", "kv_channels": "head_dim", "ffn_hidden_size": "intermediate_size",
              "seq_len": "max_position_embeddings", "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps",
              "attention_dropout": "attention_dropout", "init_std": "initializer_range",
              "tie_embeddings": "tie_word_embeddings", **hf_rope.ROPE_KEYS}


def read_model(hf: dict, path: str, seq_len: int | None = None) -> ModelConfig:
    """The model config.json (at `path`) describes, checked as a YAML model would be. A refusal
    names the file and config.json's own key (n_embd, not model.hidden_size), or --seq-len when
    `seq_len` (the flag) is what does not fit."""
    from mtjax.config.validate import validate_model
    if seq_len is not None:
        seq_len = coerce("--seq-len", seq_len, int)
        if seq_len < 1:
            raise ConfigError("--seq-len", f"must be >= 1, got {seq_len}")
    try:
        fields = model_fields(hf)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.key}", e.problem) from None
    model = model_config(fields, seq_len)
    try:
        if fields["arch"] == "llama":
            hf_window.check_windows(hf, hf_families.hf_family(hf), model.seq_len, _get)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e.key}", e.problem) from None
    try:
        validate_model(Config(model=model))
    except ConfigError as e:
        raise in_hf_terms(e, hf, path, seq_len is not None) from None
    return model


def recorded_window(hf: dict) -> dict | None:
    """The sliding window of an accepted config.json, as from-hf records it (None: no window)."""
    family = hf_families.hf_family(hf)
    return None if family == "gpt2" else hf_window.recorded_window(hf, family, _get)


def in_hf_terms(e: ConfigError, hf: dict, path: str, seq_len_given: bool) -> ConfigError:
    """A refusal of a `model` field, said with config.json's keys: the key, the fields the message
    names, and a hint to set a field config.json has no key for dropped."""
    rope = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    family = hf_families.hf_family(hf)
    table = GPT2_KEYS if family == "gpt2" else LLAMA_KEYS | hf_moe.KEYS.get(family, {})
    keys = {f: k.format(rope=rope) for f, k in table.items()}
    if (hf.get("rope_parameters") or {}).get("rope_theta") is not None:     # (transformers 5 keeps it there)
        keys["rope_theta"] = "rope_parameters.rope_theta"
    if family == "qwen3_moe" and hf.get("num_local_experts") is not None:  # (as hf_moe.moe_fields reads it)
        keys["num_experts"] = "num_local_experts"
    field = e.key.removeprefix("model.")
    if field == "seq_len" and seq_len_given:
        return ConfigError("--seq-len", e.problem.replace("seq_len", "--seq-len"))
    problem = re.sub(r" ?\(or set model\.(\w+)\)", lambda m: f" (or set {keys[m[1]]})" if m[1] in keys else "",
                     e.problem)
    problem = re.sub(r"\b(?:model\.)?([a-z_]+)\b", lambda m: keys.get(m[1], m[0]), problem)
    return ConfigError(f"{path}: {keys.get(field, e.key)}", problem)


# ---------------------------------------------------------------- writing config.json

def model_family(m: ModelConfig, family: str = "") -> str:
    """The transformers family `m` is written as: gpt2, qwen2 (llama with qkv_bias), qwen3 (with
    qk_norm), llama, or for experts mixtral, qwen2_moe or qwen3_moe (`hf_moe.moe_family`).
    `family` (to-hf's --family): the one asked for, which must be that one, or mistral for llama
    (the same function: Mistral is Llama's layer, its window unused)."""
    if m.moe:
        derived = hf_moe.moe_family(m)
    elif m.qk_norm and m.qkv_bias:
        raise ConfigError("model.qkv_bias", "Qwen3 (QK-norm) has no q/k/v biases")
    else:
        derived = "gpt2" if m.arch == "gpt" else "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
    if family in ("", derived) or (family, derived) == ("mistral", "llama"):
        return family or derived
    if family not in hf_families.CAUSAL_LM.values():
        raise ConfigError("--family", f"{family!r} is not one mtjax writes "
                                      f"({', '.join(sorted(set(hf_families.CAUSAL_LM.values())))})")
    raise ConfigError("--family", f"{family} cannot express this model, which is written as {derived}")


def _below(ids, vocab: int) -> bool:
    """An id (or each of a list of ids) names a token of a `vocab`-token vocabulary."""
    return all(i < vocab for i in (ids if isinstance(ids, list) else [ids]))


def hf_config(m: ModelConfig, vocab: int, token_ids: dict | None = None, family: str = "",
              window: dict | None = None) -> dict:
    """config.json for `m` with a vocabulary of `vocab` ids and the tokenizer's `token_ids`
    ({"bos_token_id", "eos_token_id", "pad_token_id"}; None when unknown, or not below `vocab`): GPT-2 for arch
    gpt, Qwen2 for llama with qkv_bias, Qwen3 with qk_norm, Mixtral, Qwen2-MoE or Qwen3-MoE with
    experts, Llama otherwise, or Mistral where `family` asks for it (`model_family`); `window`: the
    sliding window from-hf recorded (`hf_window.recorded_window`), written back in the family's
    keys (`hf_window.window_keys`). ConfigError when transformers' class cannot express it."""
    if m.moe and m.arch == "gpt":
        raise ConfigError("model.arch", "transformers has no GPT-2 with experts: mtjax writes Mixtral, Qwen2-MoE "
                                        "or Qwen3-MoE")
    # (an id past V: a byte EOS beyond a small vocabulary)
    ids = {k: i for k, i in (token_ids or {}).items() if i is not None and _below(i, vocab)}
    common = {"vocab_size": vocab, "initializer_range": m.init_std, "tie_word_embeddings": m.tied,
              "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id"),
              "pad_token_id": ids.get("pad_token_id"), "use_cache": True, "dtype": "float32"}
    if m.arch == "gpt":
        if m.kv_heads != m.num_heads:
            raise ConfigError("model.num_kv_heads", "GPT-2 has no grouped-query attention")
        if m.head_dim * m.num_heads != m.hidden_size:
            raise ConfigError("model.kv_channels", "GPT-2's head dimension is n_embd / n_head")
        act = m.mlp_activation
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": m.num_layers,
                "n_embd": m.hidden_size, "n_head": m.num_heads, "n_inner": m.ffn_size, "n_positions": m.seq_len,
                "activation_function": "gelu_new" if act == "gelu_tanh" else act,
                "layer_norm_epsilon": m.norm_eps, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
                "attn_pdrop": m.attention_dropout, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "add_cross_attention": False, **common}
    family = model_family(m, family)
    qwen = family in ("qwen2", "qwen2_moe")
    keys = {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "num_hidden_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "intermediate_size": m.ffn_size,
            "hidden_act": "silu", "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps,
            "attention_dropout": m.attention_dropout, **hf_rope.rope_keys(m), **common}
    return _family_keys(keys, m, family) | hf_window.window_keys(window, family, m.num_layers)


def _family_keys(keys: dict, m: ModelConfig, family: str) -> dict:
    """The llama-shaped `keys` as `family` (not gpt2) writes them, without a sliding window."""
    if m.moe:
        return keys | hf_moe.moe_keys(m, family)
    if family == "qwen3":
        keys |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False}
    if family == "mistral":     # (no window: every layer attends to the whole context)
        return keys | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None}
    if family in ("qwen2", "qwen3"):
        return keys | {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers,
                       "layer_types": ["full_attention"] * m.num_layers}
    return keys | {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
