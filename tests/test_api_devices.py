"""`mtjax.mesh.simulate_cpu_devices` from Python, once JAX has started (a notebook's second cell)."""
import os

import jax
import pytest

from mtjax.mesh import simulate_cpu_devices


def test_simulating_devices_after_jax_started_is_refused_unless_it_is_what_jax_has():
    """The backend keeps the devices it started with: asking again for as many passes (a cell run
    again), asking for others says so in one line instead of running on the old count in silence."""
    have = len(jax.devices("cpu"))          # started (conftest's 8)
    simulate_cpu_devices(have)
    flags = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError) as info:
        simulate_cpu_devices(have + 1)
    assert str(info.value) == (f"simulate_cpu_devices({have + 1}): JAX has already started with {have} CPU devices; "
                               "call it before anything uses JAX (in a notebook, restart the kernel first)")
    assert os.environ.get("XLA_FLAGS") == flags and len(jax.devices("cpu")) == have
