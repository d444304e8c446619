"""With pipe > 1 the optimizer state of the parameters every stage holds (embedding, positions,
final norm, untied head) is split over `pipe` (`mtjax/training/zero.py`): the same updates as on
one stage, 1/p of their master weights, moments and main_grad per device."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from layouts import ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config, unpad
from mtjax.hlo_report import memory_report
from mtjax.inspect import compile_train_step, persistent_bytes
from mtjax.mesh import make_mesh
from mtjax.training.trainer import Trainer
from mtjax.training.zero import StateSplit, state_split

is_spec = lambda x: isinstance(x, P)  # noqa: E731


def names(spec) -> list:
    return [a for n in spec for a in ((n,) if isinstance(n, str) else n or ())]


def outside_layers(tree) -> list:
    return jax.tree.leaves({k: v for k, v in tree.items() if k != "layers"}, is_leaf=is_spec)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("dist", [False, True])
def test_state_of_pipe_replicated_leaves_is_split_over_pipe(arch, dist):
    """(2, 2, 2): master weights and both moments of every leaf outside `layers` name `pipe`, with
    `data` beside it on one dimension when distributed; the compute layout keeps them whole over
    `pipe`; the layers' state is split over `pipe` once."""
    cfg = tiny_config(arch, 2, 2, 2, extra=[f"parallel.distributed_optimizer={dist}"])
    trainer = build(cfg, 2, 2, 2)
    specs = trainer.specs
    adam = specs.opt_state[1][0]
    heads = outside_layers(trainer.param_specs)
    assert len(heads) == (4 if arch == "gpt" else 3)   # embedding, positions | head, final norm
    assert all("pipe" not in names(s) for s in heads)
    for tree in (specs.params, adam.mu, adam.nu):
        for spec in outside_layers(tree):
            assert "pipe" in names(spec), spec
            if dist:
                # one dimension split p d ways: (..., 'pipe', 'data')
                assert any(isinstance(n, tuple) and n[-2:] == ("pipe", "data") for n in spec), spec
        for spec in jax.tree.leaves(tree["layers"], is_leaf=is_spec):
            assert names(spec).count("pipe") == 1 and spec[0] == "pipe"
    assert all(("data" in names(s)) == dist for s in outside_layers(specs.params))


def test_leaves_that_do_not_divide_stay_whole():
    """p = d = 2: a leaf whose dimensions p d does not divide takes `pipe` and `data` on separate
    dimensions where each divides, and stays whole over an axis that divides none."""
    mesh = make_mesh(2, 2, 2, jax.devices()[:8])
    shape = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    specs = {"both": P(None), "apart": P(None, None), "pipe_only": P(None), "none": P(None), "layers": P("pipe", None)}
    shapes = {"both": shape(8), "apart": shape(6, 2), "pipe_only": shape(6), "none": shape(3), "layers": shape(2, 6)}
    split = state_split(specs, shapes, mesh, distributed=True)
    assert split.specs == {"both": P(("pipe", "data")), "apart": P("pipe", "data"), "pipe_only": P("pipe"),
                           "none": P(None), "layers": P("pipe", "data")}
    assert split.pipe_dims == {"both": 0, "apart": 0, "pipe_only": 0, "none": None, "layers": None}
    assert split.data_dims == {"both": 0, "apart": 1, "pipe_only": None, "none": None, "layers": 1}


# With and without the distributed optimizer, with and without tensor; the cut (1, 2, gpt, plain)
# was the (2, 2, gpt) case's pipe split without data, the split of the pipe state being the same.
CASES = [  # (data, tensor, arch, distributed optimizer, precision)
    (2, 2, "gpt", True, "fp32"),
    (2, 1, "llama", False, "fp32"),     # no compute copy: the master leaves are gathered in fp32
]


@pytest.mark.parametrize("data,tensor,arch,dist,precision", CASES)
def test_pipe_2_makes_the_updates_of_pipe_1(data, tensor, arch, dist, precision):
    """Two steps (1F1B, m = 4) on pipe = 2 give the master weights and first moments of the same
    config on pipe = 1 (fp32, 1e-5 relative)."""
    runs = {}
    for pipe in (1, 2):
        cfg = tiny_config(arch, tensor, pipe, data, micro_batch=8 // (4 * data), extra=[
            f"parallel.distributed_optimizer={dist}", f"train.precision={precision}", "optim.min_lr=0.001"])
        trainer = build(cfg, data, pipe, tensor)
        state = trainer.init_state()
        for i in range(2):
            state, _ = trainer.train_step(state, trainer.put_batch(random_batch(i)))
        runs[pipe] = jax.device_get(state)
    assert "pipe" in names(state.params["embed"]["embedding"].sharding.spec)
    for tree in (lambda s: s.params, lambda s: s.opt_state[1][0].mu):
        errs = leaf_errors(unpad(tree(runs[2])), unpad(tree(runs[1])), skip=(ZERO_GRADIENT,))
        assert max(errs.values()) < 1e-5, {k: v for k, v in errs.items() if v >= 1e-5}


def without_pipe(spec: P) -> P:
    def drop(n):
        rest = tuple(a for a in ((n,) if isinstance(n, str) else n or ()) if a != "pipe")
        return None if not rest else rest[0] if len(rest) == 1 else rest
    return P(*map(drop, spec))


def pipe_replicated_split(trainer) -> StateSplit:
    """The optimizer state laid out as before: whole over `pipe` outside `layers` (still split
    over `data` with the distributed optimizer), so the pipe-replicated gradients are all-reduced."""
    split = trainer.plan.split
    specs = {k: v if k == "layers" else jax.tree.map(without_pipe, v, is_leaf=is_spec) for k, v in split.specs.items()}
    return StateSplit(specs=specs, pipe_dims=None, data_dims=split.data_dims)


# With the distributed optimizer only (d' = d): plain AdamW is d' = 1 of the same formula, and
# its persistent bytes per parameter are the memory notebook's (d in {1, 2, 8}, both optimizers).
@pytest.mark.parametrize("dist", [True])
def test_persistent_bytes_drop_by_the_pipe_split(dist):
    """(2, 2, 2), bf16: XLA's argument bytes per device drop, against the state whole over `pipe`,
    by exactly (1 - 1/p) x 12/d' x the pipe-replicated leaves' parameters per device (d' = d with
    the distributed optimizer, else 1); and the inspector's formula matches what it measures."""
    d, p, t = 2, 2, 2
    cfg = tiny_config("gpt", t, p, d, micro_batch=1, extra=[
        f"parallel.distributed_optimizer={dist}", "train.precision=bf16"])
    split = build(cfg, d, p, t)
    whole = Trainer(cfg, split.mesh, split.vocab, split=pipe_replicated_split(split))
    assert all("pipe" not in names(s) for s in outside_layers(whole.specs.params))
    got = {name: memory_report(compile_train_step(tr))["argument_bytes"] for name, tr in
           (("split", split), ("whole", whole))}
    shapes = jax.eval_shape(split.init_state).params
    per_device = sum(int(np.prod(a.shape)) // (t if "tensor" in names(s) else 1)
                     for a, s in zip(outside_layers(shapes), outside_layers(split.param_specs)))
    per_parameter = 12 / (d if dist else 1)
    assert got["whole"] - got["split"] == per_device * per_parameter * (1 - 1 / p)

    per = persistent_bytes(split, {"argument_bytes": got["split"]}, shapes)
    assert 0 < per["pipe_split_share"] < 1
    assert abs(per["measured"] - per["expected"]) < 0.01 * per["expected"]     # plus the batch and counters


@pytest.mark.parametrize("sharding", ["parallel.distributed_optimizer=true", "parallel.fsdp=true"])
def test_the_gloo_fallback_scatters_the_same_blocks(monkeypatch, sharding):
    """Where XLA runs collectives through gloo (CPU, several processes) the gradient reduce-scatters
    are an all-to-all and a sum instead (gloo's reduce-scatter is at times wrong, jax-ml/jax#40830;
    tests/test_multihost.py runs it across processes). Forced on in one process, (2, 2, 2) with the
    distributed optimizer, and FSDP's per-layer scatters: one step's new state and metrics (so the
    gradients the optimizer split received) those of psum_scatter, bitwise, and no reduce-scatter
    left. One compile each: the compiled step is both run and read."""
    from mtjax.parallel import gloo
    cfg = tiny_config("gpt", 2, 2, 2, micro_batch=1, extra=[sharding])
    stepped, programs = {}, {}
    for fallback in (False, True):
        monkeypatch.setattr(gloo, "gloo_collectives", lambda: fallback)  # noqa: B023 (read while tracing)
        trainer = build(cfg, 2, 2, 2)
        compiled = compile_train_step(trainer)
        programs[fallback] = compiled.as_text()
        stepped[fallback] = jax.device_get(compiled(trainer.init_state(), trainer.put_batch(random_batch())))
    assert "reduce-scatter(" in programs[False] and "reduce-scatter(" not in programs[True]
    leaves = [jax.tree.leaves(stepped[f]) for f in (True, False)]
    assert len(leaves[0]) == len(leaves[1]) > 0
    for a, b in zip(*leaves):
        np.testing.assert_array_equal(a, b)
