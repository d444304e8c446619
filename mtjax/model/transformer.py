"""The decoder-only Transformer: embedding, a scanned stack of blocks, vocabulary-parallel head.

Shape legend: b micro-batch, s sequence, h hidden, V padded vocabulary,
t tensor size, l layers. With sequence parallelism the residual stream is
[b, s/t, h]; otherwise [b, s, h], replicated over `tensor`.

    tokens [b, s] -> embedding -> exit (all-reduce | reduce-scatter) -> + positions
      -> l x Block -> final norm -> enter (f | all-gather) -> logits [b, s, V/t]

The blocks are one `nn.scan` over a leading `layers` axis, so the program
(and its compile time) has one block whatever the depth.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax.config.schema import ModelConfig
from mtjax.model.attention import SelfAttention
from mtjax.model.dropout import dropout
from mtjax.model.mlp import MLP
from mtjax.model.norms import make_norm
from mtjax.model.rotary import rope_tables
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.layers import ColumnParallelLinear, declare
from mtjax.parallel.tensor_ops import enter_tensor_region, exit_tensor_region, tensor_rank
from mtjax.parallel.vocab import VocabParallelEmbedding

REMAT_POLICIES = {
    # Selective (Korthikanti et al.): keep the weight matmuls' outputs, recompute the
    # attention core (its einsums are the only ones with batch dimensions).
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class Block(nn.Module):
    """x + Attn(Norm(x)), then x + MLP(Norm(x)); each sublayer crosses the tensor region once."""

    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32
    deterministic: bool = True

    @nn.compact
    def __call__(self, x, rope):
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        y = make_norm(c.arch, c.norm_eps, "ln_attn")(x)
        y = enter_tensor_region(y, t, sp)                                   # [b, s, h]
        y = SelfAttention(c, self.ctx, self.dtype, name="attn")(y, rope, self.deterministic)
        x = x + dropout(self, y, c.dropout, self.deterministic, t, split=sp)
        y = make_norm(c.arch, c.norm_eps, "ln_mlp")(x)
        y = enter_tensor_region(y, t, sp)                                   # [b, s, h]
        y = MLP(c, self.ctx, self.dtype, name="mlp")(y)
        x = x + dropout(self, y, c.dropout, self.deterministic, t, split=sp)
        return x, None


def stacked_blocks(cfg: ModelConfig, num_layers: int, recompute: str):
    """`num_layers` Blocks as one scanned module with a leading `layers` parameter axis."""
    block = Block
    if recompute != "none":
        block = nn.remat(Block, policy=REMAT_POLICIES[recompute], prevent_cse=False)
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                   in_axes=nn.broadcast, length=num_layers,
                   metadata_params={nn.PARTITION_NAME: "layers"})


class Transformer(nn.Module):
    """GPT (LayerNorm, learned positions, GeLU) or Llama (RMSNorm, RoPE, SwiGLU, GQA).

    Three parts that a pipeline stage can run separately (`apply(..., method=...)`):
    `embed_tokens_to_stream` on the first stage, `run_layers` on every stage (its `num_layers`
    local layers), `head` on the last stage.
    """

    cfg: ModelConfig
    vocab: int                       # padded V
    ctx: ParallelContext = ParallelContext()
    dtype: jnp.dtype = jnp.float32
    recompute: str = "none"
    deterministic: bool = True
    num_layers: int = 0              # layers held here; 0 means all of cfg.num_layers

    def setup(self):
        c, t = self.cfg, self.ctx.tensor
        self.embed = VocabParallelEmbedding(self.vocab, c.hidden_size, t, c.init_std)
        if c.arch == "gpt":
            self.pos_embedding = declare(self, "pos_embedding", (c.seq_len, c.hidden_size), ("seq", "embed"),
                                         nn.initializers.normal(c.init_std))
        blocks = stacked_blocks(c, self.num_layers or c.num_layers, self.recompute)
        self.layers = blocks(c, self.ctx, self.dtype, self.deterministic)
        self.ln_final = make_norm(c.arch, c.norm_eps)
        if not c.tie_embeddings:
            self.lm_head = ColumnParallelLinear((self.vocab,), ("vocab",), t, False, c.init_std, self.dtype)

    def embed_tokens_to_stream(self, tokens):
        """tokens [b, s] -> residual stream [b, s, h] or [b, s/t, h]."""
        c, t, sp = self.cfg, self.ctx.tensor, self.ctx.sp
        x = exit_tensor_region(self.embed(tokens).astype(self.dtype), t, sp)   # [b, s(/t), h]
        if c.arch == "gpt":
            rows = x.shape[1]                                               # s, or s/t with SP
            pos = lax.dynamic_slice_in_dim(self.pos_embedding, tensor_rank(t) * rows if sp else 0, rows)
            x = x + pos[None].astype(self.dtype)
        return dropout(self, x, c.dropout, self.deterministic, t, split=sp)

    def run_layers(self, x):
        """[b, s(/t), h] -> [b, s(/t), h] through the stacked blocks."""
        c = self.cfg
        rope = rope_tables(c.seq_len, c.head_dim, c.rope_theta) if c.arch == "llama" else None
        x, _ = self.layers(x, rope)
        return x

    def head(self, x):
        """[b, s(/t), h] -> this rank's logits [b, s, V/t]."""
        t, sp = self.ctx.tensor, self.ctx.sp
        x = enter_tensor_region(self.ln_final(x), t, sp)                   # [b, s, h]
        if self.cfg.tie_embeddings:
            return self.embed.attend(x)
        return self.lm_head(x)

    def __call__(self, tokens):
        """tokens [b, s] -> this rank's logits [b, s, V/t]."""
        return self.head(self.run_layers(self.embed_tokens_to_stream(tokens)))
