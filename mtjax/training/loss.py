"""The training objective of one micro-batch, shared by the plain step and the pipeline executor."""
from __future__ import annotations

import jax.numpy as jnp

from mtjax.parallel.vocab import vocab_parallel_cross_entropy


def scaled_loss_sum(logits, labels, plan, scale=1.0, weights=None, denominator=None):
    """S x (sum of this micro-batch's token losses) / N: summed over micro-batches and data ranks
    it is S times the global mean. N = `denominator` (the count of loss-carrying labels in the
    global batch, `training/packing.py`), by default B s; `weights` [b, s] (0 or 1 per label, None:
    all 1) multiply the losses. logits [b, s, V/t], labels [b, s] -> scalar."""
    n = plan.tokens_per_step if denominator is None else denominator
    if plan.grid is not None:   # logits [b/(d q), s, V/q] of the tensor grid (`model/grid_model.py`)
        from mtjax.model.grid_model import grid_loss_sum  # noqa: PLC0415 (the 1D path does not load it)
        return grid_loss_sum(logits, labels, plan.vocab, plan.tied, plan.grid, weights) * (scale / n)
    losses = vocab_parallel_cross_entropy(logits, labels, plan.vocab, plan.tensor)
    if weights is not None:
        losses = losses * weights
    return jnp.sum(losses) * (scale / n)
