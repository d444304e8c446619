"""Which transformers family a config.json names, and what each family's config class takes for a
key config.json leaves out (`hf_config.py` reads the keys; `hf_window.py` the sliding windows).

The family comes from `architectures[0]`, a *ForCausalLM class or its base model (MistralModel,
LlamaModel, ...: what `save_pretrained` of the base model writes; transformers'
AutoModelForCausalLM builds the *ForCausalLM of its `model_type` from either), else from
`model_type`. Both given, they must agree.

Keys some families never read, which their attention therefore ignores however config.json sets
them: `attention_bias` (Qwen2, Qwen2-MoE, Mixtral and Mistral fix their attention biases: q, k, v
for the Qwen2 families, none for the others; o_proj never). A file of such a family whose
config.json says `attention_bias: true` may hold the biases that key describes; transformers'
`from_pretrained` drops the ones its class does not build (it reports them as unexpected), so
from-hf drops them too (`unbuilt_tensors`), and refuses any other tensor it has no place for.
"""
from __future__ import annotations

from mtjax.config.errors import ConfigError
from mtjax.convert import hf_moe

CAUSAL_LM = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", **hf_moe.FAMILIES}
BASE_MODELS = {"GPT2Model": "gpt2", "LlamaModel": "llama", "MistralModel": "mistral", "Qwen2Model": "qwen2",
               "Qwen3Model": "qwen3", "MixtralModel": "mixtral", "Qwen2MoeModel": "qwen2_moe",
               "Qwen3MoeModel": "qwen3_moe"}
ARCHITECTURES = CAUSAL_LM | BASE_MODELS

# the config classes' defaults where they are not Llama's (max_position_embeddings 2048,
# rope_theta 1e4, rms_norm_eps 1e-6, num_key_value_heads the number of heads; an absent
# num_key_value_heads takes the class's default, a null one the number of heads)
SEQ_LEN = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768, "mixtral": 131072,
           "qwen2_moe": 32768, "qwen3_moe": 32768}
ROPE_THETA = {"mixtral": 1e6}
NORM_EPS = {"mixtral": 1e-5}
KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32, "mixtral": 8, "qwen2_moe": 16, "qwen3_moe": 4}

# the families whose attention reads attention_bias (q/k/v/o biases); the others build fixed ones
ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")


def hf_family(hf: dict) -> str:
    """'gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen2_moe' or 'qwen3_moe', from
    `architectures` (or `model_type` when it is absent). Both given, they must agree: transformers'
    Auto classes build the model `model_type` names, a model class its own."""
    archs = hf.get("architectures")
    if archs:
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ConfigError("architectures", f"must be a list of class names, got {archs!r}")
        if archs[0] not in ARCHITECTURES:
            raise ConfigError("architectures", f"{archs[0]} is not supported (mtjax converts "
                                               f"{', '.join(CAUSAL_LM)} and their base models)")
        kind = hf.get("model_type")
        if kind is not None and kind != ARCHITECTURES[archs[0]]:
            raise ConfigError("model_type", f"{kind!r} disagrees with architectures {archs[0]} (model_type "
                                            f"{ARCHITECTURES[archs[0]]!r})")
        return ARCHITECTURES[archs[0]]
    kind = hf.get("model_type")
    if kind not in CAUSAL_LM.values():
        raise ConfigError("model_type", f"{kind!r} is not supported (mtjax converts "
                                        f"{', '.join(sorted(set(CAUSAL_LM.values())))})")
    return kind


def unbuilt_tensors(hf: dict, family: str) -> tuple[str, ...]:
    """Patterns of the tensors a file may hold that transformers' class of `family` does not
    build, and from_pretrained drops: the attention biases `attention_bias: true` describes, in
    a family that does not read the key (the ones it builds, Qwen2's q/k/v, are read first)."""
    if family in ATTENTION_BIAS or family == "gpt2" or hf.get("attention_bias") is not True:
        return ()
    return (r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.bias",)
