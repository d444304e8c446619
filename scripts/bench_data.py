"""How long a blended loader takes to build its index, and the memory it holds.

    python scripts/bench_data.py [--corpora 10] [--samples 10000000] [--json]

A `BlendedDataset` over K corpora (random weights, seeded) computes Megatron's blending index
(which corpus, and which of its samples, each position reads) for positions [0, N): what a
run resuming at sample N computes before its first step, or a run reads over N samples. The
corpora stand in as tags (the index does not depend on their contents, and each real corpus's
own sample index is GPTDataset's, cached on disk). Reported: the wall time of the build (the
scan's compilation measured apart, on a first chunk), the index's bytes (int16 corpus id and
int64 sample per position, and the capacity reserved), the peak resident memory it added, and
a check that the shares match the weights.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from mtjax.data.blending import CHUNK, BlendedDataset  # noqa: E402


class Tag:
    """Stands for corpus k: sample j is (k, j)."""

    def __init__(self, k: int):
        self.k = k

    def __getitem__(self, j: int) -> tuple[int, int]:
        return self.k, j


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux: KiB


def measure(corpora: int, samples: int, seed: int = 0) -> dict:
    weights = np.random.default_rng(seed).uniform(0.05, 1.0, corpora)
    t0 = time.perf_counter()
    first = BlendedDataset([Tag(k) for k in range(corpora)], weights)
    first.extend_to(CHUNK)                    # compiles the scan for K corpora (once per process)
    compile_s = time.perf_counter() - t0
    rss0 = max_rss_mib()
    blend = BlendedDataset([Tag(k) for k in range(corpora)], weights)
    t0 = time.perf_counter()
    blend.extend_to(samples)
    build_s = time.perf_counter() - t0
    added = max_rss_mib() - rss0
    shares = blend.counts / len(blend)        # over the positions computed (whole chunks)
    return {"corpora": corpora, "samples": samples, "first_chunk_with_compile_s": round(compile_s, 3),
            "build_s": round(build_s, 3), "positions_per_s": round(samples / build_s),
            "index_mib": round((blend.corpus.nbytes + blend.sample.nbytes) / 2**20, 1),
            "reserved_mib": round((blend._corpus.nbytes + blend._sample.nbytes) / 2**20, 1),
            "peak_rss_added_mib": round(added, 1),
            "max_share_error": float(np.max(np.abs(shares - weights / weights.sum()))),
            "last_sample": [int(x) for x in blend[samples - 1]]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", type=int, default=10)
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.corpora, args.samples)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
