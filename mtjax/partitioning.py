"""Logical axes -> mesh axes: the rule table every PartitionSpec is derived from.

Modules declare each parameter once with logical axis names; this table
says which mesh axis shards each name. Names not in the table (embed,
head_dim, norm, seq, and None) are replicated.
"""
from __future__ import annotations

from types import MappingProxyType

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from mtjax.mesh import DATA, PIPE, TENSOR

RULES = MappingProxyType({   # read-only: layouts derive their own copy (`rules_for`)
    "vocab": TENSOR,
    "heads": TENSOR,
    "kv_heads": TENSOR,
    "mlp": TENSOR,
    "layers": PIPE,
    "batch": DATA,
})


def rules_for(kv_heads: int, tensor: int, expert=None) -> dict:
    """RULES for a layout (a new dict: the callers' to keep): kv heads that t does not divide
    cannot be split, so they are replicated. `expert`: the mesh axis (or axes) an MoE layer's
    experts are split over, when each replica holds its own experts (e = d c, `model/moe.py`)."""
    rules = dict(RULES) if kv_heads % tensor == 0 else {**RULES, "kv_heads": None}
    if expert is not None:
        rules["expert"] = expert
    return rules


def logical_to_mesh(spec: P, rules: dict = RULES) -> P:
    """P('layers', 'embed', 'heads', ...) -> P('pipe', None, 'tensor', ...)."""
    return P(*(rules.get(name) if isinstance(name, str) else None for name in spec))


def logical_specs(boxed_params):
    """The logical PartitionSpec of every parameter (from nn.Partitioned metadata)."""
    return nn.get_partition_spec(boxed_params)


def mesh_specs(boxed_params, rules: dict = RULES):
    """The mesh PartitionSpec of every parameter."""
    return jax.tree.map(lambda s: logical_to_mesh(s, rules), logical_specs(boxed_params),
                        is_leaf=lambda x: isinstance(x, P))


def shardings(mesh, specs):
    """NamedShardings for a tree of mesh PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def drop_axis(spec: P, axis: str) -> P:
    """`spec` with mesh axis `axis` replaced by None (replicated along it)."""
    return P(*(None if name == axis else name for name in spec))


def uses_axis(spec: P, axis: str) -> bool:
    return any(name == axis for name in spec)
