"""What N shards cost per decode step: a store's documents split into 1, 2, 4, 8 shards, and the
static-store work of one SAM-Decoding step replayed over reference answers.

A step, as `sam` and `adaptive` do it with a sharded store: peek at t0 in every shard (longest
match, no mutation), then advance every shard's pointer over the committed token. One kernel
call each, over all shards. The single-store rows do the same on one SuffixAutomaton (step +
walk), the code path of an unsharded store. Every variant's match lengths are checked equal
(the longest over the shards is the single store's match). The variants are interleaved in
one process, `--rounds` times; the median per variant is reported.

    python tools/bench/bench_shards.py --store /work/runs/ray/py25m_1.samd --traces /work/runs/ray/py100m.jsonl \
        --max-tokens 6000000

The store and the trace use the byte-level tokenizer; the trace is the text of the last records
of --traces (JSONL, field `text`), which should not be in the store (held-out text).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from samctl.index.automaton import SuffixAutomaton  # noqa: E402
from samctl.index.load import load_datastore  # noqa: E402
from samctl.index.sharded import ShardedAutomaton, plan_shards  # noqa: E402


def documents(sam: SuffixAutomaton, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The store's first whole documents, up to max_tokens: (tokens [n] int32, offsets [d+1] int64)."""
    buf = np.asarray(sam.tokens)
    ends = np.flatnonzero(buf < 0)
    starts = np.concatenate(([0], ends[:-1] + 1))
    offsets = np.concatenate(([0], np.cumsum(ends - starts))).astype(np.int64)
    keep = max(1, int(np.searchsorted(offsets, max_tokens, side="right")) - 1)
    tokens = buf[buf >= 0].astype(np.int32)[:offsets[keep]]
    return tokens, offsets[:keep + 1]


def split(tokens: np.ndarray, offsets: np.ndarray, n: int) -> ShardedAutomaton:
    """The documents built as n shards (contiguous whole documents)."""
    bounds = plan_shards(offsets, n)
    return ShardedAutomaton([SuffixAutomaton.build(tokens[offsets[lo]:offsets[hi]], offsets[lo:hi + 1] - offsets[lo])
                             for lo, hi in zip(bounds[:-1], bounds[1:])])


def replay_single(sam: SuffixAutomaton, trace: np.ndarray) -> tuple[float, int]:
    state, length, total = 0, 0, 0
    tic = time.perf_counter()
    for i in range(len(trace)):
        total += sam.step(state, length, int(trace[i]))[1]  # peek
        state, length = sam.walk(state, length, trace[i:i + 1])
    return time.perf_counter() - tic, total


def replay_sharded(sharded: ShardedAutomaton, trace: np.ndarray) -> tuple[float, int]:
    states, lengths = sharded.pointer()
    total = 0
    tic = time.perf_counter()
    for i in range(len(trace)):
        total += sharded.peek(states, lengths, int(trace[i]))[2]
        sharded.walk(states, lengths, trace[i:i + 1])
    return time.perf_counter() - tic, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="a single-shard store (.sam or a 1-shard .samd)")
    parser.add_argument("--traces", required=True, help="JSONL with a `text` field; its last records are replayed")
    parser.add_argument("--shards", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200_000, help="tokens replayed")
    parser.add_argument("--max-tokens", type=int, default=6_000_000,
                        help="the store's first documents up to this many tokens (every variant holds them all)")
    args = parser.parse_args()

    store = load_datastore(args.store)
    whole = store.sam if not isinstance(store.sam, ShardedAutomaton) else store.sam.shards[0]
    tokens, offsets = documents(whole, args.max_tokens)
    del store, whole  # every variant below is built from these tokens
    sam = SuffixAutomaton.build(tokens, offsets)
    lines = Path(args.traces).read_text().splitlines()
    texts: list[bytes] = []
    while lines and sum(map(len, texts)) < args.steps:
        texts.append(json.loads(lines.pop())["text"].encode("utf-8"))
    trace = np.frombuffer(b"".join(texts)[:args.steps], dtype=np.uint8).astype(np.int32)  # bytes tokenizer ids
    counts = [int(n) for n in args.shards.split(",")]
    variants = {"single store": lambda: replay_single(sam, trace)}
    for n in counts:
        sharded = split(tokens, offsets, n)
        variants[f"{n} shard(s)"] = (lambda s=sharded: replay_sharded(s, trace))
    for run in variants.values():  # compile and fault the pages in
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    checks: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, run in variants.items():
            seconds, total = run()
            times[name].append(seconds / len(trace) * 1e6)
            checks[name] = total
    assert len(set(checks.values())) == 1, f"match lengths differ between variants: {checks}"
    print(f"store {args.store}: {sam.num_tokens:,} tokens; trace {len(trace):,} steps; median of {args.rounds} "
          f"interleaved rounds; mean match length {checks['single store'] / len(trace):.2f}")
    print("| variant | µs per step (peek t0 + advance) | range |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")


if __name__ == "__main__":
    main()
