"""Will the step fit? XLA's memory estimate of the compiled step against the device's memory.

A step that cannot fit dies in its first execution with an allocator error deep in XLA, after
the data has been opened and the run directory written. The compiled program already knows
what it needs: per device, its arguments (weights, optimizer state, the batch) plus its
outputs (minus those aliased to donated arguments) plus its temporaries (activations kept for
the backward, workspace). A run whose need exceeds the device's memory is refused before it
writes anything, naming both figures.

The device's memory: on an accelerator, the allocator's limit (`memory_stats()['bytes_limit']`);
on the CPU backend every simulated device lives in the one host memory, so the available host
memory (`MemAvailable`) shared by this process's devices.
"""
from __future__ import annotations

import jax

from mtjax.config.errors import ConfigError

GIB = float(1 << 30)


def step_bytes(memory) -> dict:
    """Per-device bytes of a compiled program from its `memory_analysis()`."""
    arguments, outputs = int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes)
    aliased, temporaries = int(memory.alias_size_in_bytes), int(memory.temp_size_in_bytes)
    return {"arguments": arguments, "outputs": outputs - aliased, "temporaries": temporaries,
            "total": arguments + outputs - aliased + temporaries}


def device_bytes() -> tuple[int | None, str]:
    """(bytes one device may use, where the figure comes from); None when unknown."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        available = _host_available()
        share = jax.local_device_count()
        if available is None:
            return None, "unknown host memory"
        return available // share, f"host memory available ({available / GIB:.1f} GiB) shared by {share} CPU devices"
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return (int(limit), f"{device.device_kind} memory limit") if limit else (None, "unknown device memory")


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(compiled) -> int:
    """The bytes per device the compiled step needs by XLA's estimate (`step_bytes`' total);
    ConfigError when that is more than a device has."""
    need = step_bytes(compiled.memory_analysis())
    have, source = device_bytes()
    if have is None or need["total"] <= have:
        return need["total"]
    raise ConfigError("memory", f"the training step needs {need['total'] / GIB:.2f} GiB per device by XLA's "
                                f"estimate (arguments {need['arguments'] / GIB:.2f}, "
                                f"outputs {need['outputs'] / GIB:.2f}, "
                                f"temporaries {need['temporaries'] / GIB:.2f} GiB), more than the {have / GIB:.2f} "
                                f"GiB a device has ({source}); lower model.seq_len, train.micro_batch or the model "
                                f"size, use more devices, or set train.recompute")
