"""Vocabulary-parallel embedding and cross-entropy (Megatron's VocabParallelEmbedding and
vocab_parallel_cross_entropy).

Shape legend: b micro-batch, s sequence, h hidden, t tensor size, V the
padded vocabulary; rank r owns rows [r V/t, (r+1) V/t) of the table.
The full logits [b, s, V] are never gathered: the loss needs only three
all-reduces of [b, s] (max, sum of exponentials, target logit).
"""
from __future__ import annotations

import flax.linen as nn

import jax.numpy as jnp
from jax import lax

from mtjax.mesh import TENSOR
from mtjax.parallel.layers import declare, local
from mtjax.parallel.tensor_ops import reduce_from_tensor_region, tensor_rank

NEG_INF = -1e30


def padded_vocab_size(vocab: int, multiple: int, t: int) -> int:
    """V rounded up to a multiple of `multiple` * t, so every rank owns equal rows."""
    unit = multiple * t
    return -(-vocab // unit) * unit


def drawn_vocab_size(vocab: int, multiple: int) -> int:
    """V rounded up to `multiple` alone: the rows vocabulary-sized parameters are drawn at. No
    layout changes it, so one seed gives one model; each layout pads with zero rows to its
    `padded_vocab_size` (`training.state.draw_params`)."""
    return padded_vocab_size(vocab, multiple, 1)


class VocabParallelEmbedding(nn.Module):
    """E[tokens] with E [V, h] split by rows; rank r looks up only the tokens it owns.

    tokens [b, s] -> partial [b, s, h]; the caller sums the partials with
    `exit_tensor_region` (all-reduce, or reduce-scatter with sequence parallelism).
    """

    vocab: int        # padded V
    features: int     # h
    t: int = 1
    std: float = 0.02

    def setup(self):
        self.embedding = declare(self, "embedding", (local(self.vocab, self.t), self.features),
                                 ("vocab", "embed"), nn.initializers.normal(self.std))

    def __call__(self, tokens):
        rows = self.embedding.shape[0]
        ids = tokens - tensor_rank(self.t) * rows
        mine = (ids >= 0) & (ids < rows)
        out = jnp.take(self.embedding, jnp.where(mine, ids, 0), axis=0)
        return jnp.where(mine[..., None], out, 0.0)                   # partial [b, s, h]

    def attend(self, x):
        """Tied output layer: logits_r = X E_r^T, [b, s, h] -> [b, s, V/t]."""
        return jnp.einsum("bsh,vh->bsv", x, self.embedding.astype(x.dtype))


def vocab_parallel_cross_entropy(logits, labels, vocab: int, t: int):
    """Per-token -log softmax(z)[label] from vocabulary shards, in fp32.

    logits [b, s, V/t] (this rank's columns), labels [b, s] -> loss [b, s].
    loss = log sum_r sum_j exp(z_rj - m) - (z_label - m), m = max over all ranks.
    Columns >= `vocab` (padding) are masked to -inf, so they get no probability.
    """
    z = logits.astype(jnp.float32)
    cols = z.shape[-1]
    start = tensor_rank(t) * cols
    z = jnp.where(start + jnp.arange(cols) < vocab, z, NEG_INF)
    m = lax.stop_gradient(jnp.max(z, axis=-1))                        # [b, s]
    if t > 1:
        m = lax.stop_gradient(lax.pmax(m, TENSOR))                    # all-reduce(max) [b, s]
    z = z - m[..., None]
    sum_exp = reduce_from_tensor_region(jnp.sum(jnp.exp(z), axis=-1), t)   # all-reduce [b, s]
    ids = labels - start
    mine = (ids >= 0) & (ids < cols)
    picked = jnp.take_along_axis(z, jnp.where(mine, ids, 0)[..., None], axis=-1)[..., 0]
    target = reduce_from_tensor_region(jnp.where(mine, picked, 0.0), t)    # all-reduce [b, s]
    return jnp.log(sum_exp) - target


def gather_logits(logits, vocab: int, t: int):
    """The full logits [b, s, V_unpadded] from shards (for evaluation and tests only)."""
    if t > 1:
        logits = lax.all_gather(logits, TENSOR, axis=logits.ndim - 1, tiled=True)   # [b, s, V/t] -> [b, s, V]
    return logits[..., :vocab]

