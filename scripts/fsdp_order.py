"""`python scripts/fsdp_order.py [K=V ...]`: FSDP's prefetch in the compiled H100 program.

Compiles the train step for 8 H100s (compile-only, `mtjax.inspect`'s `--target h100` set-up) and
prints, for every while-loop body that all-gathers, the order of its all-gather starts and
dones, reduce-scatter starts and dones, and matmul (gemm / cuDNN attention) kernels, as XLA's
schedule leaves them: a gather issued before the layer's matmuls and done after them is the
prefetch of the next layer (`mtjax/model/fsdp_scan.py`). Needs JAX's CUDA plugin on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = (("all-gather-start", "AG>"), ("all-gather-done", "AG<"), ("reduce-scatter-start", "RS>"),
         ("reduce-scatter-done", "RS<"), ("custom-call", "attn"), ("fusion", "gemm"))


def loop_orders(text: str) -> dict[str, list[str]]:
    """{computation name: [event, ...]} for the computations that hold an all-gather start."""
    out, name, events = {}, None, []
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name, events = head.group(1), []
            continue
        if line.startswith("}") and name:
            if any(e == "AG>" for e in events):
                out[name] = events
            name = None
            continue
        for op, tag in KINDS:
            if f" {op}(" in line or f"= {op}" in line or re.search(rf"\b{op}\(", line):
                if tag == "gemm" and "gemm" not in line and "__cublas" not in line:
                    break
                if tag == "attn" and "dot_product_attention" not in line and "cudnn" not in line:
                    break
                events.append(tag)
                break
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from mtjax.inspect import compile_train_step
    from mtjax.inspect_target import target_setup
    ns = argparse.Namespace(cpu_devices=None, config=None, overrides=args.overrides, gpus=8, target="h100")
    cfg, mesh = target_setup(ns)
    from mtjax.training.data_setup import resolve_vocab, tokenizer_vocab
    from mtjax.training.trainer import Trainer
    trainer = Trainer(cfg, mesh, resolve_vocab(cfg, tokenizer_vocab(cfg)))
    for name, events in loop_orders(compile_train_step(trainer).as_text()).items():
        print(f"{name}: {' '.join(events)}")


if __name__ == "__main__":
    main()
