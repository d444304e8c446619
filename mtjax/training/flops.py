"""Model FLOPs per step (Megatron's accounting) and MFU.

Convention: attention counts the full s x s score matrix (QK^T and AV), as
Megatron's formula does, although a causal mask makes half of it
unnecessary; MFU is therefore comparable with Megatron's and MaxText's
published numbers (MaxText counts the causal half: its MFU is lower for the same speed).
Matrix products only; norms, softmax and elementwise work are not counted. A mixture of experts
counts its active FLOPs: the router and the k experts a token is routed to (not the capacity's
padding, not the E - k others), as Megatron's MoE accounting does; with dense layers among the MoE
layers (`model/layer_pattern.py`) a layer's MLP FLOPs are the mean over the l layers.

For GPT (f = 4h, k = a) the count reduces to Narayanan et al. (2021):
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)),
and with full recomputation (one more forward of the layers)
    96 B s l h^2 (1 + s/(6h) + V/(16 l h));
block recomputation of N of each stage's l/p layers lies in between, pro rata.
"""
from __future__ import annotations

from mtjax.config.schema import ModelConfig

# Dense bf16 peak TFLOP/s per device, by substring of jax's device_kind; the longest name found
# wins ("NVIDIA L40S" is an L40S, not an L4; "NVIDIA H100 PCIe" not the SXM part).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "A100": 312.0,
               "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}


def forward_flops_per_token(m: ModelConfig, vocab: int, expert_slots: float | None = None
                            ) -> tuple[float, float, float]:
    """(per-layer weight matmuls, per-layer attention core, output layer) forward FLOPs per token.
    `expert_slots`: the expert MLPs a token's share of an MoE layer runs (default k, the routed
    ones; `expert_slots_per_token` for what the experts' static buffers execute)."""
    h, a, k, d, f, s = m.hidden_size, m.num_heads, m.kv_heads, m.head_dim, m.ffn_size, m.seq_len
    projections = 2 * h * d * (a + 2 * k) + 2 * a * d * h          # Q, K, V and output
    mlp = _mlp_flops(m, f)
    if m.moe:   # active FLOPs: the router, the k chosen experts, the shared expert (`model/moe.py`)
        slots = m.moe_top_k if expert_slots is None else expert_slots
        moe = 2 * h * m.num_experts + slots * _mlp_flops(m, m.expert_ffn_size) + \
            _mlp_flops(m, m.moe_shared_expert_size)
        n = moe_layers(m)
        mlp = (n * moe + (m.num_layers - n) * mlp) / m.num_layers
    attention = 2 * 2 * s * a * d                                     # QK^T and AV, full s x s
    head = 2 * h * vocab
    return projections + mlp, attention, head


def expert_slots_per_token(m: ModelConfig, context: int = 1) -> float:
    """The expert MLPs an MoE layer computes per token, its static buffers' slots filled or empty.
    Each of the E experts runs C slots a row (`parallel.expert_dispatch.capacity`: ceil(factor s k
    / E), dropless C = s) where a token's routed work is k slots: the compiled step's expert matmuls
    are E C / (k s) times the active FLOPs (dropless: E / k). With context parallelism (c > 1) and
    a capacity factor, each of the c ranks of a row keeps the whole row's C slots (any of them may
    hold all of an expert's tokens): c E C / s; dropless, each rank its own s/c: E."""
    from mtjax.parallel.expert_dispatch import capacity
    s, E, k = m.seq_len, m.num_experts, m.moe_top_k
    if not m.moe_capacity_factor:
        return float(E)
    return context * E * capacity(m.moe_capacity_factor, s, k, E) / s


def moe_layers(m: ModelConfig) -> int:
    """How many of the l layers hold experts (`ModelConfig.is_moe_layer`)."""
    return sum(m.is_moe_layer(i) for i in range(m.num_layers))


def _mlp_flops(m: ModelConfig, f: int) -> float:
    """One token through an MLP of inner size f: SwiGLU has gate, up, down."""
    return 2 * m.hidden_size * f * (3 if m.mlp_activation == "swiglu" else 2)


def parameter_count(params) -> int:
    """The weights in a parameter tree (arrays or ShapeDtypeStructs, e.g. `jax.eval_shape` of
    the trainer's `init_state().params`): every leaf but the MoE routing probe `stats`, which
    only carries the step's routing counts (`model/moe.py`)."""
    import jax
    import numpy as np
    return int(sum(np.prod(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                   if getattr(path[-1], "key", None) != "stats"))


def inactive_parameters(m: ModelConfig) -> int:
    """Parameters a token does not use: the E - k experts it is not routed to, in every MoE layer."""
    if not m.moe:
        return 0
    per_expert = m.hidden_size * m.expert_ffn_size * (3 if m.mlp_activation == "swiglu" else 2)
    return moe_layers(m) * (m.num_experts - m.moe_top_k) * per_expert


def flops_per_step(m: ModelConfig, vocab: int, global_batch: int, recompute: str = "none",
                   block_layers: int = 0, expert_slots: float | None = None) -> float:
    """Training FLOPs of one step: backward = 2 x forward; recomputation re-runs what it drops.
    Block recomputation re-runs the whole forward of `block_layers` of the l layers (N per
    model chunk, so N p v in all: `StepPlan.recomputed_layers`). `expert_slots`: as
    `forward_flops_per_token`'s."""
    weights, attention, head = forward_flops_per_token(m, vocab, expert_slots)
    layer = weights + attention
    extra = {"none": 0.0, "selective": attention, "full": layer, "block": layer * block_layers / m.num_layers}
    per_token = m.num_layers * (3 * layer + extra[recompute]) + 3 * head
    return per_token * global_batch * m.seq_len


def step_flops(m: ModelConfig, plan, expert_slots: float | None = None) -> float:
    """`flops_per_step` of the step `plan` (a `training.plan.StepPlan`) describes."""
    return flops_per_step(m, plan.padded_vocab, plan.global_batch, plan.recompute.mode, plan.recomputed_layers,
                          expert_slots)


def model_flops(m: ModelConfig, plan) -> float:
    """The model's FLOPs of the step `plan` describes, without the recomputed forward: what MFU
    counts (Megatron's logged TFLOP/s; the run's log, `inspect`'s predicted_mfu, bench_train)."""
    return flops_per_step(m, plan.padded_vocab, plan.global_batch)


def megatron_formula(m: ModelConfig, vocab: int, global_batch: int) -> float:
    """Narayanan et al.'s closed form (GPT, no recomputation), for checking."""
    B, s, l, h = global_batch, m.seq_len, m.num_layers, m.hidden_size
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + vocab / (12 * l * h))


def peak_tflops(device_kind: str, configured: float) -> float | None:
    """Per-device peak for MFU: the configured value, else a known GPU's bf16 peak, else None."""
    if configured > 0:
        return configured
    found = [name for name in PEAK_TFLOPS if name in device_kind]
    return PEAK_TFLOPS[max(found, key=len)] if found else None
