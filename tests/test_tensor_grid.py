"""2D and 2.5D tensor parallelism (`parallel.tensor_grid`) compute what one device computes.

Against tests/reference.py in fp32 (rtol 1e-5): logits (and a prefix's), the loss, every
gradient leaf and one AdamW step, for GPT (tied head, MHA, GeLU, LayerNorm) and Llama (untied
head, GQA k = 2, SwiGLU, RMSNorm, RoPE), on 2d t = 4 (q = 2) and 2.5d t = 8 (q = 2, d = 2),
alone (2.5d with full recomputation), 2d with pipe = 2 on the split backward's zb
(whose W runs `grid_ops.linear_dA` on each block's kept X and dY), and 2.5d with data = 2 and the
distributed optimizer and with pipe = 2 on 1F1B, which needs 16 devices and runs in a subprocess
that simulates them. Dropout draws the 1D rule's masks:
a grid with dropout computes what t = 1 does with the same key. A checkpoint travels 1d -> 2d ->
2.5d -> 1d; generation refuses a grid.
"""
import jax
import pytest

import reference
from layouts import VOCAB, ZERO_GRADIENT, build, leaf_errors, random_batch, tiny_config
from test_equivalence import TOL, assert_prefix_logits, assert_step_matches, relative

# 2d alone (logits and a prefix too), 2d x pipe on the split backward (zb: W's `grid_ops.linear_dA`
# on each block's kept X and dY, the grid's only pipelined path that 1F1B does not run), 2.5d with
# full recomputation. Cut: GPT alone (GPT's grid blocks: the dropout test and the 16-device test),
# 2.5d with selective recomputation (the grid's saved set under selective: test_activation_memory),
# 2d x data + distributed optimizer and 2d x pipe on 1F1B (both in the 16-device test below, at
# 2.5d), 2d x interleaved and zbv (the run order of the layer stack, grid-independent:
# tests/test_pipeline.py, tests/test_zero_bubble_executor.py).
GRID_LAYOUTS = [  # (arch, grid, depth, data, pipe, extra)
    ("llama", "2d", 1, 1, 1, []),
    ("llama", "2d", 1, 1, 2, ["parallel.schedule=zb"]),            # the split backward: W on the grid
    ("llama", "2.5d", 2, 1, 1, ["train.recompute=full"]),
]


def grid_config(arch, grid, depth, data, pipe, extra=(), micro_batch=2):
    tensor = 4 * depth
    return tiny_config(arch, tensor, pipe, data, micro_batch=micro_batch,
                       extra=[f"parallel.tensor_grid={grid}", f"parallel.tensor_depth={depth}", *extra])


@pytest.mark.parametrize("arch,grid,depth,data,pipe,extra", GRID_LAYOUTS)
def test_grid_matches_reference(arch, grid, depth, data, pipe, extra):
    cfg = grid_config(arch, grid, depth, data, pipe, extra, micro_batch=2 * depth)
    trainer = build(cfg, data, pipe, cfg.parallel.tensor)
    state = trainer.init_state()
    batch = random_batch()
    params = jax.device_get(trainer.canonical(state.params))     # interleaved: stored in run order

    if pipe == 1:   # the logits through pipeline stages are refused on a grid
        logits = trainer.logits_fn(state.params, trainer.put_batch(batch[:, :-1]))
        assert relative(logits, reference.logits(params, batch[:, :-1], cfg.model, VOCAB)) < TOL
        assert_prefix_logits(trainer, state.params, batch, logits)

    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    skip = (ZERO_GRADIENT,) if arch == "gpt" else ()
    assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads, skip=skip)


def test_grid_parameters_live_in_blocks():
    """A kernel's block is [in/q, out/q] on (ROW, COL); the embedding's [V/q, h/q]; a bias [n/q]."""
    cfg = grid_config("llama", "2d", 1, 1, 1)
    trainer = build(cfg, 1, 1, 4)
    p = trainer.init_state().params
    q, h = 2, cfg.model.hidden_size
    assert p["layers"]["attn"]["q"]["kernel"].addressable_shards[0].data.shape == (
        2, h // q, cfg.model.num_heads // q, cfg.model.head_dim)
    assert p["layers"]["mlp"]["fc2"]["kernel"].addressable_shards[0].data.shape == (2, cfg.model.ffn_size // q, h // q)
    assert p["embed"]["embedding"].addressable_shards[0].data.shape == (trainer.padded_vocab // q, h // q)
    assert p["layers"]["ln_attn"]["scale"].addressable_shards[0].data.shape == (2, h // q)
    assert trainer.mesh.axis_names == ("data", "pipe", "tensor_depth", "tensor_row", "tensor_col")


def test_grid_dropout_draws_the_1d_masks():
    """With dropout, 2.5d t = 8 gives the loss and gradients that t = 1 gives with the same key."""
    extra = ["model.dropout=0.2"]
    one = build(tiny_config("gpt", micro_batch=4, extra=extra), 1, 1, 1)
    grid = build(grid_config("gpt", "2.5d", 2, 1, 1, extra, micro_batch=4), 1, 1, 8)
    state, batch = one.init_state(), random_batch()
    rng = jax.device_get(state.rng)
    g1, l1 = one.grad_fn(state.params, one.put_batch(batch), rng)
    gs = grid.init_state()
    g2, l2 = grid.grad_fn(gs.params, grid.put_batch(batch), rng)
    assert abs(float(l1) - float(l2)) < TOL * float(l1)
    _, other = one.grad_fn(state.params, one.put_batch(batch), jax.device_get(jax.random.key_data(jax.random.key(7))))
    assert abs(float(l1) - float(other)) > 1e-3      # the masks depend on the key: dropout is on
    g1, g2 = jax.device_get(g1), jax.device_get(g2)
    g1 = {**g1, "embed": {"embedding": g1["embed"]["embedding"][:VOCAB]}}
    g2 = {**g2, "embed": {"embedding": g2["embed"]["embedding"][:VOCAB]}}
    errs = leaf_errors(g2, g1, skip=(ZERO_GRADIENT,))
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}


def test_checkpoint_round_trip_1d_25d_1d(tmp_path):
    """Two steps on 1d t = 1, saved; restored and two more on 2.5d t = 8 (a 2 x 2 grid of depth
    2: the 2d grid's layout and its batch split), saved; restored on 1d: the per-step losses
    (dropout on) and the final weights equal an uninterrupted 1d run's at 1e-5 (checkpoints are
    in the canonical, global layout)."""
    from test_checkpoint import Ckpt, config, losses, run, vocab_rows

    grids = {"1d": (1, []), "2.5d": (8, ["parallel.tensor_grid=2.5d", "parallel.tensor_depth=2"])}

    def cfg_of(tmp, steps, grid):
        t, extra = grids[grid]
        # the schedule's decay length fixed: by default it follows train.steps, which each segment sets
        return config(tmp, steps, 1, 1, t, ["train.micro_batch=4", "optim.decay_steps=4", *extra])

    whole = cfg_of(tmp_path / "whole", 4, "1d")
    straight_trainer = build(whole, 1, 1, 1)
    ck = Ckpt(whole)
    straight = losses(run(whole, straight_trainer, checkpointer=ck).rows)
    ck.close()
    final = Ckpt(whole).restore(4, straight_trainer)

    chained, state = {}, None
    for steps, grid, start in ((2, "1d", 0), (4, "2.5d", 2)):
        cfg = cfg_of(tmp_path / "chain", steps, grid)
        trainer = build(cfg, 1, 1, cfg.parallel.tensor)
        ck = Ckpt(cfg)
        state = None if not start else ck.restore(start, trainer)
        chained.update(losses(run(cfg, trainer, state, ck).rows))
        ck.close()
    for k in straight:
        assert abs(chained[k] - straight[k]) <= 1e-5 * straight[k], (k, chained[k], straight[k])
    back = Ckpt(cfg_of(tmp_path / "chain", 4, "1d")).restore(4, straight_trainer)
    got, expected = (vocab_rows(jax.device_get(s.params), VOCAB) for s in (back, final))
    errs = leaf_errors(got, expected, skip=(ZERO_GRADIENT,))   # rounding noise that Adam normalises
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}


def test_generation_refuses_a_grid_in_one_line():
    """Decoding runs on 1d (a grid's checkpoint is canonical and loads there): asking for a grid
    is a ConfigError naming the field (the CLI's one line, exit 2)."""
    from mtjax.config.errors import ConfigError
    from mtjax.inference.model import parallel_overrides
    with pytest.raises(ConfigError) as e:
        parallel_overrides(["parallel.tensor=4", "parallel.tensor_grid=2d"])
    assert e.value.key == "parallel.tensor_grid" and "1d" in str(e.value)


SIXTEEN = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from mtjax.mesh import simulate_cpu_devices
simulate_cpu_devices(16)
import jax
import reference
from layouts import VOCAB, ZERO_GRADIENT, build, random_batch
from test_equivalence import assert_step_matches
from test_tensor_grid import grid_config
out = {}
for arch, data, pipe, extra in (("gpt", 2, 1, ["parallel.distributed_optimizer=true"]),
                                ("llama", 1, 2, ["parallel.schedule=1f1b"])):
    cfg = grid_config(arch, "2.5d", 2, data, pipe, extra, micro_batch=4)
    trainer = build(cfg, data, pipe, 8)
    state, batch = trainer.init_state(), random_batch()
    params = jax.device_get(state.params)
    ref_loss, ref_grads = jax.value_and_grad(reference.loss)(params, batch, cfg.model, VOCAB)
    # asserts the loss, every applied gradient and the step (TOL); a failure is the child's status
    _, metrics = assert_step_matches(trainer, cfg, state, batch, params, ref_loss, ref_grads,
                                     skip=(ZERO_GRADIENT,) if arch == "gpt" else ())
    out[arch] = [abs(float(metrics["loss"]) - float(ref_loss)) / float(ref_loss)]
print(json.dumps(out))
'''


def test_25d_with_data_zero_and_pipe_on_16_devices():
    """2.5d t = 8 with data = 2 and the distributed optimizer (GPT), and with pipe = 2 on 1F1B
    (Llama): loss, every gradient and one step against the reference, in a subprocess that
    simulates 16 CPU devices."""
    import json
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    from test_cli import child_env
    env = child_env()                      # the 16 devices: simulate_cpu_devices in the child
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SIXTEEN, tests], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(errors) == {"gpt", "llama"}
    for arch, errs in errors.items():
        assert max(errs) < TOL, (arch, errs)
