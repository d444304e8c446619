"""`model.attention`: which kernel each platform gets, and cuDNN's flash attention in the GPU program.

The gradients of `dot_product` against the reference (GQA, tensor and sequence parallelism,
selective recomputation) are in test_equivalence.py's OPTIONS.
"""
import re
import types

import jax
import jax.numpy as jnp
import pytest

from layouts import build
from mtjax.config import ConfigError, load_config, validate
from mtjax.model.core_attention import resolve_attention

BF16, FP32 = jnp.bfloat16, jnp.float32


def device(platform="gpu", capability="9.0"):
    fake = types.SimpleNamespace(platform=platform)
    if capability is not None:
        fake.compute_capability = capability
    return fake


@pytest.mark.parametrize("choice,dev,dtype,d,dropout,kernel", [
    ("auto", device("cpu", None), BF16, 64, 0.0, "xla"),
    ("dot_product", device("cpu", None), FP32, 64, 0.0, "dot_product"),
    ("auto", device(), BF16, 128, 0.0, "cudnn"),
    ("auto", device(), BF16, 256, 0.0, "cudnn"),          # Hopper: d up to 256
    ("auto", device(capability="8.0"), BF16, 256, 0.0, "xla"),   # Ampere: up to 128
    ("auto", device(capability="8.6"), jnp.float16, 64, 0.0, "cudnn"),
    ("auto", device(capability="7.0"), BF16, 64, 0.0, "xla"),    # Volta: no flash attention
    ("auto", device(), FP32, 64, 0.0, "xla"),             # cuDNN's kernel is 16-bit only
    ("dot_product", device(), FP32, 64, 0.0, "dot_product"),
    ("auto", device(), BF16, 12, 0.0, "xla"),             # d not a multiple of 8
    ("auto", device(), BF16, 64, 0.1, "xla"),             # attention dropout
    ("auto", device(capability=None), BF16, 64, 0.0, "xla"),     # a GPU without a CUDA capability
    ("xla", device(), BF16, 64, 0.0, "xla"),
])
def test_resolve_attention(choice, dev, dtype, d, dropout, kernel):
    assert resolve_attention(choice, dev, dtype, d, dropout) == kernel


def test_dot_product_refuses_attention_dropout_and_unknown_names():
    with pytest.raises(ConfigError, match="model.attention: dot_product has no attention dropout"):
        validate(load_config(None, ["model.attention=dot_product", "model.attention_dropout=0.1"]), 1)
    with pytest.raises(ConfigError, match="model.attention: must be one of auto, xla, dot_product"):
        validate(load_config(None, ["model.attention=flash"]), 1)


S = 128      # no other tensor of the model has two dimensions of 128


def gpu_program(monkeypatch, attention: str, recompute: str = "none") -> str:
    """The bf16 train step of a small Llama (GQA, t = 2) lowered for a CUDA GPU on this CPU
    machine, with the kernel `attention` resolves to there. JAX checks cuDNN's version and the
    GPU's compute capability while tracing its cuDNN path: both are stood in for (an H100)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    from mtjax.inspect import abstract_state
    from mtjax import layout as layout_lib
    from mtjax.training.step import batch_sharding
    for name, value in (("check_cudnn_version", lambda: 91000), ("check_compute_capability", lambda c: True),
                        ("is_cuda_compute_capability_equal", lambda c: False)):
        if not hasattr(cudnn, name):
            pytest.skip(f"this jax's cuDNN attention has no {name} to stand in for")
        monkeypatch.setattr(cudnn, name, value)
    gpu = device()
    monkeypatch.setattr(layout_lib, "resolve_attention",
                        lambda choice, _, *args: resolve_attention(choice, gpu, *args))
    cfg = load_config(None, [
        "model.arch=llama", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
        "model.num_kv_heads=2", f"model.seq_len={S}", f"model.attention={attention}", "parallel.tensor=2",
        "parallel.data=1", "train.global_batch=2", "train.micro_batch=2", "train.precision=bf16",
        f"train.recompute={recompute}"])
    validate(cfg, 2)
    trainer = build(cfg, 1, 1, 2)
    batch = jax.ShapeDtypeStruct((2, S + 1), jnp.int32, sharding=batch_sharding(trainer.mesh))
    checks = [jax.export.DisabledSafetyCheck.custom_call(f"__cudnn$fmhaSoftmax{suffix}") for suffix in ("", "Backward")]
    exported = jax.export.export(trainer.train_step, platforms=["cuda"], disabled_checks=checks)(
        abstract_state(trainer), batch)
    return trainer.plan.attention, exported.mlir_module()


def square_fp32(text: str) -> list[str]:
    """Tensor types in the module with two trailing dimensions of S in fp32 (the scores, the
    probabilities)."""
    return re.findall(rf"tensor<(?:\d+x)*{S}x{S}xf32>", text)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_dot_product_is_cudnn_flash_attention_on_gpu(monkeypatch, recompute):
    """model.attention=dot_product: the GPU program calls cuDNN's fused attention forward and
    backward, and holds no s x s fp32 tensor; the einsum kernel (xla) holds them, and calls no
    cuDNN attention. Selective recomputation runs cuDNN's forward again in the backward."""
    kernel, fused = gpu_program(monkeypatch, "dot_product", recompute)
    assert kernel == "cudnn"
    forward, backward = fused.count("custom_call @__cudnn$fmhaSoftmax("), fused.count("custom_call @__cudnn$fmhaSoftmaxBackward(")
    assert forward >= 1 and backward >= 1, (forward, backward)
    assert not square_fp32(fused)
    kernel, einsum = gpu_program(monkeypatch, "xla", recompute)
    assert kernel == "xla" and "__cudnn$fmha" not in einsum and square_fp32(einsum)
