"""Packed rows: the documents of a row, read off its end-of-document tokens (`data.document_masking`).

Shape legend: b rows, s tokens of a row (the model's inputs), T query rows, S key rows.

A document ends at (and includes) each end-of-document token e; the row's first token starts one
(a leading fragment is a document of its own). For the tokens x_0 .. x_{s-1} of a row:

    segment_i  = #{j < i : x_j = e}                  the document token i belongs to (0, 1, ...)
    position_i = i - start_i,  start_i = 1 + max{j < i : x_j = e} (0 if none)

so positions restart at 0 in every document, for learned positions and for RoPE alike, and
attention is causal inside a document only: query i reads key j iff j <= i and segment_j =
segment_i. Every query reads itself, so no row of the mask is empty. Rows padded with e (the
fine-tuning packer's padding) make each padding token a one-token document of its own.

Padding. The training step marks the padding of fine-tuning rows (which tokens are padding:
`training/packing.py` `row_padding`) by turning its segment ids g into -1 - g (`mark_padding`):
a one-token document's id is its own, the map is one to one and sends it below every real id, so
`same_document` is unchanged, and whatever must tell padding apart reads g < 0 (`real_tokens`:
the mixture of experts routes padding nowhere, `model/moe.py`). Rows read otherwise (generation,
`mtjax.load(...).logits`) have no padding.

`Documents` always describes whole rows, in true position order, and every device holds them
whole (they are computed from the row's tokens, which every context and tensor rank holds);
a consumer takes the rows it needs: its context chunks (`context_ops.split_row`), the gathered
keys' rows (`context_ops.all_positions`), its sequence-parallel shard.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Documents(NamedTuple):
    """The documents of rows [b, s]: `segments` and `positions`, int32 [b, s] (module docstring)."""
    segments: jax.Array
    positions: jax.Array


def find_documents(tokens, eod: int) -> Documents:
    """tokens [b, s] int -> their `Documents` for end-of-document id `eod`."""
    is_eod = (tokens == eod).astype(jnp.int32)                                   # [b, s]
    segments = jnp.cumsum(is_eod, axis=1) - is_eod                               # EODs strictly before i
    index = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    after_eod = jnp.where(is_eod == 1, index + 1, 0)                            # a document starts at j + 1
    starts = lax.cummax(jnp.pad(after_eod[:, :-1], ((0, 0), (1, 0))), axis=1)   # [b, s]
    return Documents(segments, index - starts)


def mark_padding(docs: Documents, padding) -> Documents:
    """`docs` with the padding tokens (bool [b, s], each a document of its own) marked: segment id
    g -> -1 - g (module docstring)."""
    return docs._replace(segments=jnp.where(padding, -1 - docs.segments, docs.segments))


def real_tokens(segments):
    """Segment ids [b, s] -> bool [b, s]: the tokens that are not padding (`mark_padding`)."""
    return segments >= 0


def same_document(q_segments, k_segments):
    """[b, T] and [b, S] segment ids -> bool [b, T, S]: query and key in one document."""
    return q_segments[:, :, None] == k_segments[:, None, :]

