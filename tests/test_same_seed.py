"""One seed, one model: every layout draws the same initial weights and trains the same.

The vocabulary's parameters are drawn at V rounded up to `vocab_multiple` alone and padded with
zero rows up to the layout's padded V (a multiple of vocab_multiple * t), so Llama's untied
[h, V] output layer, whose random draw depends on its whole shape, no longer changes with t.
Layouts share a build where they can (each initialisation is a compile): tensor 2, tensor 4,
a 2d grid and pipe 2 in three builds per model.

Bitwise equality needs XLA:CPU's own code generation: the suite's faster fusion emitters
(tests/conftest.py, FAST_CODEGEN) may round a transcendental differently in a loop's vectorised
body and its tail, whose split moves with the shard's shape. So this file runs in a child pytest
without them, the child's results being the test's.
"""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from layouts import VOCAB, build, random_batch, tiny_config
from mtjax.parallel.vocab import drawn_vocab_size

LAYOUTS = {  # arch: [(data, pipe, tensor, extra)], the default vocab_multiple
    "gpt": [(2, 2, 2, []), (1, 1, 4, []), (1, 1, 4, ["parallel.tensor_grid=2d"])],
    "llama": [(1, 1, 2, []), (1, 2, 4, ["parallel.schedule=1f1b"]), (1, 1, 4, ["parallel.tensor_grid=2d"])],
}


def assert_same_weights(got, want, drawn: int) -> int:
    """Canonical weights agree on every drawn row and are zero on the rows a layout pads beyond
    them; returns the number of leaves that were padded."""
    padded = 0
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        name = jax.tree_util.keystr(path)
        if w.shape == g.shape:
            np.testing.assert_array_equal(g, w, err_msg=name)
            continue
        axes = [a for a, (m, n) in enumerate(zip(w.shape, g.shape)) if m != n]
        assert len(axes) == 1 and w.shape[axes[0]] == drawn, (name, w.shape, g.shape)
        np.testing.assert_array_equal(np.take(g, np.arange(drawn), axis=axes[0]), w, err_msg=name)
        assert not np.take(g, np.arange(drawn, g.shape[axes[0]]), axis=axes[0]).any(), name
        padded += 1
    return padded


def three_steps(trainer, state):
    out = []
    for step in range(3):
        state, m = trainer.train_step(state, trainer.put_batch(random_batch(step)))
        out.append((float(m["loss"]), float(m["grad_norm"])))
    return np.array(out)


EXACT = os.environ.get("MTJAX_TEST_FAST_CODEGEN") == ""


def in_exact_child(test_id: str) -> None:
    """Runs `test_id` of this file in a child pytest without the suite's fast code generation."""
    env = {**os.environ, "MTJAX_TEST_FAST_CODEGEN": ""}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                            f"{__file__}::{test_id}"], env=env, cwd=os.path.dirname(__file__),
                           capture_output=True, text=True)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_same_seed_same_model_on_every_layout(arch):
    """The initial weights on each layout equal one device's; the vocabulary's padding rows are
    zero. Llama (GQA, untied) at tensor 2 then takes one device's three steps: the same losses
    and gradient norms."""
    if not EXACT:
        return in_exact_child(f"test_same_seed_same_model_on_every_layout[{arch}]")
    one = build(tiny_config(arch), 1, 1, 1)
    one_state = one.init_state()
    a = jax.device_get(one_state.params)
    want = jax.device_get(one.canonical(one_state.params))
    drawn = drawn_vocab_size(VOCAB, one.cfg.model.vocab_multiple)
    for data, pipe, tensor, extra in LAYOUTS[arch]:
        trainer = build(tiny_config(arch, tensor, pipe, data, extra=extra), data, pipe, tensor)
        state = trainer.init_state()
        assert trainer.padded_vocab > drawn          # the layout pads further than one device does
        padded = assert_same_weights(jax.device_get(trainer.canonical(state.params)), want, drawn)
        assert padded == (1 if arch == "gpt" else 2)  # the embedding, and Llama's output layer
        if (arch, data, pipe, tensor) == ("gpt", 2, 2, 2):
            # (moved from test_equivalence.py: test_same_model_on_every_layout)
            # Initialisation draws global shapes from one key: identical parameters whatever the mesh.
            b = jax.device_get(state.params)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                n = min(x.shape[0], y.shape[0])   # the padded vocabulary differs with t
                np.testing.assert_array_equal(x[:n], y[:n])
        if (arch, tensor, pipe) == ("llama", 2, 1):
            np.testing.assert_allclose(three_steps(trainer, state), three_steps(one, one_state), rtol=1e-5)
