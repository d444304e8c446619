"""Load a to-hf output with transformers and compute its logits: run by tests/test_convert.py under
a Python that has transformers and torch (MTJAX_HF_PYTHON), never imported by the tests.

    python tests/hf_load.py HF_DIR IO.safetensors [HF_DIR IO.safetensors ...]

Each IO.safetensors holds `input_ids` [b, s]; the script adds `logits` [b, s, V] (fp32, eager
attention) of the model in the HF_DIR before it. Several pairs share one start of torch and
transformers. It exits 1, printing what transformers reported, unless from_pretrained found every
weight it expects and no other (missing, unexpected or mismatched keys, or a warning from
transformers' logger) for every HF_DIR.
"""
import logging
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file


def main(hf_dir: str, io_path: str) -> int:
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    transformers.logging.set_verbosity_warning()
    transformers.logging.get_logger().addHandler(Collect(level=logging.WARNING))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v}
    if problems or messages:
        print(f"loading {hf_dir}: {problems} {messages}", file=sys.stderr)
        return 1
    io = load_file(io_path)
    with torch.no_grad():
        logits = model.eval()(input_ids=io["input_ids"].long()).logits.float()
    save_file({**io, "logits": logits.contiguous()}, io_path)
    print(f"{type(model).__name__} {transformers.__version__}")
    return 0


if __name__ == "__main__":
    pairs = sys.argv[1:]
    sys.exit(max(main(hf_dir, io_path) for hf_dir, io_path in zip(pairs[::2], pairs[1::2])))
