"""Dropout masks (`mtjax.model.dropout.keep_mask`): Bernoulli bits from XLA's Philox generator,
a function of (key, shape) alone. That every recompute mode draws the same masks is checked by
`test_precision_recompute.test_every_recompute_mode_gives_the_gradients_of_none`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtjax.model.dropout import apply_dropout, keep_mask


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.1])
def test_the_kept_share_is_the_keep_probability(keep):
    mask = np.asarray(keep_mask(jax.random.key(7), (400, 500), keep))
    n = mask.size
    assert abs(mask.mean() - keep) < 4 * np.sqrt(keep * (1 - keep) / n)      # 4 standard deviations
    # no structure along either axis: every row and column keeps about the same share
    assert abs(mask.mean(axis=1) - keep).max() < 6 * np.sqrt(keep * (1 - keep) / 500)


def test_the_mask_depends_on_the_key_and_shape_only():
    key = jax.random.key(3)
    a = np.asarray(keep_mask(key, (64, 33), 0.5))
    np.testing.assert_array_equal(a, np.asarray(jax.jit(keep_mask, static_argnums=(1, 2))(key, (64, 33), 0.5)))
    assert (a != np.asarray(keep_mask(jax.random.fold_in(key, 1), (64, 33), 0.5))).mean() > 0.3
    raw = jax.random.PRNGKey(3)                                   # raw uint32[2] keys work too
    assert keep_mask(raw, (8,), 0.5).shape == (8,)


def test_inverted_dropout_scales_what_it_keeps():
    x = jnp.ones((1000, 100), jnp.float32)
    y = np.asarray(apply_dropout(jax.random.key(0), x, 0.2))
    kept = y != 0
    np.testing.assert_allclose(y[kept], 1 / 0.8, rtol=1e-6)
    assert abs(kept.mean() - 0.8) < 0.01
