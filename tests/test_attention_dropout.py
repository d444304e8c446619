"""Attention dropout by position (`mtjax.model.attention_dropout`): the hash's statistics, and the
same masks at context c as at c = 1, so the same outputs, losses and gradients.

The cores (all_gather, ring; plain and packed rows) are compared with one device's einsum
attention under one key, at fp32: O and the gradients of sum(O * T) w.r.t. Q, K, V. The models
(GPT, Llama with GQA) compare c = 2's loss and gradients with c = 1's (recompute none), attention
dropout 0.1 and hidden dropout 0: Llama with the ring and selective recomputation, GPT with
all_gather and full recomputation, so the recomputed cores draw c = 1's masks too (and the key
reaches every context rank the same).
"""
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from layouts import ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from mtjax.config import validate
from mtjax.mesh import CONTEXT, make_mesh
from mtjax.model.attention_dropout import keep_mask as eager_keep_mask, mix, seed_of
from mtjax.model.context_attention import all_gather_attention, ring_attention
from mtjax.model.core_attention import einsum_attention
from mtjax.parallel.context_ops import chunk_positions


keep_mask = jax.jit(eager_keep_mask, static_argnums=(4, 5, 6))      # one compile per shape, not per op


def sigmas(x, p, n):
    """How many standard deviations a share x of n Bernoulli(p) draws is from p."""
    return abs(x - p) / np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.1])
def test_the_kept_share_is_the_keep_probability_along_every_axis(keep):
    """Over [b 4, k_r 2, g 4, T 128, S 128] (131072 elements): the share kept is keep, every
    (query, head, row) line keeps about it, and neighbours along each axis, and diagonally, are
    kept together at keep^2 (no structure the positions or heads could show through)."""
    m = np.asarray(keep_mask(seed_of(jax.random.key(11)), jnp.arange(4), jnp.arange(128), jnp.arange(128),
                             2, 4, keep))
    assert sigmas(m.mean(), keep, m.size) < 4
    lines = m.reshape(-1, 128).mean(axis=1)
    assert sigmas(lines, keep, 128).max() < 5                                  # 1024 lines
    pairs = [(np.take(m, np.arange(n - 1), axis=a), np.take(m, np.arange(1, n), axis=a))
             for a, n in enumerate(m.shape)] + [(m[..., :-1, :-1], m[..., 1:, 1:])]
    for first, second in pairs:
        assert sigmas((first & second).mean(), keep ** 2, first.size) < 4.5


def test_the_mask_is_a_function_of_the_positions():
    """A block drawn at some positions is the whole mask at those positions, for per-row
    positions too; another seed gives another mask; mix is a bijection on a sample."""
    seed = seed_of(jax.random.key(2))
    whole = np.asarray(keep_mask(seed, jnp.arange(2), jnp.arange(16), jnp.arange(16), 1, 2, 0.5))
    qs, ks = jnp.array([3, 12, 7]), jnp.array([0, 15, 9, 4])
    block = np.asarray(keep_mask(seed, jnp.arange(2), qs, ks, 1, 2, 0.5))
    np.testing.assert_array_equal(block, whole[:, :, :, qs][..., ks])
    rows = np.asarray(keep_mask(seed, jnp.array([1, 0]), jnp.stack([qs, qs + 1]), jnp.stack([ks, ks]), 1, 2, 0.5))
    np.testing.assert_array_equal(rows[0], whole[1][:, :, qs][..., ks])
    np.testing.assert_array_equal(rows[1], whole[0][:, :, qs + 1][..., ks])
    other = np.asarray(keep_mask(seed_of(jax.random.key(3)), jnp.arange(2), jnp.arange(16), jnp.arange(16), 1, 2, 0.5))
    assert (other != whole).mean() > 0.3
    sample = jnp.arange(1 << 16, dtype=jnp.uint32) * jnp.uint32(65537)
    assert np.unique(np.asarray(jax.jit(mix)(sample))).size == sample.size


# -- the cores: c ranks against one device, one key -------------------------------------------
B, S, KV, D, RATE = 2, 16, 2, 8, 0.25
KEY = jax.random.key(5)
SEGMENTS = jnp.array([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5], jnp.int32)   # packed rows


def inputs(g: int):
    keys = jax.random.split(jax.random.key(g), 4)
    q = jax.random.normal(keys[0], (B, S, KV, g, D))
    k, v = (jax.random.normal(key, (B, S, KV, D)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape)


def core(kind: str, c: int, packed: bool):
    segments = SEGMENTS if packed else None
    if kind == "ring":
        return lambda q, k, v: ring_attention(q, k, v, c, segments=segments, dropout_key=KEY, rate=RATE)
    return lambda q, k, v: all_gather_attention(q, k, v, c, "xla", KEY, RATE, segments)


def vjp(fn):
    def run(q, k, v, t):
        out, pull = jax.vjp(fn, q, k, v)
        return (out, *pull(t))
    return jax.jit(run)


def one_device(g: int, packed: bool, rate: float = RATE):
    segments = SEGMENTS if packed else None
    return vjp(lambda q, k, v: einsum_attention(q, k, v, KEY, rate, segments=segments))(*inputs(g))


def test_the_dropout_changes_the_output():
    """Not vacuous: the cores below drop something."""
    assert np.abs(np.asarray(one_device(2, False)[0]) - np.asarray(one_device(2, False, 0.0)[0])).max() > 0.1


CORES = [("ring", 2, 1, False), ("gather", 2, 2, False), ("ring", 2, 2, True), ("gather", 2, 1, True)]


@pytest.mark.parametrize("kind,c,g,packed", CORES, ids=["-".join(map(str, x)) for x in CORES])
def test_core_draws_one_devices_masks(kind, c, g, packed):
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:c], context=c)
    spec = P(None, CONTEXT)
    fn = jax.shard_map(core(kind, c, packed), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    order = np.concatenate([np.asarray(chunk_positions(S, c, r)) for r in range(c)])
    got = vjp(fn)(*(x[:, order] for x in inputs(g)))
    for name, want, have in zip(("out", "dq", "dk", "dv"), one_device(g, packed), got):
        np.testing.assert_allclose(have, want[:, order], rtol=1e-5, atol=1e-5, err_msg=name)


# -- the models: c = 2 against c = 1 ----------------------------------------------------------
MODELS = [("llama", "ring", "selective"), ("gpt", "all_gather", "full")]   # (arch, kind, recompute) at c = 2
DROPOUT = ["model.attention_dropout=0.1", "model.dropout=0.0", "model.num_layers=1"]


def loss_and_grads(arch: str, context: int, extra=()):
    cfg = tiny_config(arch, extra=[*DROPOUT, f"parallel.context={context}", *extra])
    validate(cfg, context)
    trainer = build(cfg, 1, 1, 1, context)
    state = trainer.init_state()
    grads, loss = trainer.grad_fn(state.params, trainer.put_batch(random_batch(4)), state.rng)
    return float(loss), jax.device_get(grads)


@cache
def at_one(arch: str):
    return loss_and_grads(arch, 1)


@pytest.mark.parametrize("arch,kind,recompute", MODELS, ids=["-".join(m) for m in MODELS])
def test_context_2_matches_context_1(arch, kind, recompute):
    loss, grads = loss_and_grads(arch, 2, [f"parallel.context_attention={kind}", f"train.recompute={recompute}"])
    want_loss, want = at_one(arch)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    errs = leaf_errors(grads, want, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}


def test_decoding_positions_and_packed_segments_are_refused_together():
    """The einsum core's decode mask (positions) would drop the document cut (segments) silently."""
    q = jnp.zeros((1, 4, 1, 1, 2))
    kv = jnp.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match="do not combine"):
        einsum_attention(q, kv, kv, positions=jnp.zeros((1, 4), jnp.int32), segments=jnp.ones((1, 4), jnp.int32))
