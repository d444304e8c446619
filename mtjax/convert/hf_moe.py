"""Mixtures of experts in Hugging Face form: Mixtral, Qwen2-MoE and Qwen3-MoE, config.json and tensors.

    MixtralForCausalLM   -> arch llama + E experts (SwiGLU, no biases), every layer sparse
    Qwen2MoeForCausalLM  -> the same with q/k/v biases and a shared expert scaled by
                            sigmoid(x w_g) (model.moe_shared_expert_gate)
    Qwen3MoeForCausalLM  -> Mixtral's layer with QK-norm (model.qk_norm: q_norm, k_norm over
                            head_dim), no biases, no shared expert, head_dim free of h/a

Routing, as transformers computes it (models/mixtral, models/qwen2_moe): logits x W_r (no bias,
no jitter at inference; `router_jitter_noise` must be 0), softmax in fp32 over all E experts,
the k best, divided by their sum always (Mixtral) or when `norm_topk_prob` (Qwen2-MoE, Qwen3-MoE); no
capacity, no token dropped. mtjax's router is the same (`model/moe.py`: moe_score softmax,
moe_renormalize), with moe_capacity_factor 0 (dropless).

The training-only router keys (router_aux_loss_coef, output_router_logits) are not carried:
transformers' balance loss is taken over the whole batch, mtjax's per sequence.

Tensors: each expert's three matrices are torch Linear weights of their own,
`...experts.{j}.w1|w3|w2.weight` (Mixtral: gate, up, down) or `...experts.{j}.gate_proj|up_proj|
down_proj.weight` (Qwen2-MoE, Qwen3-MoE), stacked into mtjax's [E, h, f_e] and [E, f_e, h] leaves; the
router `gate.weight` [E, h] is mtjax's [h, E] transposed.
"""
from __future__ import annotations

from mtjax.config.errors import ConfigError
from mtjax.config.schema import ModelConfig

FAMILIES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}

# config.json's key for each model field (beside the llama ones), for refusals in its terms
KEYS = {"mixtral": {"num_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok"},
        "qwen2_moe": {"num_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
                      "moe_ffn_hidden_size": "moe_intermediate_size",
                      "moe_shared_expert_size": "shared_expert_intermediate_size"},
        "qwen3_moe": {"num_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
                      "moe_ffn_hidden_size": "moe_intermediate_size"}}


def moe_fields(hf: dict, family: str, get, require) -> dict:
    """The MoE `model` fields config.json describes (`get`, `require`: hf_config's readers)."""
    require(hf, "router_jitter_noise", lambda v: v == 0, 0.0, "mtjax's router has no jitter")
    if family == "mixtral":
        require(hf, "sliding_window", lambda v: v is None, None, "mtjax has no sliding-window attention")
        return {"num_experts": get(hf, "num_local_experts", int, size=True),
                "moe_top_k": get(hf, "num_experts_per_tok", int, size=True), "moe_renormalize": True}
    require(hf, "decoder_sparse_step", lambda v: v == 1, 1, "every layer is a mixture of experts in mtjax")
    require(hf, "mlp_only_layers", lambda v: not v, [], "every layer is a mixture of experts in mtjax")
    # transformers 5 saves Qwen3-MoE's count as num_local_experts (and prefers it), the Hub's files
    # as num_experts
    local = family == "qwen3_moe" and hf.get("num_local_experts") is not None
    experts = "num_local_experts" if local else "num_experts"
    routed = {"num_experts": get(hf, experts, int, size=True),
              "moe_top_k": get(hf, "num_experts_per_tok", int, size=True),
              "moe_ffn_hidden_size": get(hf, "moe_intermediate_size", int, size=True),
              "moe_renormalize": get(hf, "norm_topk_prob", bool, False)}
    if family == "qwen3_moe":       # (attention_bias, refused by the llama reader, is its only bias)
        return routed | {"qk_norm": True}
    require(hf, "qkv_bias", lambda v: v is True, True, "mtjax converts Qwen2-MoE with its q/k/v biases")
    return routed | {"moe_shared_expert_size": get(hf, "shared_expert_intermediate_size", int, size=True),
                     "moe_shared_expert_gate": True, "qkv_bias": True}


def moe_family(m: ModelConfig) -> str:
    """mixtral, qwen2_moe or qwen3_moe (with qk_norm) for an MoE `m`; ConfigError when none expresses it."""
    def need(ok, field, why):
        if not ok:
            raise ConfigError(f"model.{field}", f"{getattr(m, field)!r} cannot be written for transformers: {why}")
    need(m.moe_score == "softmax", "moe_score", "transformers' MoE models route by softmax")
    need(not m.moe_router_bias, "moe_router_bias", "transformers' routers have no balancing bias")
    need(m.moe_capacity_factor == 0, "moe_capacity_factor", "transformers' MoE models drop no tokens")
    if m.qk_norm:
        need(not m.moe_shared_expert_size, "moe_shared_expert_size", "Qwen3-MoE (QK-norm) has no shared expert")
        need(not m.qkv_bias, "qkv_bias", "Qwen3-MoE (QK-norm) has no q/k/v biases")
        return "qwen3_moe"
    if m.moe_shared_expert_size:
        need(m.moe_shared_expert_gate, "moe_shared_expert_gate", "Qwen2-MoE gates its shared expert")
        need(m.qkv_bias, "qkv_bias", "Qwen2-MoE has q/k/v biases")
        return "qwen2_moe"
    need(not m.qkv_bias, "qkv_bias", "Mixtral has no q/k/v biases (Qwen2-MoE, which has, needs a shared expert)")
    need(m.moe_renormalize, "moe_renormalize", "Mixtral renormalises the top-k scores")
    return "mixtral"


def moe_keys(m: ModelConfig, family: str) -> dict:
    """config.json's MoE keys for `m` (beside the llama ones hf_config writes)."""
    common = {"num_experts_per_tok": m.moe_top_k, "output_router_logits": False, "router_jitter_noise": 0.0}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": m.num_experts,
                "intermediate_size": m.expert_ffn_size, "sliding_window": None, **common}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": m.num_experts,
                "moe_intermediate_size": m.expert_ffn_size, "intermediate_size": m.ffn_size,
                "norm_topk_prob": m.moe_renormalize, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None, **common}
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": m.num_experts,
            "moe_intermediate_size": m.expert_ffn_size, "shared_expert_intermediate_size": m.moe_shared_expert_size,
            "intermediate_size": m.ffn_size, "norm_topk_prob": m.moe_renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.num_layers, "layer_types": ["full_attention"] * m.num_layers, **common}


def moe_rows(family: str, tensor, vec) -> list:
    """The weights.Tensor rows of the MoE layer (`tensor`, `vec`: weights' row makers); `{j}` is
    the expert."""
    if family == "mixtral":
        moe = "model.layers.{i}.block_sparse_moe."
        names = {"gate": "w1", "up": "w3", "fc2": "w2"}
    else:
        moe = "model.layers.{i}.mlp."
        names = {"gate": "gate_proj", "up": "up_proj", "fc2": "down_proj"}
    rows = [tensor(moe + "gate.weight", ("layers/moe/router",), transpose=True)]
    rows += [tensor(moe + f"experts.{{j}}.{hf}.weight", (f"layers/moe/experts/{leaf}",), transpose=True)
             for leaf, hf in names.items()]
    if family == "qwen2_moe":
        rows += [tensor(moe + f"shared_expert.{hf}.weight", (f"layers/moe/shared/{leaf}/kernel",), transpose=True)
                 for leaf, hf in names.items()]
        rows.append(tensor(moe + "shared_expert_gate.weight", ("layers/moe/shared_gate",), transpose=True))
    return rows


# mtjax leaves with no Hugging Face tensor: the zero parameter that carries the routing's
# statistics out of the backward (`model/moe.py`), zeros in every fresh model
ZERO_LEAVES = ("layers/moe/stats",)
