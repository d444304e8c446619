"""Packed rows in the training step: documents, which labels carry loss, and what the loss divides by.

Shape legend: B global batch, d data, c context, b micro-batch, s sequence; a row holds s + 1
tokens x_0 .. x_s, the inputs x_0 .. x_{s-1} and the labels x_1 .. x_s.

A batch is int32 [B, s + 1]. A token is its id, plus the bit `NO_LOSS` (2^30) where predicting
it carries no loss: fine-tuning data sets it on prompt tokens and on the padding after the last
sample of a row (`data/sft.py`), so the loss mask rides in the one array every layout already
splits and pipelines. The padding itself (`row_padding`: the mixture of experts routes it nowhere)
is read off the same tokens and marked in the documents' segment ids (`model/documents.py`).
Label i (predicting x_{i+1} from x_0 .. x_i) carries loss, w_i = 1, unless

    x_{i+1} has NO_LOSS set, or
    x_i is the end-of-document token e (`data.document_masking` or `data.eod_mask_loss`): with
        document masking the query at an e sees only its own document, and its label is the next
        document's first token, which nothing before it predicts. The label e itself is trained.

The loss normaliser. With any of these on, the step's loss is

    L = sum_{rows, i} w_i l_i / N,    N = max(1, sum_{rows, i} w_i over the whole global batch),

the mean over the loss-carrying labels of the global batch, each weighing the same whatever row,
micro-batch or rank holds it. N is counted before the step computes anything: every device
counts the w of its data rank's B/d whole rows (every context rank holds the whole rows, so
they count the same and only `data` is summed), one psum over `data`; each micro-batch's sum
is then multiplied by scale / N. Without them, N = B s, a constant (`plan.tokens_per_step`).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mtjax.mesh import DATA
from mtjax.model.documents import Documents, find_documents, mark_padding
from mtjax.parallel.context_ops import split_row

NO_LOSS = 1 << 30           # set on a token whose prediction carries no loss; ids stay below it


def token_ids(tokens):
    """The ids of tokens (any shape), the `NO_LOSS` bit cleared."""
    return tokens & (NO_LOSS - 1)


def row_documents(tokens, plan) -> Documents | None:
    """Rows [b, s + 1] -> the documents of their inputs [b, s] (whole rows), the padding marked
    (`row_padding`, `documents.mark_padding`), or None without document masking."""
    if not plan.document_masking:
        return None
    docs = find_documents(token_ids(tokens[:, :-1]), plan.eod)
    return mark_padding(docs, row_padding(tokens, plan.eod, docs.positions))


def row_padding(tokens, eod: int, positions):
    """Rows [b, s + 1] and their inputs' document positions [b, s] -> bool [b, s]: the inputs that
    are padding, what the packer appends after a row's last sample (`data/packed_dataset.py`): the
    EOD | NO_LOSS tokens that run to the row's end, each a document of its own (position 0). Not
    padding: a prompt's tokens (NO_LOSS but real inputs; a BOS that is the EOD id too, a response
    follows it), and the first EOD after a sample cut without one (it ends that sample's document)."""
    pad = (tokens == (eod | NO_LOSS)).astype(jnp.int32)
    to_the_end = lax.cummin(pad, axis=1, reverse=True)[:, :-1] == 1     # pad from here to the row's end
    return to_the_end & (positions == 0)


def label_weights(tokens, plan):
    """Rows [b, s + 1] -> w [b, s] fp32 over whole rows (module docstring), or None when every
    label carries loss."""
    if not plan.masks_loss:
        return None
    keep = ((tokens[:, 1:] & NO_LOSS) == 0) & (token_ids(tokens[:, :-1]) != plan.eod)
    return keep.astype(jnp.float32)


def local_weights(tokens, plan):
    """`label_weights` at this context rank's s/c positions [b, s/c] (None as it)."""
    w = label_weights(tokens, plan)
    return None if w is None else split_row(w, plan.context)


def loss_labels(batch, plan) -> float:
    """The loss-carrying labels of a whole global batch [B, s + 1] (a placed array, outside the
    step; it weighs validation batches): B s, or the sum of its `label_weights`."""
    w = label_weights(batch, plan)
    return float(plan.tokens_per_step if w is None else jnp.sum(w))


def loss_denominator(batch, plan):
    """N (module docstring): B s, or inside shard_map from this data rank's rows [B/d, s + 1]
    the psum over `data` of their weights (at least 1)."""
    w = label_weights(batch, plan)
    if w is None:
        return plan.tokens_per_step
    return jnp.maximum(lax.psum(jnp.sum(w), DATA), 1.0)   # scalar: this data rank's rows -> the batch's
