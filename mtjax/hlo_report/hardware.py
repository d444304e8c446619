"""The constants of the GPU performance model (`gpu_model.py`), one record per target, each with
its source. Nothing here is fitted to one case: the launch cost and the sustained rates below are
the only free numbers, and the calibration test (`tests/test_gpu_model.py`) holds the model to
every measured step at once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float           # dense bf16 FLOP/s of the datasheet: the MFU denominator
    matmul_flops: float         # sustained dense bf16 GEMM FLOP/s (a large, square matmul)
    attention_flops: float      # sustained bf16 FLOP/s of a fused (flash) attention kernel
    memory_bandwidth: float     # sustained HBM bytes/s (reads + writes) of a streaming kernel
    alu_ops: float              # 32-bit floating-point instructions/s on the CUDA cores (FMA = 1)
    int_op_cost: float          # issue cost of a 32-bit integer op, in fp32 instructions
    special_op_cost: float      # issue cost of a transcendental (exp, log, tanh, rsqrt, ...)
    launch_s: float             # time a kernel costs beyond its work: launch, ramp-up and tail
    loop_iteration_s: float     # a while loop's per-iteration cost beyond its kernels
    nvlink_bandwidth: float     # bytes/s each GPU sends over NVLink, one direction
    network_bandwidth: float    # bytes/s each GPU sends between nodes (InfiniBand)
    host_bandwidth: float       # bytes/s between a GPU and pinned host memory (PCIe)
    collective_latency_s: float  # fixed cost of one collective (ring set-up, synchronisation)
    gpus_per_node: int          # devices that share one NVLink domain


H100 = GpuSpec(
    name="h100",
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1979 with sparsity).
    peak_flops=989e12,
    # Measured on an H100 SXM5 (docs/benchmarks.md, "GPU: H100"): jitted 8192^3 bf16 matmul,
    # median of 10 blocks of 20 calls: 738.5 TFLOP/s.
    matmul_flops=738.5e12,
    # Shah et al., "FlashAttention-3" (2024), Fig. 5-7: cuDNN 9 and FA3 reach 450-600 TFLOP/s
    # forward and 350-500 backward in bf16 at head dim 64-128 and s = 1k-2k; 450 sits between.
    attention_flops=450e12,
    # 3.35 TB/s HBM3 datasheet peak; streaming kernels (copy, elementwise) sustain about 90% of it
    # (NVIDIA's nvbandwidth / BabelStream figures on H100 SXM: 2.9-3.1 TB/s).
    memory_bandwidth=3.0e12,
    # 132 SMs x 128 FP32 lanes x 1.98 GHz boost = 33.5e12 instructions/s (H100 whitepaper, Table 3).
    alu_ops=33.5e12,
    # Hopper SM per clock: 64 INT32 vs 128 FP32 lanes, 16 SFU (transcendental) results
    # (CUDA C Programming Guide, "Arithmetic Instructions", compute capability 9.0).
    int_op_cost=2.0,
    special_op_cost=8.0,
    # A few microseconds per kernel: CUDA launch latency within XLA's command buffers (CUDA graphs)
    # is about 1-2 us, plus the ramp-up and tail of a kernel that does not fill 132 SMs. The one
    # constant that the measurements of docs/benchmarks.md calibrate (the tiny model's step is
    # almost all launches); held to every measured case at once by tests/test_gpu_model.py.
    launch_s=2.0e-6,
    # XLA:GPU's WhileThunk evaluates the condition on the device and copies the predicate to the
    # host each iteration (a device-to-host sync, about 10 us).
    loop_iteration_s=10e-6,
    # NVLink 4: 900 GB/s bidirectional per H100 SXM, 450 GB/s each way; NCCL's ring bus bandwidth
    # on 8 H100s reaches about 360-370 GB/s (nccl-tests all_reduce_perf).
    nvlink_bandwidth=360e9,
    # ConnectX-7 NDR: 400 Gb/s = 50 GB/s per GPU, about 45 GB/s achieved.
    network_bandwidth=45e9,
    # PCIe Gen5 x16: 64 GB/s each way, about 50 GB/s achieved to pinned memory.
    host_bandwidth=50e9,
    # NCCL's small-message all-reduce latency on one NVLink node: about 10-20 us.
    collective_latency_s=10e-6,
    gpus_per_node=8,
)

# An H200 is an H100's compute (the same 132 SMs and clocks; a bf16 8192^3 matmul ran at 769-798
# TFLOP/s on this workplace's H200s) with HBM3e: 4.8 TB/s datasheet, 4.3 TB/s sustained by a
# device-to-device copy on those machines. Only the bandwidth differs from the H100 record. The
# calibration cases measured on an H200 (tests/fixtures/h100/cases.json, "gpu": "h200") are
# predicted with it. Not a compile target (`compile_only` describes an H100 only).
H200 = replace(H100, name="h200", memory_bandwidth=4.3e12)

TARGETS = {"h100": H100}
MEASURED_GPUS = {"h100": H100, "h200": H200}
