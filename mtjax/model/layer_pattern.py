"""Which layers hold experts, and the unit the layer scan repeats when not all of them do.

Notation: l layers, f = model.moe_layer_freq, k = model.moe_first_dense, r = k mod f. Layer i
(canonical, 0-based) is an MoE layer when i >= k and (i - k) % f == 0 (`ModelConfig.is_moe_layer`);
the others have a dense MLP. A scan runs one program for every row of its stack, so the layers are
cut into
    a dense prefix of P = k - r layers (0 unless k >= f), a stack of its own, `dense_layers`,
    run first; in a pipeline with the embedding, before virtual stage 0's chunk (its backward
    recomputes them, as the embedding's: `pipeline/chunk.py`), so that every chunk runs the same
    (l - P)/(p v) layers;
    u = (l - P)/f units of f consecutive layers, the one at position r an MoE layer, the others
    dense: the rows of the `layers` stack (`LayerGroup`; with f = 1 the MoE `Block` itself).
f divides l - P, and with a pipeline the (l - P)/(p v) layers of a model chunk. Every code path that works on
rows of the `layers` stack (pipeline stages and their interleaving, fsdp, the data-reduction sink,
block recomputation's runs, checkpoints' canonical order) then works on units unchanged. A unit's
parameters are its MoE layer's at the top (`ln_attn`, `attn`, `ln_mlp`, `moe`: the paths of an
all-MoE stack, so `training/moe_stats.py` reads one row of statistics per MoE layer) and the dense
layer at position j under `dense_{j}`. The prefix, outside `layers`, is what the embedding is to
those paths: its gradient is reduced after the backward and fsdp keeps it whole.

    Megatron's moe_layer_freq f:              k = 0       unit = [MoE, dense x (f-1)]
    Qwen2-MoE's decoder_sparse_step f:        k = f - 1   unit = [dense x (f-1), MoE]
    DeepSeek's first_k_dense_replace k, f=1:  P = k       k dense layers, then MoE Blocks
"""
from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.config.schema import ModelConfig
from mtjax.model.block import Block


@dataclass(frozen=True)
class Pattern:
    """The cut of the layers (module docstring); Pattern() is every layer alike: no prefix, units of 1."""

    group: int = 1      # f: layers per row of the `layers` stack
    moe_at: int = 0     # r: the MoE layer's position in a unit
    prefix: int = 0     # P: dense layers before the units, in `dense_layers`

    def rows(self, layers: int) -> int:
        """Rows of the `layers` stack of a model (or model chunk) of `layers` layers."""
        if (layers - self.prefix) % self.group:     # validation refuses it; a model built around it too
            raise ValueError(f"{layers - self.prefix} layers do not make units of {self.group} (model.moe_layer_freq)")
        return (layers - self.prefix) // self.group


def layer_pattern(cfg: ModelConfig, layers: int | None = None) -> Pattern:
    """cfg's layers as a dense prefix and units (module docstring); a dense model: Pattern().
    `layers` given and fewer than l: a pipeline chunk's, units only (the prefix runs with the
    embedding, on virtual stage 0: `Transformer.embed_and_prefix`)."""
    if not cfg.moe:
        return Pattern()
    f, k = cfg.moe_layer_freq, cfg.moe_first_dense
    return Pattern(f, k % f, 0 if layers not in (None, cfg.num_layers) else cfg.dense_prefix)


def chunk_layers(cfg: ModelConfig, pipe: int, virtual_stages: int) -> int:
    """The layers one model chunk runs: all l without a pipeline; with one, (l - P)/(p v), the
    units' layers (the P prefix layers run before virtual stage 0's chunk, with the embedding)."""
    if pipe == 1:
        return cfg.num_layers
    return (cfg.num_layers - cfg.dense_prefix) // (pipe * virtual_stages)


class LayerGroup(Block):
    """One unit: f consecutive layers, the one at `moe_at` an MoE layer (this Block's own body and
    parameters), the others dense Blocks `dense_{j}`."""

    group: int = 2
    moe_at: int = 0

    @nn.compact
    def __call__(self, x, rope, cache=None, positions=None, segments=None):
        """As `Block`; `cache` leaves [f, b, S, k_r, d] (layer j's at j), or None."""
        caches = []
        for j in range(self.group):
            kv = None if cache is None else jax.tree.map(lambda a, j=j: a[j], cache)
            if j == self.moe_at:
                x, kv = super().__call__(x, rope, kv, positions, segments)
            else:
                x, kv = Block(self.cfg, self.ctx, self.dtype, self.deterministic, self.attention,
                              self.recompute_core, dense=True, name=f"dense_{j}")(x, rope, kv, positions, segments)
            caches.append(kv)
        return x, None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *caches)


def unit_block(cfg: ModelConfig, ctx, dtype, deterministic: bool, attention: str, recompute_core: bool) -> Block:
    """The module one row of the `layers` stack runs."""
    p = layer_pattern(cfg)
    if p.group == 1:
        return Block(cfg, ctx, dtype, deterministic, attention, recompute_core, parent=None)
    return LayerGroup(cfg, ctx, dtype, deterministic, attention, recompute_core, group=p.group, moe_at=p.moe_at,
                      parent=None)


def dense_block(cfg: ModelConfig, ctx, dtype, deterministic: bool, attention: str, recompute_core: bool) -> Block:
    """The module a row of the dense prefix runs."""
    return Block(cfg, ctx, dtype, deterministic, attention, recompute_core, dense=True, parent=None)
