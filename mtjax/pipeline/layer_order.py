"""Where each layer is stored: the order the executor runs them in (interleaving) vs canonical.

Notation: l layers, p stages, v chunks per stage, L = l/(p v) layers per chunk.
Stage i runs chunks c = 0..v-1, chunk c being virtual stage j = c p + i, i.e.
canonical layers [j L, (j+1) L). The parameters keep their `layers` axis in run
order: position k of stage i's contiguous block (l/p rows, sharded over `pipe`)
holds canonical layer (c p + i) L + k mod L with c = k // L. So a stage's shard is
its v chunks one after the other, and no step moves a layer between stages.
Checkpoints, the reference model and users see the canonical order
(`permute_layers(tree, canonical_order(...))`). With v = 1 both orders are the same.
zbv's V layout (`layout="v"`, v = 2) puts virtual stages i and 2p - 1 - i on stage i instead.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.pipeline.table import virtual_stage


def layer_order(num_layers: int, p: int, v: int, layout: str = "loop") -> np.ndarray:
    """run order -> canonical layer: stored row k holds canonical layer layer_order(...)[k]."""
    L = num_layers // (p * v)
    return np.array([virtual_stage(layout, p, i, c) * L + r for i in range(p) for c in range(v) for r in range(L)])


def canonical_order(num_layers: int, p: int, v: int, layout: str = "loop") -> np.ndarray:
    """The inverse permutation: canonical layer n is stored at row canonical_order(...)[n]."""
    return np.argsort(layer_order(num_layers, p, v, layout))


def permute_layers(tree, rows: np.ndarray):
    """Every leaf under a `layers` key (params, gradients, Adam moments) with its leading axis
    taken in the order `rows`; other leaves unchanged."""
    def take(path, x):
        under_layers = any(getattr(k, "key", None) == "layers" for k in path)
        return jnp.take(x, rows, axis=0) if under_layers else x
    return jax.tree_util.tree_map_with_path(take, tree)
