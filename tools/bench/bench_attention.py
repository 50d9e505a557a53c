"""Time of one layer of the int8 path's exact attention (`attend_rows`) alone: a tree chain of q
rows after `prefix` keys, SmolLM2's shapes by default (9 query heads, 3 KV heads, head size 64),
median of --rounds x 100 calls (thread time). The A/B of an attention change, run once per
checkout and interleaved:

    PYTHONPATH=<git archive of a commit> python tools/bench/bench_attention.py --shapes 256x1,256x8,1024x1,1024x8
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from samctl.decode.engine.attention import attend_rows


def case(prefix: int, rows: int, heads: int, kv_heads: int, dim: int, rng: np.random.Generator) -> tuple:
    # row i of the chain sees the prefix and the chain's first i + 1 keys, as a verify's mask says
    capacity = prefix + rows
    query = rng.standard_normal((1, heads, rows, dim), dtype=np.float32)
    key, value = rng.standard_normal((2, 1, kv_heads, capacity, dim), dtype=np.float32)
    index = np.broadcast_to(np.arange(capacity, dtype=np.int64), (1, rows, capacity)).copy()
    counts = (prefix + 1 + np.arange(rows, dtype=np.int64))[None]
    out = np.empty((1, rows, heads, dim), dtype=np.float32)
    return query, key, value, index, counts, np.float32(dim ** -0.5), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x1,256x8,1024x1,1024x8", help="prefix x rows, comma separated")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    report = []
    for shape in args.shapes.split(","):
        prefix, rows = map(int, shape.split("x"))
        call = case(prefix, rows, args.heads, args.kv_heads, args.dim, rng)
        attend_rows(*call)
        times = []
        for _ in range(args.rounds):
            tic = time.thread_time()
            for _ in range(100):
                attend_rows(*call)
            times.append((time.thread_time() - tic) / 100)
        report.append(f"{prefix} keys x {rows} rows {1e6 * np.median(times):.1f} us")
    print("attend_rows, one layer: " + ", ".join(report))


if __name__ == "__main__":
    main()
