"""The model group of the configuration schema (`ModelConfig`), re-exported by `schema.py`.

Kept apart from the other groups so that neither file outgrows the house limit; the notation is
schema.py's (b micro-batch, s sequence, h hidden, a heads, k kv heads, l layers, V vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass

from mtjax.config.fields import doc


@dataclass(frozen=True)
class ModelConfig:
    """The decoder: architecture, sizes, vocabulary padding, dropout, attention kernel, rotary options."""
    arch: str = doc("gpt", 'gpt (LayerNorm, learned positions, GeLU) or llama (RMSNorm, RoPE, SwiGLU, GQA)')
    num_layers: int = doc(2, "l, the number of Transformer layers")
    hidden_size: int = doc(64, "h, the hidden size")
    num_heads: int = doc(4, "a, the attention (query) heads")
    num_kv_heads: int = doc(0, "k, the key/value heads (grouped-query attention); 0 means k = a")
    ffn_hidden_size: int = doc(0, "f, the dense MLP's inner size (and the experts' when moe_ffn_hidden_size is 0); "
                                  "0 means 4h (gpt) or the multiple of 64 nearest 8h/3 (llama)")
    seq_len: int = doc(64, "s, the sequence length")
    vocab_size: int = doc(0, "V before padding; 0 takes the tokenizer's")
    vocab_multiple: int = doc(128, "V is padded to a multiple of vocab_multiple * t")
    tie_embeddings: bool | None = doc(None, "the output layer reuses the input embedding; null: the arch's (gpt yes, "
                                            "llama no)")
    kv_channels: int = doc(0, "d, the per-head dimension (Megatron's name); 0 means h/a")
    activation: str = doc("", 'MLP activation: gelu (exact erf) | gelu_tanh (gpt), swiglu (llama); "" the arch\'s')
    qkv_bias: bool = doc(False, "biases on Q, K, V for llama (Qwen2); gpt always has every bias")
    qk_norm: bool = doc(False, "llama: RMSNorm of each head of Q and K over d, before RoPE, one scale [d] (Qwen3)")
    dropout: float = doc(0.0, "hidden dropout probability (after attention and MLP)")
    attention_dropout: float = doc(0.0, "dropout probability on the attention probabilities")
    attention: str = doc("auto", "core attention: auto | xla (einsums) | dot_product (cuDNN flash attention where it "
                                 "applies)")
    norm_eps: float = doc(1e-5, "LayerNorm / RMSNorm epsilon")
    rope_theta: float = doc(10000.0, "rotary base (llama)")
    rope_scaling: str = doc("none", "rotary frequency scaling: none | linear | llama3 (Llama 3.1's bands) | yarn "
                                    "(YaRN, Qwen2.5's long context)")
    rope_scaling_factor: float = doc(1.0, "linear: positions divided by it; llama3, yarn: low frequencies divided by it")
    rope_low_freq_factor: float = doc(1.0, "llama3: wavelengths above original_positions/low are fully scaled")
    rope_high_freq_factor: float = doc(4.0, "llama3: wavelengths below original_positions/high are kept")
    rope_original_positions: int = doc(8192, "llama3, yarn: the pre-training context "
                                             "(original_max_position_embeddings)")
    rope_beta_fast: float = doc(32.0, "yarn: frequencies turning more than beta_fast times over the original context "
                                      "are kept")
    rope_beta_slow: float = doc(1.0, "yarn: frequencies turning fewer than beta_slow times are fully scaled")
    rope_attention_factor: float = doc(0.0, "yarn: cos and sin multiplied by it; 0 = 0.1 ln(factor) + 1 (1 when "
                                            "factor <= 1)")
    init_std: float = doc(0.02, "standard deviation of the normal init; output projections scaled by 1/sqrt(2l)")
    # mixture of experts (`model/moe.py`, docs/design.md "Mixture of experts")
    num_experts: int = doc(0, "E, experts per MoE layer; 0 = a dense MLP in every layer")
    moe_top_k: int = doc(2, "k, the experts each token is routed to")
    moe_ffn_hidden_size: int = doc(0, "each expert's inner size; 0 means ffn_hidden_size's f")
    moe_layer_freq: int = doc(1, "every moe_layer_freq-th layer (counting from the first MoE layer) is MoE; 1 = all")
    moe_first_dense: int = doc(0, "the first N layers keep a dense MLP (DeepSeek's first-k-dense)")
    moe_shared_expert_size: int = doc(0, "inner size of a shared expert every token goes through; 0 = none")
    moe_shared_expert_gate: bool = doc(False, "the shared expert's output is scaled by sigmoid(x w_g), w_g [h] "
                                              "(Qwen2-MoE)")
    moe_capacity_factor: float = doc(0.0, "expert capacity ceil(factor*s*k/E) tokens per sequence (exact, "
                                     "the factor as written), the lowest-scored dropped; 0 = dropless")
    moe_aux_loss_coeff: float = doc(0.0, "weight of the per-sequence load-balancing loss E/(k s^2) sum_e n_e P_e "
                                    "(padding of fine-tuning rows left out)")
    moe_z_loss_coeff: float = doc(0.0, "weight of the router z-loss mean_tokens logsumexp(logits)^2 (padding "
                                  "left out)")
    moe_score: str = doc("softmax", "router scores: softmax | sigmoid (DeepSeek-V3)")
    moe_renormalize: bool = doc(True, "the k chosen scores are divided by their sum (Mixtral, Qwen3-MoE)")
    moe_router_bias: bool = doc(False, "aux-loss-free balancing: a non-gradient per-expert bias on the "
                                "selection scores (needs moe_score=sigmoid)")
    moe_router_bias_rate: float = doc(1e-3, "the bias step: b_e += rate * sign(mean load - load_e) per global batch")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """d: kv_channels, or h/a when it is 0."""
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def tied(self) -> bool:
        """Whether the output layer is the input embedding: tie_embeddings, or the arch's default."""
        return self.arch == "gpt" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def mlp_activation(self) -> str:
        """The MLP's activation: `activation`, or the arch's default (gelu, swiglu)."""
        return self.activation or ("swiglu" if self.arch == "llama" else "gelu")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's inner size: moe_ffn_hidden_size, or the dense f."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def dense_prefix(self) -> int:
        """P, the dense layers before the units: moe_first_dense rounded down to a multiple of moe_layer_freq."""
        f = max(self.moe_layer_freq, 1)
        return self.moe_first_dense - self.moe_first_dense % f if self.moe else 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based, canonical) holds experts: past the first dense ones, every moe_layer_freq-th."""
        return self.moe and i >= self.moe_first_dense and (i - self.moe_first_dense) % self.moe_layer_freq == 0

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch == "llama":
            return 64 * max(1, round(8 * self.hidden_size / 3 / 64))
        return 4 * self.hidden_size
