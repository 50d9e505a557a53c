"""Time of one verify forward of an int8 (or float32) native model at 1, 2, 4 and 8 rows after a
context, fastest of --rounds: the A/B of a forward change, run once per checkout and interleaved.

    PYTHONPATH=<git archive of a commit> python tools/bench/bench_verify_forward.py \\
        --model SmolLM2-135M-Instruct.Q4_1.gguf --context 256 --quantize int8 --threads 1

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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(args.model, "cpu", "auto", quantize=args.quantize)
    target = BatchedTarget(engine.model, 1, room(args.context, 64))
    target.prefill([0], [np.array([1])], [False])
    vocab = int(engine.model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        for width in (1, 2, 4, 8):
            best = float("inf")
            for _ in range(args.rounds):
                target.lengths[:] = 0
                target.lengths[:1] = args.context
                inputs = [torch.randint(0, vocab, (width,), generator=generator)]
                tic = time.perf_counter()
                target.verify(inputs, [DraftTree.chain(np.zeros(width - 1, dtype=np.int64))])
                best = min(best, time.perf_counter() - tic)
            times.append(f"t({width}) = {1e3 * best:.2f} ms")
    print(f"context {args.context}, {args.quantize}, {args.threads} thread(s): " + ", ".join(times))


if __name__ == "__main__":
    main()
