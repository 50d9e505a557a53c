"""Time of one verify forward of an int8 (or float32) native model at 1, 2, 4 and 8 rows after a
context, fastest of --rounds: the A/B of a forward change, run once per checkout and interleaved.

    PYTHONPATH=<git archive of a commit> python tools/bench/bench_verify_forward.py \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf --context 256 --quantize int8 --threads 1

With --pairs N it times N one-row and eight-row verifies in turn instead (thread time, the first
ten pairs left out) and prints the median of each and the median of the pairs' ratios t(8)/t(1):
on a shared machine whose speed drifts, each ratio is of two neighbouring verifies.

A verify's time depends on how many entries it attends to, not on what they hold: one token is
prefilled and the row is then taken to hold `--context` entries (as decode.engine.cost does).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.target import room
from samctl.decode.tree import DraftTree
from samctl.models import load_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--quantize", default="int8", choices=("none", "int8"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pairs", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(args.model, "cpu", "auto", quantize=args.quantize)
    target = BatchedTarget(engine.model, 1, room(args.context, 64))
    target.prefill([0], [np.array([1])], [False])
    vocab = int(engine.model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    times = []

    def verify(width: int, clock=time.perf_counter) -> float:
        target.lengths[:] = 0
        target.lengths[:1] = args.context
        inputs = [torch.randint(0, vocab, (width,), generator=generator)]
        tic = clock()
        target.verify(inputs, [DraftTree.chain(np.zeros(width - 1, dtype=np.int64))])
        return clock() - tic

    with torch.inference_mode():
        if args.pairs:
            pairs = np.array([[verify(w, time.thread_time) for w in (1, 8)] for _ in range(args.pairs + 10)])[10:]
            one, eight = np.median(pairs, axis=0) * 1e3
            print(f"context {args.context}, {args.quantize}, {args.threads} thread(s), {args.pairs} pairs: "
                  f"t(1) = {one:.2f} ms, t(8) = {eight:.2f} ms (medians), t(8)/t(1) = "
                  f"{np.median(pairs[:, 1] / pairs[:, 0]):.2f} (median of the pairs)")
            return
        for width in (1, 2, 4, 8):
            best = min(verify(width) for _ in range(args.rounds))
            times.append(f"t({width}) = {1e3 * best:.2f} ms")
    print(f"context {args.context}, {args.quantize}, {args.threads} thread(s): " + ", ".join(times))


if __name__ == "__main__":
    main()
