"""The column -> row parallel MLP: GeLU (GPT) or SwiGLU (Llama).

Shape legend: b micro-batch, s sequence, h hidden, f MLP hidden, t tensor size.
GeLU:   Y = GeLU(X A) B              A [h, f] by columns, B [f, h] by rows.
SwiGLU: Y = (SiLU(X A_gate) * X A_up) B, gate and up split identically,
so rank r's gate and up columns pair up element by element.
No communication between the two layers: GeLU/SiLU act on local columns.
"""
from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from mtjax.config.schema import ModelConfig
from mtjax.model.joined_columns import joined_kernel
from mtjax.model.recompute import saving_inputs_only
from mtjax.parallel.context import ParallelContext
from mtjax.parallel.layers import ColumnParallelLinear, RowParallelLinear, column_parallel, elementwise

# `model.activation` of the ungated MLP (gpt):
#   gelu       x Phi(x), Phi the standard normal CDF (erf)
#   gelu_tanh  x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2  (transformers' gelu_new / gelu_pytorch_tanh)


def gelu_erf(x):
    """x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, in fp32, returned in x's dtype.

    Written with erf rather than `jax.nn.gelu(approximate=False)`, which goes through erfc: JAX
    expands erfc into both branches of a piecewise polynomial plus an exp (about 90 operations an
    element), where XLA keeps erf as one op with a single rational approximation. For a
    16-bit GPT the exact GeLU and its backward were the two slowest kernels after the
    matmuls and attention, bound by ALU work, not memory (`mtjax.inspect --target h100`)."""
    xf = x.astype(jnp.float32)
    return (0.5 * xf * (1.0 + lax.erf(xf * _SQRT_HALF))).astype(x.dtype)


_SQRT_HALF = 0.7071067811865476
GELUS = {"gelu": gelu_erf, "gelu_tanh": partial(jax.nn.gelu, approximate=True)}


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


class MLP(nn.Module):
    cfg: ModelConfig
    ctx: ParallelContext
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        """x [b, s, h] (inside the tensor region; or its `SequenceShard`, `layers.column_parallel`)
        -> [b, s, h] or [b, s/t, h] (after the exit)."""
        c, t = self.cfg, self.ctx.tensor
        f, bias = c.ffn_size, c.arch == "gpt"
        if c.mlp_activation == "swiglu":
            joined = joined_kernel(self, "gate_up")                             # [h, 2 f/t] or None
            gate, up = column_parallel(x, *(ColumnParallelLinear((f,), ("mlp",), t, False, c.init_std, self.dtype,
                                                                 joined=joined is not None, name=name)
                                            for name in ("gate", "up")), joined=joined)
            # saves gate and up (fc1's outputs, as Megatron keeps them), recomputes SiLU and the product
            hidden = elementwise(saving_inputs_only(_swiglu), gate, up)        # [b, s, f/t] or [s, b, f/t]
        else:
            fc1 = ColumnParallelLinear((f,), ("mlp",), t, bias, c.init_std, self.dtype, name="fc1")
            hidden, = column_parallel(x, fc1)
            # saves fc1's output only (as Megatron's fused bias-GeLU), recomputes the GeLU's intermediates
            hidden = elementwise(saving_inputs_only(GELUS[c.mlp_activation]), hidden)   # [b, s, f/t] or [s, b, f/t]
        out_std = c.init_std / jnp.sqrt(2.0 * c.num_layers)
        return RowParallelLinear((f,), ("mlp",), c.hidden_size, t, self.ctx.sp, bias, out_std,
                                 self.dtype, self.ctx.tensor_overlap, ring_by_all_to_all=self.ctx.ring_by_all_to_all,
                                 name="fc2")(hidden)
