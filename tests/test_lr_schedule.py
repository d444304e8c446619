"""optim.decay_style: the lr at chosen steps of each style against Megatron's rules written out
here in plain Python (`megatron_lr`, in Megatron's own terms: an absolute decay end, the warm-up
taking n <= W, rising from its init_lr, optim.lr_warmup_init), and a few values worked by hand;
lr_warmup_init 0 bit for bit the ramp from 0; the refusals; one short run whose logged lr
follows a wsd schedule.

Only the run compiles (one 1-layer model on one device, four steps).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtjax.config import ConfigError, load_config, validate
from mtjax.training.lr_schedule import learning_rate
from mtjax.training.optimizer import make_optimizer

TOP, FLOOR, WARMUP, DECAY = 1.0, 0.1, 4, 10      # the decay ends at D = 14; train.steps 20 runs past it
STEPS = [0, 1, 2, 4, 5, 7, 9, 10, 12, 13, 14, 15, 19]
COMMON = [f"optim.lr={TOP}", f"optim.min_lr={FLOOR}", f"optim.warmup_steps={WARMUP}",
          f"optim.decay_steps={DECAY}", "train.steps=20"]


def megatron_lr(n, style, warmup, end, top, floor, wsd_steps=0, wsd_style=None, init=0.0):
    """Megatron's OptimizerParamScheduler.get_lr restated: `end` is its lr_decay_steps, the step
    the decay ends at, warm-up included; `init` its init_lr (--lr-warmup-init)."""
    if warmup > 0 and n <= warmup:
        return init + (top - init) * n / warmup
    if style == "constant":
        return top
    if n > end:
        return floor
    if style == "inverse_square_root":
        return max(floor, top * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    ratio = (n - warmup) / (end - warmup)
    if style == "linear":
        coeff = 1 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1)
    else:   # wsd
        anneal = end - wsd_steps
        if n <= anneal:
            coeff = 1.0
        else:
            q = (n - anneal) / wsd_steps
            coeff = {"linear": 1 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1),
                     "exponential": 2 * 0.5 ** q - 1, "minus_sqrt": 1 - math.sqrt(q)}[wsd_style]
    return floor + coeff * (top - floor)


def lrs(overrides, steps=STEPS):
    cfg = load_config(None, [*COMMON, *overrides])
    validate(cfg, 1)
    schedule = learning_rate(cfg)
    return [float(x) for x in np.asarray(schedule(jnp.asarray(steps, jnp.int32)))]


STYLES = [("cosine", 0, None), ("linear", 0, None), ("constant", 0, None), ("inverse_square_root", 0, None),
          *[("wsd", 4, shape) for shape in ("linear", "cosine", "exponential", "minus_sqrt")],
          ("wsd", 0, "exponential"), ("wsd", DECAY, "cosine")]


@pytest.mark.parametrize("style,wsd_steps,wsd_style", STYLES, ids=[f"{s}-{n}-{w}" for s, n, w in STYLES])
def test_each_style_is_megatrons_rule(style, wsd_steps, wsd_style):
    """Warm-up (0, 1, 2), its end (4), the decay (5 to 13), its end (14), past it (15, 19)."""
    overrides = [f"optim.decay_style={style}"]
    if style == "wsd":
        overrides += [f"optim.wsd_decay_steps={wsd_steps}", f"optim.wsd_decay_style={wsd_style}"]
    if style == "constant":
        overrides += ["optim.decay_steps=0"]    # a constant lr has no decay to size
    want = [megatron_lr(n, style, WARMUP, WARMUP + DECAY, TOP, FLOOR, wsd_steps, wsd_style) for n in STEPS]
    assert lrs(overrides) == pytest.approx(want, rel=2e-6, abs=1e-7)


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "inverse_square_root", "wsd"])
def test_the_warm_up_starts_at_lr_warmup_init(style):
    """optim.lr_warmup_init = 0.2: the ramp 0.2, 0.4, 0.6, 0.8 (n = 0..3) joins lr_max at W = 4, then
    the style's own curve, unchanged: Megatron's get_lr with init_lr 0.2."""
    overrides = [f"optim.decay_style={style}", "optim.lr_warmup_init=0.2"]
    overrides += ["optim.decay_steps=0"] if style == "constant" else []
    overrides += ["optim.wsd_decay_steps=4", "optim.wsd_decay_style=linear"] if style == "wsd" else []
    want = [megatron_lr(n, style, WARMUP, WARMUP + DECAY, TOP, FLOOR, 4, "linear", init=0.2) for n in STEPS]
    assert want[:3] == pytest.approx([0.2, 0.4, 0.6])
    assert lrs(overrides) == pytest.approx(want, rel=2e-6, abs=1e-7)


def test_lr_warmup_init_zero_is_the_old_ramp_bit_for_bit():
    """The default 0 keeps every schedule's values bit for bit: optax's cosine with init_value 0.0,
    and the other styles' old ramp lr * n / W on float32 n, as XLA computes it (lr 3e-4, W 7: no
    value exact by luck)."""
    common = ["optim.lr=3e-4", "optim.min_lr=3e-5", "optim.warmup_steps=7", "optim.decay_steps=20"]
    steps = list(range(0, 30))
    cosine = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=3e-4, warmup_steps=7, decay_steps=27,
                                                end_value=3e-5)
    assert lrs([*common, "optim.lr_warmup_init=0"], steps) == [float(cosine(n)) for n in steps]
    got = lrs([*common, "optim.decay_style=linear"], steps[:7])
    assert got == [float(x) for x in np.asarray(3e-4 * jnp.arange(7, dtype=jnp.float32) / 7)]


@pytest.mark.parametrize("overrides,steps,want", [
    # linear: r = (n - 4) / 10
    (["optim.decay_style=linear"], [2, 9, 14, 15], [0.5, 0.55, 0.1, 0.1]),
    # lr * sqrt(4 / n): 1 at the warm-up's end, 0.5 at 16; floored at 0.1 (n > 400); past D = 14: 0.1
    (["optim.decay_style=inverse_square_root", "optim.decay_steps=1000"], [4, 16, 100, 400, 500, 1005],
     [1.0, 0.5, 0.2, 0.1, 0.1, 0.1]),
    (["optim.decay_style=inverse_square_root"], [9, 15], [2 / 3, 0.1]),
    # wsd: lr held to A = 14 - 4 = 10, then q = (n - 10) / 4
    (["optim.decay_style=wsd", "optim.wsd_decay_steps=4", "optim.wsd_decay_style=linear"], [10, 12, 14],
     [1.0, 0.55, 0.1]),
    (["optim.decay_style=wsd", "optim.wsd_decay_steps=4", "optim.wsd_decay_style=minus_sqrt"], [11, 13],
     [0.55, 0.1 + 0.9 * (1 - math.sqrt(0.75))]),
    (["optim.decay_style=wsd", "optim.wsd_decay_steps=4", "optim.wsd_decay_style=exponential"], [12],
     [0.1 + 0.9 * (math.sqrt(2) - 1)]),
    (["optim.decay_style=constant", "optim.decay_steps=0"], [2, 4, 100], [0.5, 1.0, 1.0]),
], ids=["linear", "isr-long", "isr-short", "wsd-linear", "wsd-minus_sqrt", "wsd-exponential", "constant"])
def test_values_worked_by_hand(overrides, steps, want):
    assert lrs(overrides, steps) == pytest.approx(want, rel=2e-6)


def test_no_warm_up_and_the_decay_from_train_steps():
    """W = 0: step 0 is at the peak; decay_steps 0 takes train.steps - W = 20."""
    got = lrs(["optim.warmup_steps=0", "optim.decay_steps=0", "optim.decay_style=linear"], [0, 10, 20])
    assert got == pytest.approx([1.0, 0.55, 0.1])
    isr = lrs(["optim.warmup_steps=0", "optim.decay_steps=0", "optim.decay_style=inverse_square_root"], [0, 1, 4])
    assert isr == pytest.approx([1.0, 1.0, 0.5])


def test_the_optimizer_state_is_the_same_whatever_the_style():
    """A resume may change the schedule: every style leaves the same state structure."""
    params = {"w": jnp.zeros((2,)), "bias": jnp.zeros((2,))}
    trees = [jax.tree.structure(make_optimizer(load_config(None, [*COMMON, *o])).init(params)) for o in
             ([], ["optim.decay_style=linear"], ["optim.decay_style=wsd", "optim.wsd_decay_steps=3"])]
    assert trees[0] == trees[1] == trees[2]


@pytest.mark.parametrize("overrides,key,words", [
    (["optim.decay_style=step"], "optim.decay_style", "must be one of cosine, linear, constant"),
    (["optim.decay_style=wsd", "optim.wsd_decay_style=square"], "optim.wsd_decay_style", "must be one of"),
    (["optim.decay_style=wsd", "optim.wsd_decay_steps=-1"], "optim.wsd_decay_steps", "must be >= 0"),
    (["optim.decay_style=wsd", "optim.wsd_decay_steps=11"], "optim.wsd_decay_steps", "decay's length 10"),
    (["optim.decay_style=wsd", "optim.decay_steps=0", "optim.wsd_decay_steps=17"], "optim.wsd_decay_steps",
     "decay's length 16"),
    (["optim.wsd_decay_steps=2"], "optim.wsd_decay_steps", "needs optim.decay_style=wsd"),
    (["optim.decay_style=linear", "optim.wsd_decay_style=cosine"], "optim.wsd_decay_style",
     "needs optim.decay_style=wsd"),
    (["optim.decay_style=constant"], "optim.decay_steps", "no effect"),
    (["optim.decay_style=linear", "optim.min_lr=2"], "optim.min_lr", "must be in [0, optim.lr]"),
    (["optim.lr_warmup_init=-0.1"], "optim.lr_warmup_init", "must be in [0, optim.lr 1.0]"),
    (["optim.lr_warmup_init=1.5"], "optim.lr_warmup_init", "must be in [0, optim.lr 1.0]"),
    (["optim.lr_warmup_init=0.1", "optim.warmup_steps=0"], "optim.lr_warmup_init", "no effect"),
])
def test_bad_schedules_are_one_line_naming_the_field(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*COMMON, *overrides]), 1)
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_what_validates():
    """wsd_decay_steps up to the decay's length; a run ending inside its warm-up is not held to it
    (its decay length comes with the train.steps of the run that continues it); a constant lr
    ignores min_lr, which every file in configs/ sets, even above lr."""
    for overrides in (["optim.decay_style=wsd", "optim.wsd_decay_steps=10"],
                      ["optim.decay_style=wsd", "optim.decay_steps=0", "train.steps=3", "optim.wsd_decay_steps=50"],
                      ["optim.decay_style=constant", "optim.decay_steps=0", "optim.min_lr=5"]):
        validate(load_config(None, [*COMMON, *overrides]), 1)


def test_a_short_run_logs_the_wsd_lr(tmp_path):
    """Four logged steps of a 1-layer model under wsd (W = 1, D = 4, final phase 2 steps, linear):
    the lr of step k is the schedule at k - 1 steps applied: 0, 1, 1, 0.5 + 0.5 * 0.5."""
    from test_train import run
    overrides = ["train.steps=4", "train.log_interval=1", "train.eval_interval=0", "checkpoint.enabled=false",
                 "model.num_layers=1", "model.hidden_size=32", "model.seq_len=32", "train.global_batch=2",
                 "train.micro_batch=2", "optim.lr=1.0", "optim.min_lr=0.5", "optim.warmup_steps=1",
                 "optim.decay_style=wsd", "optim.wsd_decay_steps=2", "optim.wsd_decay_style=linear"]
    rows = run(tmp_path / "run", str(tmp_path / "cache"), overrides)
    want = [megatron_lr(n, "wsd", 1, 4, 1.0, 0.5, 2, "linear") for n in range(4)]
    assert want == [0.0, 1.0, 1.0, 0.75]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-6)
