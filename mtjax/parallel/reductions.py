"""Which gradients are summed over `tensor`: derived from how each parameter is declared.

Convention (`docs/design.md`, "The operators"): a value replicated over `tensor` is held in full
on every rank, and so is its cotangent. A parameter's local gradient on rank r is then
dL/dW restricted to what rank r computed with W, and the true gradient is complete on every
rank unless ranks computed with W on different data, where it is the sum over ranks:

    dL/dW = sum_r dL_r/dW.

Megatron marks each parameter with two attributes. Here the first follows from the logical
axes, and `declare` (`parallel/layers.py`) stores the second in the parameter's box
(`ParamBox`), so the abstract parameters carry both:

* tensor_model_parallel: a logical axis the rule table maps to `tensor` (vocab, heads,
  kv_heads, mlp). Where the layout splits it, rank r holds W_r and its gradient is local and
  complete. Where the layout replicates it (kv heads with k % t != 0, `rules_for`), each rank
  used it for its own query heads only: a partial sum.
* sequence_parallel: replicated over `tensor` and applied to the residual stream, which
  sequence parallelism splits to [b, s/t, h] (norm scales and biases, the row-parallel output
  bias added after the reduce-scatter, the position table whose rows each rank slices). Rank
  r's gradient covers its s/t tokens: a partial sum iff sequence parallelism is on (and t > 1).
* shared_by_heads (mtjax's own): replicated over `tensor` and applied to every attention head (a
  QK-norm scale over head_dim), while rank r holds only its own heads: a partial sum whenever
  t > 1, with or without SP (Megatron all-reduces q_layernorm / k_layernorm by name).
* none of these: replicated and applied to identical data on every rank. No reduction.
"""
from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
from jax.sharding import PartitionSpec as P

from mtjax.mesh import TENSOR
from mtjax.partitioning import RULES, logical_to_mesh, uses_axis


class ParamBox(nn.LogicallyPartitioned):
    """A declared parameter: its value, logical axes (`names`), Megatron's `sequence_parallel`
    attribute and `shared_by_heads` (static: not pytree leaves, so `eval_shape` keeps them)."""

    sequence_parallel: bool = flax.struct.field(default=False, pytree_node=False)
    shared_by_heads: bool = flax.struct.field(default=False, pytree_node=False)


def tensor_model_parallel(names) -> bool:
    """Megatron's `tensor_model_parallel`: some logical axis is one the rule table splits over
    `tensor` (whether or not a given layout can split it)."""
    return any(RULES.get(name) == TENSOR for name in names if isinstance(name, str))


def needs_tensor_sum(box: ParamBox, rules: dict, tensor: int, sequence_parallel: bool) -> bool:
    """True where this parameter's local gradient is a partial sum over `tensor` (module docstring)."""
    if not isinstance(box, ParamBox):
        raise TypeError(f"{box!r} was not declared with mtjax.parallel.layers.declare")
    if tensor == 1 or uses_axis(logical_to_mesh(P(*box.names), rules), TENSOR):
        return False                        # held whole (t = 1) or split: W_r's gradient is complete
    if tensor_model_parallel(box.names) or box.shared_by_heads:
        return True                         # replicated, applied to each rank's own heads
    return box.sequence_parallel and sequence_parallel


def tensor_reductions(boxed_params, rules: dict, tensor: int, sequence_parallel: bool):
    """The parameter tree (unboxed structure) of bools: True where the step `psum`s the gradient
    over `tensor`. `boxed_params` are the declared (e.g. abstract) parameters, `rules` the layout's
    rule table (`partitioning.rules_for`)."""
    return jax.tree.map(lambda box: needs_tensor_sum(box, rules, tensor, sequence_parallel), boxed_params,
                        is_leaf=lambda x: isinstance(x, nn.Partitioned))
