"""Mixtures of experts in Hugging Face form: Mixtral, Qwen2-MoE and Qwen3-MoE, config.json and tensors.

    MixtralForCausalLM   -> arch llama + E experts (SwiGLU, no biases), every layer sparse
    Qwen2MoeForCausalLM  -> the same with q/k/v biases and a shared expert scaled by
                            sigmoid(x w_g) (model.moe_shared_expert_gate), dense layers
                            among the sparse ones (decoder_sparse_step, mlp_only_layers)
    Qwen3MoeForCausalLM  -> Mixtral's layer with QK-norm (model.qk_norm: q_norm, k_norm over
                            head_dim), no biases, no shared expert, head_dim free of h/a, dense
                            layers as Qwen2-MoE's

Routing, as transformers computes it (models/mixtral, models/qwen2_moe): logits x W_r (no bias,
no jitter at inference; `router_jitter_noise` must be 0), softmax in fp32 over all E experts,
the k best, divided by their sum always (Mixtral) or when `norm_topk_prob` (Qwen2-MoE, Qwen3-MoE); no
capacity, no token dropped. mtjax's router is the same (`model/moe.py`: moe_score softmax,
moe_renormalize), with moe_capacity_factor 0 (dropless).

The training-only router keys (router_aux_loss_coef, output_router_logits) are not carried:
transformers' balance loss is taken over the whole batch, mtjax's per sequence.

Dense layers among the MoE layers (Qwen2-MoE, Qwen3-MoE; Mixtral's layers are all sparse): transformers'
layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; that is
mtjax's pattern (`model/layer_pattern.py`: i >= k, (i - k) % f == 0) with f = decoder_sparse_step
when mlp_only_layers holds the first of those layers only, k then the first left. Other lists are
refused. The dense layers' MLP is `mlp.gate_proj|up_proj|down_proj` of inner size
`intermediate_size`. The tensors of a mixed model stack per kind, in layer order ("layers/attn/..."
over all l layers, "layers/mlp/..." over the dense ones, "layers/moe/..." over the MoE ones:
`to_tree` and `to_flat` move them to and from the prefix and units mtjax stores).

Tensors: each expert's three matrices are torch Linear weights of their own,
`...experts.{j}.w1|w3|w2.weight` (Mixtral: gate, up, down) or `...experts.{j}.gate_proj|up_proj|
down_proj.weight` (Qwen2-MoE, Qwen3-MoE), stacked into mtjax's [E, h, f_e] and [E, f_e, h] leaves; the
router `gate.weight` [E, h] is mtjax's [h, E] transposed.
"""
from __future__ import annotations

import numpy as np

from mtjax.config.errors import ConfigError
from mtjax.config.schema import ModelConfig
from mtjax.model.layer_pattern import layer_pattern

FAMILIES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}

# config.json's key for each model field (beside the llama ones), for refusals in its terms
KEYS = {"mixtral": {"num_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok"},
        "qwen2_moe": {"num_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
                      "moe_ffn_hidden_size": "moe_intermediate_size",
                      "moe_shared_expert_size": "shared_expert_intermediate_size",
                      "moe_layer_freq": "decoder_sparse_step", "moe_first_dense": "mlp_only_layers"},
        "qwen3_moe": {"num_experts": "num_experts", "moe_top_k": "num_experts_per_tok",
                      "moe_ffn_hidden_size": "moe_intermediate_size",
                      "moe_layer_freq": "decoder_sparse_step", "moe_first_dense": "mlp_only_layers"}}


def moe_fields(hf: dict, family: str, get, require) -> dict:
    """The MoE `model` fields config.json describes (`get`, `require`: hf_config's readers)."""
    require(hf, "router_jitter_noise", lambda v: v == 0, 0.0, "mtjax's router has no jitter")
    if family == "mixtral":
        return {"num_experts": get(hf, "num_local_experts", int, size=True),
                "moe_top_k": get(hf, "num_experts_per_tok", int, size=True), "moe_renormalize": True}
    # transformers 5 saves Qwen3-MoE's count as num_local_experts (and prefers it), the Hub's files
    # as num_experts
    local = family == "qwen3_moe" and hf.get("num_local_experts") is not None
    experts = "num_local_experts" if local else "num_experts"
    routed = {"num_experts": get(hf, experts, int, size=True),
              "moe_top_k": get(hf, "num_experts_per_tok", int, size=True),
              "moe_ffn_hidden_size": get(hf, "moe_intermediate_size", int, size=True),
              "moe_renormalize": get(hf, "norm_topk_prob", bool, False), **sparse_layers(hf, get)}
    if family == "qwen3_moe":       # (attention_bias, refused by the llama reader, is its only bias)
        return routed | {"qk_norm": True}
    require(hf, "qkv_bias", lambda v: v is True, True, "mtjax converts Qwen2-MoE with its q/k/v biases")
    return routed | {"moe_shared_expert_size": get(hf, "shared_expert_intermediate_size", int, size=True),
                     "moe_shared_expert_gate": True, "qkv_bias": True}


def sparse_layers(hf: dict, get) -> dict:
    """moe_layer_freq and moe_first_dense from decoder_sparse_step and mlp_only_layers (module
    docstring); ConfigError naming mlp_only_layers for a pattern mtjax's cannot state."""
    step, l = get(hf, "decoder_sparse_step", int, 1, size=True), get(hf, "num_hidden_layers", int, size=True)
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError("mlp_only_layers", f"must be a list of layer indices, got {dense!r}")
    candidates = [i for i in range(l) if (i + 1) % step == 0]
    if not candidates:
        raise ConfigError("decoder_sparse_step", f"{step} is not supported: it leaves all {l} layers dense")
    sparse = [i for i in candidates if i not in dense]
    if not sparse or sparse != candidates[len(candidates) - len(sparse):]:
        raise ConfigError("mlp_only_layers", f"{dense!r} is not supported: it may name only the first of the layers i "
                                             "with (i + 1) % decoder_sparse_step == 0 "
                                             "(mtjax's dense layers come first)")
    return {"moe_layer_freq": step, "moe_first_dense": sparse[0]}


def moe_family(m: ModelConfig) -> str:
    """mixtral, qwen2_moe or qwen3_moe (with qk_norm) for an MoE `m`; ConfigError when none expresses it."""
    def need(ok, field, why):
        if not ok:
            raise ConfigError(f"model.{field}", f"{getattr(m, field)!r} cannot be written for transformers: {why}")
    need(m.moe_score == "softmax", "moe_score", "transformers' MoE models route by softmax")
    need(not m.moe_router_bias, "moe_router_bias", "transformers' routers have no balancing bias")
    need(m.moe_capacity_factor == 0, "moe_capacity_factor", "transformers' MoE models drop no tokens")
    qwen = "Qwen3-MoE" if m.qk_norm else "Qwen2-MoE"
    if m.qk_norm or m.moe_shared_expert_size:
        need(m.moe_first_dense % m.moe_layer_freq == m.moe_layer_freq - 1, "moe_first_dense",
             f"{qwen}'s sparse layers are the i with (i + 1) % decoder_sparse_step == 0 (moe_layer_freq), "
             "so moe_first_dense must be one less than a multiple of moe_layer_freq")
    if m.qk_norm:
        need(not m.moe_shared_expert_size, "moe_shared_expert_size", "Qwen3-MoE (QK-norm) has no shared expert")
        need(not m.qkv_bias, "qkv_bias", "Qwen3-MoE (QK-norm) has no q/k/v biases")
        return "qwen3_moe"
    if m.moe_shared_expert_size:
        need(m.moe_shared_expert_gate, "moe_shared_expert_gate", "Qwen2-MoE gates its shared expert")
        need(m.qkv_bias, "qkv_bias", "Qwen2-MoE has q/k/v biases")
        return "qwen2_moe"
    # (the line names the field that makes layers dense: moe_first_dense=2 is not "moe_layer_freq: 1")
    need(m.moe_first_dense == 0, "moe_first_dense", "Mixtral has no dense layers (Qwen2-MoE, which may, needs a "
         "shared expert)")
    need(m.moe_layer_freq == 1, "moe_layer_freq", "Mixtral has no dense layers (Qwen2-MoE, which may, needs a "
         "shared expert)")
    need(not m.qkv_bias, "qkv_bias", "Mixtral has no q/k/v biases (Qwen2-MoE, which has, needs a shared expert)")
    need(m.moe_renormalize, "moe_renormalize", "Mixtral renormalises the top-k scores")
    return "mixtral"


def moe_keys(m: ModelConfig, family: str) -> dict:
    """config.json's MoE keys for `m` (beside the llama ones hf_config writes)."""
    common = {"num_experts_per_tok": m.moe_top_k, "output_router_logits": False, "router_jitter_noise": 0.0}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": m.num_experts,
                "intermediate_size": m.expert_ffn_size, "sliding_window": None, **common}
    layers = {"decoder_sparse_step": m.moe_layer_freq,   # mtjax's dense layers come first (`sparse_layers`)
              "mlp_only_layers": [i for i in range(m.moe_first_dense) if (i + 1) % m.moe_layer_freq == 0]}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": m.num_experts,
                "moe_intermediate_size": m.expert_ffn_size, "intermediate_size": m.ffn_size,
                "norm_topk_prob": m.moe_renormalize, **layers,
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None, **common}
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": m.num_experts,
            "moe_intermediate_size": m.expert_ffn_size, "shared_expert_intermediate_size": m.moe_shared_expert_size,
            "intermediate_size": m.ffn_size, "norm_topk_prob": m.moe_renormalize, **layers,
            "qkv_bias": True, "use_sliding_window": False, "sliding_window": None,
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


# ---------------------------------------------------------------- a mixed stack's tensors

def mixed(m: ModelConfig) -> bool:
    """Dense layers among the MoE layers: tensors stack per kind (module docstring)."""
    return m.moe and (m.moe_layer_freq > 1 or m.moe_first_dense > 0)


def layers_of(path: str, m: ModelConfig) -> list[int]:
    """The layers a per-kind leaf "layers/<kind>/..." stacks: the MoE ones, the dense ones, or all."""
    kind = {"moe": True, "mlp": False}.get(path.split("/")[1])
    return [i for i in range(m.num_layers) if kind is None or m.is_moe_layer(i) == kind]


def _place(i: int, m: ModelConfig) -> tuple[str, int]:
    """Layer i -> (the path of its stack, its row there) (`model/layer_pattern.py`)."""
    p = layer_pattern(m)
    if i < p.prefix:
        return "dense_layers/", i
    unit, j = divmod(i - p.prefix, p.group)
    return ("layers/" if j == p.moe_at else f"layers/dense_{j}/"), unit


def _flat_path(path: str) -> str:
    """A stored leaf's per-kind path: "dense_layers/x" and "layers/dense_{j}/x" -> "layers/x"."""
    if path.startswith("dense_layers/"):
        return "layers/" + path.removeprefix("dense_layers/")
    parts = path.split("/")
    return "/".join(["layers"] + parts[2:]) if parts[0] == "layers" and parts[1].startswith("dense_") else path


def flat_shapes(shapes: dict, m: ModelConfig) -> dict:
    """{stored leaf: shape} -> {per-kind leaf: shape}: [n, ...], n the layers it stacks."""
    if not mixed(m):
        return shapes
    out = {}
    for path, shape in shapes.items():
        flat = _flat_path(path)
        out[flat] = (len(layers_of(flat, m)), *shape[1:]) if flat.startswith("layers/") else shape
    return out


def to_tree(flat: dict, m: ModelConfig) -> dict:
    """Per-kind leaves -> the stored leaves (prefix and units)."""
    if not mixed(m):
        return flat
    out, rows = {}, {}
    for path, x in flat.items():
        if not path.startswith("layers/"):
            out[path] = x
            continue
        for n, i in enumerate(layers_of(path, m)):
            stack, row = _place(i, m)
            rows.setdefault(stack + path[7:], {})[row] = x[n]
    return out | {path: np.stack([r[k] for k in sorted(r)]) for path, r in rows.items()}


def to_flat(leaves: dict, m: ModelConfig) -> dict:
    """The inverse of `to_tree`."""
    if not mixed(m):
        return leaves
    out = {path: x for path, x in leaves.items() if _flat_path(path) == path and not path.startswith("layers/")}
    for flat in {_flat_path(path) for path in leaves if _flat_path(path).startswith("layers/")}:
        out[flat] = np.stack([leaves[stack + flat[7:]][row] for stack, row in
                              (_place(i, m) for i in layers_of(flat, m))])
    return out
