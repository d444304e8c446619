"""FSDP under bf16 (`parallel/fsdp.py`, "What moves"): every layer leaf gathered in the compute
dtype, norm scales, biases and the router included (their compute copy is bf16), but for the
leaves whose value in the step is not the compute copy's (`Fsdp.wide`); numerics unchanged.

Checked: the lowered Llama MoE step's all-gather dtypes (nothing compiled); the partitioned GPT
step's all-gather bytes, 2 an element at every site; fsdp's loss and gradients against the
distributed optimizer's, bitwise, from masters off the bf16 grid.
"""
import collections

import jax
import jax.numpy as jnp
import numpy as np

from layouts import build, random_batch, tiny_config
from test_fsdp import CONSTANT_LR, fsdp_config


def test_experts_weights_are_gathered_in_the_compute_dtype():
    """bf16, Llama with 4 experts held whole by each replica (e = 1) at data 4: fsdp gathers every
    leaf of a layer in bf16, the experts' gate, up and fc2, the router and the norm scales included
    (`Fsdp.gather`); only the leaves in `Fsdp.wide` (the router's fp32 bias, `stats`) move in fp32.
    Read from the lowered step (before XLA:CPU's passes, which widen every bf16 collective to fp32);
    nothing is compiled."""
    import re
    from mtjax.inspect import abstract_state
    from mtjax.training.step import batch_sharding
    cfg = fsdp_config("llama", 4, 1, 1, False, 1, ["train.precision=bf16", "model.num_experts=4",
                                                   "model.moe_top_k=2", "model.moe_router_bias=true",
                                                   "model.moe_score=sigmoid"])
    trainer = build(cfg, 4, 1, 1)
    dims = dict(trainer.plan.fsdp.dims)
    assert dims["moe", "experts", "fc2"] is not None and dims["moe", "router"] is not None   # split over data
    assert trainer.plan.fsdp.wide == tuple(k for k in (("moe", "bias"), ("moe", "stats")) if k in dims)
    batch = jax.ShapeDtypeStruct((trainer.plan.global_batch, trainer.plan.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(trainer.mesh))
    text = trainer.train_step.lower(abstract_state(trainer), batch).as_text()
    gathered = collections.Counter(re.findall(r"stablehlo\.all_gather.*-> tensor<([0-9x]+)x(bf16|f32)>", text))
    h, f, E = cfg.model.hidden_size, cfg.model.expert_ffn_size, cfg.model.num_experts
    for shape in (f"{E}x{h}x{f}", f"{E}x{f}x{h}", f"{h}x{E}", f"{h}"):     # gate and up; fc2; the router; norms
        assert gathered[shape, "bf16"] > 0 and gathered[shape, "f32"] == 0, gathered
    wide = {shape for (shape, dtype) in gathered if dtype == "f32"}
    layer = trainer.plan.params.shapes["layers"]["moe"]
    assert wide <= {"x".join(map(str, layer[k].shape[1:])) for _, k in trainer.plan.fsdp.wide}, gathered


def test_bf16_gathers_move_two_bytes_an_element():
    """bf16, GPT at data 4 (l = 2, m = 1), every layer leaf split: in the partitioned program (XLA:CPU
    widens 16-bit collectives to f32 after it: `partitioned_hlo`) every all-gather over `data` is
    bf16, norm scales and biases included (their compute copy is bf16, `layout.compute_params`;
    `Fsdp.gather` casts them back to fp32 after the gather), so the gathered bytes are 2 an element
    (`docs/design.md`, "FSDP"): per layer leaf of P_j one-layer elements, a gather site before the
    forward layer loop and one in it, the same in the backward but for biases (their gradient
    reads no weight, and the backward's gathers of them are dropped), and the weights outside the
    stack once: 2 (4 P_L - 2 P_bias + P_out) bytes over the sites."""
    from mtjax.hlo_report import collective_report, partitioned_hlo, select
    from mtjax.inspect import abstract_state
    from mtjax.training.step import batch_sharding
    trainer = build(fsdp_config("gpt", 4, 1, 1, False, 1, ["train.precision=bf16"]), 4, 1, 1)
    assert all(k is not None for _, k in trainer.plan.fsdp.dims) and trainer.plan.fsdp.wide == ()
    batch = jax.ShapeDtypeStruct((trainer.plan.global_batch, trainer.plan.seq_len + 1), jnp.int32,
                                 sharding=batch_sharding(trainer.mesh))
    hlo = partitioned_hlo(trainer.train_step.lower(abstract_state(trainer), batch))
    gathers = select(collective_report(hlo, trainer.mesh), kind="all-gather", axes=("data",))
    found = collections.Counter((op["dtype"], str(op["shapes"])) for op in gathers)
    assert {op["dtype"] for op in gathers} == {"bf16"}, found
    shapes = trainer.plan.params.shapes
    one = {path: int(np.prod(a.shape[1:])) for path, a in jax.tree_util.tree_leaves_with_path(shapes["layers"])}
    layer, bias = sum(one.values()), sum(n for path, n in one.items() if path[-1].key == "bias")
    outside = sum(int(np.prod(a.shape)) for k, v in shapes.items() if k != "layers" for a in jax.tree.leaves(v))
    assert sum(op["bytes"] for op in gathers) == 2 * (4 * layer - 2 * bias + outside)


def test_bf16_matches_the_distributed_optimizer_bitwise():
    """bf16, GPT at data 4, every weight moved off the bf16 grid (norm scales and biases included):
    from the same masters, fsdp's loss and gradients equal the distributed optimizer's bitwise.
    Both compute with the compute copy (`Trainer.compute_params`, the train step's), whose values
    are bf16; fsdp gathers them in bf16 (exact) and casts the norms and biases back to fp32, which
    the layer reads."""
    fsdp = build(fsdp_config("gpt", 4, 1, 1, False, 1, ["train.precision=bf16"]), 4, 1, 1)
    zero = build(tiny_config("gpt", 1, 1, 4, False, micro_batch=2, extra=[   # fsdp_config's but the layout
        "parallel.distributed_optimizer=true", "train.precision=bf16", *CONSTANT_LR]), 4, 1, 1)
    batch, out = random_batch(), []
    for trainer in (fsdp, zero):
        state = trainer.init_state()
        moved = jax.jit(lambda p: jax.tree.map(lambda a: a + 0.05 * jnp.sin(jnp.arange(a.size).reshape(a.shape)), p),
                        out_shardings=trainer.state_shardings.params)(state.params)
        computed = jax.jit(trainer.compute_params)(moved)
        out.append(jax.device_get(trainer.grad_fn(computed, trainer.put_batch(batch), state.rng)))
    (g_fsdp, loss_fsdp), (g_zero, loss_zero) = out
    assert float(loss_fsdp) == float(loss_zero)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_fsdp), jax.tree.leaves(g_zero), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
