"""The (data, pipe, context, tensor) device mesh and per-axis rank/size (Megatron's parallel_state).

No module-level state: outside `shard_map` sizes come from the Mesh object,
inside it ranks come from `lax.axis_index`.
"""
from __future__ import annotations

import os

import numpy as np

DATA, PIPE, CONTEXT, TENSOR = "data", "pipe", "context", "tensor"
AXES = (DATA, PIPE, CONTEXT, TENSOR)


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for `n` host devices; must run before JAX initialises its backend. Once it has
    (a notebook that ran JAX already), a backend with n CPU devices passes (a cell run again), and
    any other count is a RuntimeError: the backend keeps its devices, and a run would go on with
    them in silence."""
    before = os.environ.get("XLA_FLAGS")
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = [f for f in (before or "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
    import jax  # noqa: PLC0415  (imported late on purpose: the flag must be set first)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except AttributeError:
        pass  # older JAX reads XLA_FLAGS
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have == n:
            return
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before
        raise RuntimeError(f"simulate_cpu_devices({n}): JAX has already started with {have} CPU device"
                           f"{'s' if have != 1 else ''}; call it before anything uses JAX (in a notebook, "
                           f"restart the kernel first)") from None


def make_mesh(data: int = -1, pipe: int = 1, tensor: int = 1, devices=None, context: int = 1):
    """A Mesh over AXES; one size may be -1 to take the remaining devices.

    Devices are laid out with `tensor` fastest, so tensor groups are
    neighbouring devices (on GPUs: the same NVLink island), then `context` (Megatron's order
    tp-cp-dp-pp: a context ring stays within a node where it fits), then `pipe`, then `data`.
    A `context` axis of size 1 names no device group: no program mentions it (every
    collective over it is emitted only when c > 1), so c = 1 compiles as a 3-axis mesh did.
    By default they are all global devices grouped by process, so with several
    processes each one holds whole `data` ranks where its device count allows
    (and so feeds whole rows of the batch; see Trainer.local_rows).
    """
    import jax
    from jax.sharding import AxisType, Mesh

    if devices is None:  # a stable sort: keeps JAX's order within a process
        devices = sorted(jax.devices(), key=lambda dev: dev.process_index)
    devices = list(devices)
    sizes = [data, pipe, context, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not a multiple of {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {tuple(sizes)} needs {int(np.prod(sizes))} devices, have {len(devices)}")
    grid = np.array(devices, dtype=object).reshape(sizes)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_sizes(mesh) -> dict[str, int]:
    """{'data': d, 'pipe': p, 'context': c, 'tensor': t}; t of a grid mesh (`parallel/grid.py`) is
    its sub-axes' product; c is 1 on a mesh without a `context` axis (the grid's)."""
    sizes = dict(mesh.shape)
    sizes.setdefault(CONTEXT, 1)
    if TENSOR not in sizes:
        sizes[TENSOR] = int(np.prod([n for a, n in sizes.items() if a.startswith(TENSOR + "_")]))
    return {name: int(sizes[name]) for name in AXES}


def device_coords(mesh, device) -> dict[str, int]:
    """The rank of `device` along each of `mesh`'s axes, by name."""
    flat = list(mesh.devices.flat)
    idx = np.unravel_index(flat.index(device), mesh.devices.shape)
    return dict(zip(mesh.axis_names, (int(i) for i in idx)))


def axis_rank(name: str):
    """This device's rank along mesh axis `name`; only inside shard_map."""
    from jax import lax
    return lax.axis_index(name)
