"""`python -m mtjax.inspect`'s `--target` and `--gpus`: the step compiled for GPUs that are not
here (`mtjax.compile_only`)."""
from __future__ import annotations

from mtjax import cli
from mtjax.config.errors import ConfigError

MAX_GPUS = 4096     # compile-only GPUs of one topology (--gpus, or the layout's product)


def check_target_options(args) -> None:
    """`--gpus` counts the target's GPUs: it needs `--target` and a count in [1, MAX_GPUS]; and
    `--target` takes no `--cpu-devices` (checked before `--print-config` prints, as before a compile)."""
    if args.target is not None and args.cpu_devices is not None:
        raise ConfigError("--cpu-devices", "cannot be combined with --target (the devices are the target's GPUs)")
    if args.gpus is not None and (args.target is None or not 1 <= args.gpus <= MAX_GPUS):
        problem = "needs --target" if args.target is None else f"must be in [1, {MAX_GPUS}], got {args.gpus}"
        raise ConfigError("--gpus", problem)


def target_setup(args):
    """(Config, mesh over compile-only GPUs) for `--target`: the CUDA plugin is set up before JAX
    starts, and validation counts the target's GPUs, not this machine's devices."""
    from mtjax import compile_only
    missing = compile_only.why_unavailable()
    if missing is not None:
        raise ConfigError("--target", missing)
    compile_only.prepare_environment()
    from mtjax.config import load_config, validate
    from mtjax.mesh import make_mesh
    cfg = load_config(cli.config_path(args), args.overrides)
    par = cfg.parallel
    gpus = args.gpus or max(par.data, 1) * par.pipe * par.context * par.tensor
    if gpus > MAX_GPUS:        # the layout's own product, --gpus not given
        raise ConfigError("parallel", f"data*pipe*context*tensor = {gpus} GPUs: --target compiles for at most "
                                      f"{MAX_GPUS}")
    d, p, t = validate(cfg, gpus)
    return cfg, make_mesh(d, p, t, devices=compile_only.gpu_devices(gpus, args.target), context=par.context)

