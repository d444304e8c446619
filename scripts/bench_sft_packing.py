"""Padding of fine-tuning rows: samples packed several to a row against one sample per row.

    python scripts/bench_sft_packing.py [--seq-len 1024] [--out /tmp/stdlib_functions]

The samples are the Python standard library's functions (the corpus `mtjax.data.corpus` reads,
cut by `ast`): the prompt is a function's `def` line, the response its body. They are written as
JSONL, made into a fine-tuning index (`python -m mtjax.data.preprocess --format sft`, byte
tokenizer) and laid out into rows of s + 1 tokens both ways; the figure in docs/benchmarks.md
("bench_sft_packing") comes from here.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np

from mtjax.data.indexed import IndexedDataset
from mtjax.data.packed_dataset import PackedDataset


def functions(limit: int):
    """(def line, body) of the standard library's functions, in file order, at most `limit`."""
    root = sysconfig.get_paths()["stdlib"]
    for directory, _, names in sorted(os.walk(root)):
        if "site-packages" in directory or "test" in directory.split(os.sep):
            continue
        for name in sorted(n for n in names if n.endswith(".py")):
            try:
                source = open(os.path.join(directory, name), encoding="utf-8").read()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = source.splitlines(keepends=True)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                    head = "".join(lines[node.lineno - 1:node.body[0].lineno - 1])
                    body = "".join(lines[node.body[0].lineno - 1:node.end_lineno])
                    if head and body.strip():
                        yield head, body
                        limit -= 1
                        if limit == 0:
                            return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--out", default="/tmp/stdlib_functions")
    args = parser.parse_args()
    jsonl = args.out + ".jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for prompt, response in functions(args.samples):
            if len(prompt.encode()) >= args.seq_len // 2:     # a signature that long would be refused
                continue
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    for ext in (".bin", ".idx"):
        if os.path.exists(args.out + ext):
            os.remove(args.out + ext)
    subprocess.run([sys.executable, "-m", "mtjax.data.preprocess", "--format", "sft", "--input", jsonl,
                    "--output", args.out, "--seq-len", str(args.seq_len)], check=True)
    indexed = IndexedDataset(args.out)
    packed = PackedDataset(indexed, args.seq_len, 0, indexed.record["eod_id"])
    lengths = indexed.doc_lengths.reshape(-1, 2).sum(axis=1)
    row = args.seq_len + 1
    alone = 1 - lengths.sum() / (len(lengths) * row)
    together = packed.padding / (len(packed) * row)
    print(json.dumps({"samples": len(lengths), "seq_len": args.seq_len, "mean_tokens": float(np.mean(lengths)),
                      "rows_one_per_row": len(lengths), "padding_one_per_row": round(float(alone), 4),
                      "rows_packed": len(packed), "padding_packed": round(float(together), 4)}))


if __name__ == "__main__":
    main()
