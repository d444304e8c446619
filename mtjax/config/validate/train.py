"""The `train`, `optim` and `checkpoint` groups: precision, recomputation and its offload, the
loss scale, the optimizer's hyperparameters, checkpoint cadence."""
from __future__ import annotations

import math

from mtjax.config.schema import Config, OptimConfig, TrainConfig
from mtjax.config.validate.common import check, no_effect, positive
from mtjax.pipeline.schedules import chunks_per_stage

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full", "block")
ON_NONFINITE = ("stop", "skip")
DECAY_STYLES = ("cosine", "linear", "constant", "inverse_square_root", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def validate_precision(cfg: Config) -> None:
    tr = cfg.train
    check(tr.precision in PRECISIONS, "train.precision",
          f"must be one of {', '.join(PRECISIONS)}, got {tr.precision!r}")


def validate_train(cfg: Config) -> None:
    tr = cfg.train
    validate_precision(cfg)
    check(tr.recompute in RECOMPUTE, "train.recompute", f"must be one of {', '.join(RECOMPUTE)}, got {tr.recompute!r}")
    check(tr.recompute_layers >= 0, "train.recompute_layers", f"must be >= 0, got {tr.recompute_layers}")
    no_effect(tr.recompute == "block" or tr.recompute_layers == 0, "train.recompute_layers",
              f"recompute_layers = {tr.recompute_layers}", "train.recompute=block")
    check(tr.on_nonfinite in ON_NONFINITE, "train.on_nonfinite",
          f"must be one of {', '.join(ON_NONFINITE)}, got {tr.on_nonfinite!r}")
    positive(cfg, ["train.steps", "train.log_interval", "optim.lr"])
    check(tr.eval_interval >= 0, "train.eval_interval", "must be >= 0")
    check(tr.eval_batches >= 1, "train.eval_batches", "must be >= 1")
    check(tr.peak_tflops >= 0, "train.peak_tflops", "must be >= 0")
    _validate_profile(cfg)
    check(math.isfinite(tr.exit_duration_min) and tr.exit_duration_min >= 0, "train.exit_duration_min",
          f"must be a finite number of minutes >= 0 (0: no limit), got {tr.exit_duration_min}")
    check(tr.min_loss_scale > 0, "train.min_loss_scale", "must be positive")
    check(tr.initial_loss_scale >= tr.min_loss_scale, "train.initial_loss_scale", "must be >= train.min_loss_scale")
    check(tr.loss_scale_window >= 1, "train.loss_scale_window", "must be >= 1")
    check(tr.hysteresis >= 1, "train.hysteresis", "must be >= 1")
    check(math.isfinite(tr.loss_scale) and tr.loss_scale >= 0, "train.loss_scale",
          f"must be a finite number >= 0 (0: dynamic scaling), got {tr.loss_scale}")
    for name in ("loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"):
        value = getattr(tr, name)
        no_effect(tr.precision == "fp16" or value == getattr(TrainConfig, name), f"train.{name}",
                  f"{name} = {value}", "train.precision=fp16 (the only precision with a loss scale)")
        no_effect(name == "loss_scale" or not tr.loss_scale or value == getattr(TrainConfig, name), f"train.{name}",
                  f"{name} = {value}", "train.loss_scale=0 (dynamic scaling; a static scale never changes)")
    _validate_optim(cfg)
    ck = cfg.checkpoint
    check(ck.interval >= 0, "checkpoint.interval", "must be >= 0")
    check(ck.keep >= 1, "checkpoint.keep", "must be >= 1")


def _validate_optim(cfg: Config) -> None:
    op = cfg.optim
    check(op.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    check(op.decay_steps >= 0, "optim.decay_steps", "must be >= 0")
    check(0 <= op.lr_warmup_init <= op.lr, "optim.lr_warmup_init",
          f"must be in [0, optim.lr {op.lr}], got {op.lr_warmup_init} (the warm-up rises from it to lr)")
    no_effect(op.warmup_steps > 0 or op.lr_warmup_init == OptimConfig.lr_warmup_init, "optim.lr_warmup_init",
              f"lr_warmup_init = {op.lr_warmup_init}", "a warm-up (optim.warmup_steps > 0) to start")
    _validate_decay(cfg)
    check(op.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    check(op.clip_grad >= 0, "optim.clip_grad", "must be >= 0")
    check(0 <= op.beta1 < 1, "optim.beta1", "must be in [0, 1)")
    check(0 <= op.beta2 < 1, "optim.beta2", "must be in [0, 1)")
    check(0 < op.eps < 1, "optim.eps", f"must be in (0, 1), got {op.eps}")


def _validate_decay(cfg: Config) -> None:
    """optim.decay_style and its fields (`training/lr_schedule.py`). A constant lr reads neither
    min_lr nor the decay length: decay_steps set with it is refused (no effect), min_lr only left
    unchecked, since every file in configs/ sets it."""
    op = cfg.optim
    check(op.decay_style in DECAY_STYLES, "optim.decay_style",
          f"must be one of {', '.join(DECAY_STYLES)}, got {op.decay_style!r}")
    if op.decay_style == "constant":
        no_effect(op.decay_steps == 0, "optim.decay_steps", f"decay_steps = {op.decay_steps}",
                  "a decay_style other than constant")
    else:
        check(0 <= op.min_lr <= op.lr, "optim.min_lr", f"must be in [0, optim.lr], got {op.min_lr}")
    check(op.wsd_decay_style in WSD_DECAY_STYLES, "optim.wsd_decay_style",
          f"must be one of {', '.join(WSD_DECAY_STYLES)}, got {op.wsd_decay_style!r}")
    check(op.wsd_decay_steps >= 0, "optim.wsd_decay_steps", f"must be >= 0, got {op.wsd_decay_steps}")
    for name in ("wsd_decay_steps", "wsd_decay_style"):
        value = getattr(op, name)
        no_effect(op.decay_style == "wsd" or value == getattr(OptimConfig, name), f"optim.{name}",
                  f"{name} = {value}", "optim.decay_style=wsd")
    length = op.decay_steps or cfg.train.steps - op.warmup_steps
    # length <= 0: the run ends inside its warm-up; a resume that raises train.steps checks again
    check(length <= 0 or op.wsd_decay_steps <= length, "optim.wsd_decay_steps",
          f"must be <= the decay's length {length} (optim.decay_steps, or train.steps - warmup_steps when 0), "
          f"got {op.wsd_decay_steps}")


def _host_offload_platform() -> str | None:
    """None if the first device can move saved activations to pinned host memory, else why not.
    XLA:CPU lists a pinned_host memory kind, but its device memory is host memory already and
    its compiler drops the moves, so CPU is refused too."""
    import jax   # here, so that validating other options never starts JAX
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "the CPU backend has no separate host memory to offload to"
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return f"{device.platform} devices here have no pinned_host memory space"
    return None


def validate_recompute(cfg: Config, p: int) -> None:
    """Block recomputation's N within one model chunk; offload where it means something."""
    tr = cfg.train
    if tr.recompute == "block":
        v = chunks_per_stage(cfg.parallel.schedule, cfg.parallel.virtual_stages) if p > 1 else 1
        local = cfg.model.num_layers // (p * v)
        check(1 <= tr.recompute_layers <= local, "train.recompute_layers",
              f"block recomputation needs 1 <= recompute_layers <= {local} (layers per model chunk, "
              f"num_layers/(pipe*{'2 (zbv)' if cfg.parallel.schedule == 'zbv' and p > 1 else 'virtual_stages'})), "
              f"got {tr.recompute_layers}")
    if tr.offload_activations:
        check(tr.recompute != "full", "train.offload_activations",
              "full recomputation saves only each layer's input: nothing to offload")
        why_not = _host_offload_platform()
        check(why_not is None, "train.offload_activations", f"needs host memory on an accelerator: {why_not}")


def _validate_profile(cfg: Config) -> None:
    tr = cfg.train
    check(tr.profile_step_start >= 1, "train.profile_step_start", f"must be >= 1 (steps count from 1), got "
                                                                  f"{tr.profile_step_start}")
    check(tr.profile_step_end > tr.profile_step_start, "train.profile_step_end",
          f"must be > train.profile_step_start = {tr.profile_step_start} (the step after the last traced), "
          f"got {tr.profile_step_end}")
    check(not tr.profile or tr.profile_step_start <= tr.steps, "train.profile_step_start",
          f"{tr.profile_step_start} is past train.steps = {tr.steps}: no step would be traced")
    for name in ("profile_step_start", "profile_step_end"):
        value = getattr(tr, name)
        no_effect(tr.profile or value == getattr(TrainConfig, name), f"train.{name}", f"{name} = {value}",
                  "train.profile=true")
