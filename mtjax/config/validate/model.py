"""The `model` group: the architecture, its options against the arch, rotary embeddings, the
split of heads and MLP over the tensor ranks, and a bound on every tensor's size."""
from __future__ import annotations

import math

from mtjax.config.schema import Config, ModelConfig
from mtjax.config.validate.common import check, divides, micro_batch_source, positive
from mtjax.pipeline.schedules import chunks_per_stage

ARCHS = ("gpt", "llama")
ACTIVATIONS = {"gpt": ("gelu", "gelu_tanh"), "llama": ("swiglu",)}   # the MLP activations of each arch
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
ATTENTIONS = ("auto", "xla", "dot_product")   # core attention implementations (model/core_attention.py)
# each scaling field, with the scalings that read it
SCALING_FIELDS = {"rope_low_freq_factor": ("llama3",), "rope_high_freq_factor": ("llama3",),
                  "rope_original_positions": ("llama3", "yarn"), "rope_beta_fast": ("yarn",),
                  "rope_beta_slow": ("yarn",), "rope_attention_factor": ("yarn",)}

# Far beyond any device, and below where XLA's shape arithmetic overflows (an abort, not an error).
ELEMENTS_LIMIT = 2 ** 48
# Token ids, vocabulary rows and expert slots are indexed in int32 (JAX without x64): an axis
# that is gathered from must stay below 2**31, or tracing the step fails with an OverflowError.
INDEX_LIMIT = 2 ** 31
# A step's batch of B (s + 1) token ids is one host array: beyond 2**28 (1 GiB, 16 times the
# largest published batches) it is a typo, which would exhaust the host's memory before any check.
BATCH_TOKENS_LIMIT = 2 ** 28


def validate_sizes(cfg: Config, b: int, t: int) -> None:
    """No tensor of the step may be absurdly large: refused by name instead of crashing XLA."""
    m = cfg.model
    tensors = {"model.hidden_size": m.num_layers * m.hidden_size * max(m.ffn_size, m.num_heads * m.head_dim),
               "model.vocab_size": (m.vocab_size + m.vocab_multiple * t) * m.hidden_size,
               "model.seq_len": b * m.num_heads * m.seq_len * m.seq_len,
               micro_batch_source(cfg)[0]: b * m.seq_len * max(m.ffn_size, m.vocab_size + m.vocab_multiple * t)}
    for key, elements in tensors.items():
        check(elements <= ELEMENTS_LIMIT, key, f"a tensor of the step would hold {elements:.3g} elements "
                                               f"(more than {ELEMENTS_LIMIT:.3g}): no device could hold it")
    _validate_indexed_sizes(cfg, t)


def _validate_indexed_sizes(cfg: Config, t: int) -> None:
    """The axes indexed in int32 (INDEX_LIMIT): the padded vocabulary and each MoE layer's E C
    expert slots, bounded by E s (a capacity C is at most s slots per expert and row)."""
    m = cfg.model
    unit = m.vocab_multiple * t
    padded = -(-max(m.vocab_size, 1) // unit) * unit
    check(padded < INDEX_LIMIT, "model.vocab_size" if m.vocab_size else "model.vocab_multiple",
          f"the padded vocabulary ({padded} rows, a multiple of vocab_multiple*tensor = {unit}) must stay below "
          f"2**31: token ids are int32")
    if m.moe:
        check(m.num_experts * m.seq_len < INDEX_LIMIT, "model.num_experts",
              f"{m.num_experts} experts x up to seq_len {m.seq_len} slots each = {m.num_experts * m.seq_len} "
              "expert slots, indexed in int32: must stay below 2**31")


def validate_batch_tokens(cfg: Config) -> None:
    """The host's batch of token ids each step (BATCH_TOKENS_LIMIT)."""
    m, tr = cfg.model, cfg.train
    tokens = tr.global_batch * (m.seq_len + 1)
    check(tokens <= BATCH_TOKENS_LIMIT, "train.global_batch",
          f"a step's batch of global_batch*(seq_len+1) = {tr.global_batch}*{m.seq_len + 1} = {tokens:.3g} token "
          f"ids is more than {BATCH_TOKENS_LIMIT:.3g} (1 GiB on the host each step)")


def validate_model_group(cfg: Config, t: int, p: int) -> None:
    """The model's sizes and options; its heads and MLP split t ways, its layers over p stages."""
    m = cfg.model
    check(m.arch in ARCHS, "model.arch", f"must be one of {', '.join(ARCHS)}, got {m.arch!r}")
    positive(cfg, ["model.num_layers", "model.hidden_size", "model.num_heads", "model.seq_len",
                   "model.vocab_multiple", "model.norm_eps", "model.init_std"])
    check(m.num_kv_heads >= 0, "model.num_kv_heads", "must be >= 0")
    check(m.ffn_hidden_size >= 0, "model.ffn_hidden_size", "must be >= 0")
    check(m.vocab_size >= 0, "model.vocab_size", "must be >= 0")
    for key, rate in (("model.dropout", m.dropout), ("model.attention_dropout", m.attention_dropout)):
        check(0.0 <= rate < 1.0, key, f"must be in [0, 1), got {rate}")
    check(m.kv_channels >= 0, "model.kv_channels", f"must be >= 0, got {m.kv_channels}")
    if not m.kv_channels:
        divides(m.num_heads, m.hidden_size, "model.hidden_size",
                f"hidden_size {m.hidden_size} is not divisible by num_heads {m.num_heads} (or set model.kv_channels)")
    divides(m.kv_heads, m.num_heads, "model.num_kv_heads",
            f"num_heads {m.num_heads} is not divisible by num_kv_heads {m.kv_heads}")
    divides(t, m.num_heads, "model.num_heads", f"num_heads {m.num_heads} is not divisible by parallel.tensor {t}")
    check(m.kv_heads % t == 0 or t % m.kv_heads == 0, "model.num_kv_heads",
          f"num_kv_heads {m.kv_heads} and parallel.tensor {t}: one must divide the other")
    if _ffn_used(m):
        divides(t, m.ffn_size, "model.ffn_hidden_size", f"ffn size {m.ffn_size}{_derived_ffn(m, t)}")
    _validate_layers(cfg, p)
    _validate_layer_options(m)
    check(not m.qk_norm or cfg.parallel.tensor_grid == "1d", "model.qk_norm",
          f"is implemented on the 1d tensor layout, not on tensor_grid={cfg.parallel.tensor_grid}")
    _validate_rope(m)


def _ffn_used(m: ModelConfig) -> bool:
    """Whether some MLP of the model is f = ffn_size wide: a dense layer, or experts of no size of
    their own (moe_ffn_hidden_size 0). Layer i is dense unless i >= k and (i - k) % f_moe == 0
    (`ModelConfig.is_moe_layer`): with k = 0 and f_moe = 1 every layer is MoE, and so is a single
    layer at k = 0 whatever f_moe. Unused, ffn_hidden_size is not refused by the no-effect rule:
    it is the intermediate_size a Hugging Face Qwen2-MoE/Qwen3-MoE config carries, read by from-hf
    and written back by to-hf (`convert/hf_moe.py`), so a converted all-MoE model keeps it."""
    if not m.moe or not m.moe_ffn_hidden_size or m.moe_first_dense != 0:
        return True
    return m.moe_layer_freq < 1 or (m.moe_layer_freq > 1 and m.num_layers > 1)    # < 1: refused in moe.py


def _derived_ffn(m: ModelConfig, t: int) -> str:
    """The rest of the line refusing f for t ranks; when the config left ffn_hidden_size at 0, it
    names the rule that made f (schema `ffn_size`) and the field to set: the user wrote no size."""
    if m.ffn_hidden_size:
        return f" is not divisible by parallel.tensor {t}"
    rule = "the multiple of 64 nearest 8h/3" if m.arch == "llama" else "4h"
    return (f" (derived from hidden_size {m.hidden_size}: {rule}) is not divisible by parallel.tensor {t}; "
            f"set model.ffn_hidden_size to a multiple of {t}")


def _validate_layers(cfg: Config, p: int) -> None:
    """The layers split into p stages of v chunks each (a mixture of experts' dense prefix of P
    layers runs before the first chunk: the other l - P are split)."""
    m, v = cfg.model, cfg.parallel.virtual_stages
    check(v >= 1, "parallel.virtual_stages", f"must be >= 1, got {v}")
    v = chunks_per_stage(cfg.parallel.schedule, v) if p > 1 else v
    prefix = m.dense_prefix if p > 1 else 0
    split = f"the {m.num_layers - prefix} layers after the {prefix} of the dense prefix" if prefix else \
        f"num_layers {m.num_layers}"
    divides(p * v, m.num_layers - prefix, "model.num_layers",
            f"{split} {'are' if prefix else 'is'} not divisible by pipe*virtual_stages = {p * v}"
            + (" (zbv holds 2 chunks per stage)" if cfg.parallel.schedule == "zbv" and p > 1 else ""))


def _validate_layer_options(m: ModelConfig) -> None:
    """The MLP activation, the Q/K/V biases and QK-norm, against the arch."""
    allowed = ACTIVATIONS[m.arch]
    check(m.mlp_activation in allowed, "model.activation",
          f"arch {m.arch} takes {' or '.join(allowed)}, got {m.activation!r}")
    check(not (m.qkv_bias and m.arch == "gpt"), "model.qkv_bias",
          "is for arch=llama: gpt always has biases on Q, K and V")
    check(not (m.qk_norm and m.arch == "gpt"), "model.qk_norm", "is for arch=llama (Qwen3's RMSNorm of Q and K)")
    check(m.attention in ATTENTIONS, "model.attention", f"must be one of {', '.join(ATTENTIONS)}, got {m.attention!r}")
    check(m.attention != "dot_product" or m.attention_dropout == 0, "model.attention",
          f"dot_product has no attention dropout (model.attention_dropout is {m.attention_dropout}): "
          "set it to 0, or use model.attention=xla")


def _validate_rope(m: ModelConfig) -> None:
    """Rotary embeddings (llama): an even head dimension, a base, and the frequency scaling. A
    scaling field without its scaling is refused (the no-effect rule, `common`)."""
    check(m.rope_theta > 1, "model.rope_theta", f"must be > 1 (the base of the rotary wavelengths), got {m.rope_theta}")
    # beyond these a norm or an init wipes out the signal: the run would train nothing, silently
    check(m.norm_eps < 1, "model.norm_eps", f"must be in (0, 1), got {m.norm_eps}")
    check(m.init_std <= 1, "model.init_std", f"must be in (0, 1], got {m.init_std}")
    check(m.rope_scaling in ROPE_SCALINGS, "model.rope_scaling",
          f"must be one of {', '.join(ROPE_SCALINGS)}, got {m.rope_scaling!r}")
    unset = {"rope_scaling": m.rope_scaling == "none", "rope_theta": m.rope_theta == ModelConfig.rope_theta}
    for name, default in unset.items():
        check(m.arch == "llama" or default, f"model.{name}",
              "is for arch=llama: gpt has learned positions, no rotary embeddings")
    if m.arch == "llama":
        key = "model.kv_channels" if m.kv_channels else "model.hidden_size"
        check(m.head_dim % 2 == 0, key, f"rotary embeddings need an even head dimension, got {m.head_dim}")
    if m.rope_scaling == "none":
        check(m.rope_scaling_factor == 1.0, "model.rope_scaling_factor",
              "is only used with model.rope_scaling=linear, llama3 or yarn")
    else:
        check(m.rope_scaling_factor >= 1.0, "model.rope_scaling_factor", f"must be >= 1, got {m.rope_scaling_factor}")
    for name, scalings in SCALING_FIELDS.items():     # set away from its default, it would be ignored
        check(m.rope_scaling in scalings or getattr(m, name) == getattr(ModelConfig, name), f"model.{name}",
              f"is only used with model.rope_scaling={' or '.join(scalings)}")
    if m.rope_scaling in ("llama3", "yarn"):
        check(m.rope_original_positions > 0, "model.rope_original_positions",
              f"must be positive, got {m.rope_original_positions}")
    if m.rope_scaling == "llama3":
        check(m.rope_low_freq_factor > 0, "model.rope_low_freq_factor",
              f"must be positive, got {m.rope_low_freq_factor}")
        check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
              f"must be greater than rope_low_freq_factor {m.rope_low_freq_factor}, got {m.rope_high_freq_factor}")
    for name in ("rope_beta_fast", "rope_beta_slow"):     # each the count of turns over the original context
        value = getattr(m, name)
        check(math.isfinite(value) and value > 0, f"model.{name}", f"must be a finite positive number, got {value}")
    check(math.isfinite(m.rope_attention_factor) and m.rope_attention_factor >= 0, "model.rope_attention_factor",
          f"must be >= 0 (0: derived from rope_scaling_factor), got {m.rope_attention_factor}")
