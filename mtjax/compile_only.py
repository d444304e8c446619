"""Compiling for GPUs that are not here: XLA:GPU's deviceless (ahead-of-time) compilation.

With JAX's CUDA plugin installed (`pip install jax-cuda12-plugin jax-cuda12-pjrt
nvidia-cuda-nvcc-cu12`, and `nvidia-cudnn-cu12` for cuDNN attention), XLA:GPU can compile
for GPUs described by a target config instead of live devices. The compiled program, its
buffer assignment and `memory_analysis()` are then XLA:GPU's own for that GPU; only running
it needs the hardware. This is how the pipeline's memory and copies across several GPUs are
checked on a machine with none (`scripts/bench_gpu_compile.py`).

Two things must hold before JAX starts (`prepare_environment`): the plugin must not look
for a CUDA runtime (JAX_SKIP_CUDA_CONSTRAINTS_CHECK), and JAX's default platform stays the
CPU (JAX_PLATFORMS=cpu), so that the only GPUs are the compile-only ones made here.
"""
from __future__ import annotations

import importlib.util
import os

# An H100 SXM5 80 GB as XLA:GPU's GpuTargetConfig describes a device: NVIDIA's published
# figures (132 SMs at 1.98 GHz boost, 3.35 TB/s HBM3, 50 MB L2, 228 KB shared memory per SM,
# compute capability 9.0) and the CUDA 12 / cuDNN 9 that JAX's plugin is built against.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version { major: 12 minor: 8 }
dnn_version_info { major: 9 minor: 8 }
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""
TARGETS = {"h100": H100}


def why_unavailable() -> str | None:
    """None if JAX's CUDA plugin is installed, else what is missing (nothing is imported)."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return ("JAX's CUDA plugin is not installed (pip install -e '.[gpu-compile]'; "
                "docs/guide/inspect.md, \"Compile-only GPU targets\")")
    return None


def prepare_environment() -> None:
    """Keep JAX on the CPU and let the CUDA plugin load without a GPU; before JAX starts."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def gpu_devices(count: int, target: str = "h100") -> list:
    """`count` compile-only GPUs of one host, as XLA:GPU's `target` sees them (a Mesh takes them;
    `jit(...).lower(...).compile()` compiles for them; nothing can run on them)."""
    from jax.experimental.topologies import get_topology_desc
    topology = get_topology_desc("mtjax", "cuda", target_config=TARGETS[target], topology=f"1x1x{count}")
    return list(topology.devices)
