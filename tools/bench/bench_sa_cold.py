"""Drafting cost per step from a store, replayed with the caches as a model's forward leaves them.

    python tools/bench/bench_sa_cold.py --store out/big/smol.sa --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf \
        --method sam --traces 10 --flush-mb 96

Between two drafting calls `generate` runs a forward that streams the model's weights (540 MB for
SmolLM2 in float32), so every drafting call starts with cold caches: its code, Python's and numba's
dispatch state and the store's pages. This replays `--method` over held-out code (each file's
first half as the prompt, the next 256 tokens as the output; /usr/lib/python3/dist-packages, as
bench_corpus.py) with a fresh drafter per trace, reads a --flush-mb buffer before each propose and
each observe (0: warm caches), and reports the drafting time per step (propose + observe, median,
p90, mean) and the time in each call of the store's cursor (peek, draft, advance, tree), so a
change to the cursor or its kernels can be told apart from the drafter around it. `--store none`
gives the drafter's own cost, without a store.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from samctl.decode.methods import MethodConfig, make_drafter
from samctl.decode.simulate import replay
from samctl.index import cursor as cursors
from samctl.index.load import load_datastore
from samctl.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_corpus import held_out_traces  # noqa: E402  (the same held-out traces)

CALLS = ("peek", "draft", "advance", "tree")


def timed_cursor_calls(cls: type) -> dict[str, list[float]]:
    """Wrap the cursor class's calls; -> {call: [seconds]} filled as they run."""
    spent: dict[str, list[float]] = {name: [] for name in CALLS}
    for name in CALLS:
        call = getattr(cls, name)

        def wrapped(*args, _call=call, _times=spent[name], **kwargs):
            tic = time.perf_counter()
            result = _call(*args, **kwargs)
            _times.append(time.perf_counter() - tic)
            return result
        setattr(cls, name, wrapped)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="a store path, or none")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--method", default="sam")
    parser.add_argument("--traces", type=int, default=10)
    parser.add_argument("--flush-mb", type=int, default=96, help="buffer read before each drafting call (0: warm)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    static = None if args.store == "none" else load_datastore(args.store).structure
    flush = np.ones(args.flush_mb << 20, dtype=np.uint8)
    spent = timed_cursor_calls(type(cursors.cursor(static))) if static is not None else {}
    steps: list[float] = []

    def fresh():
        drafter = make_drafter(args.method, vocab_size=tokenizer.vocab_size, device=torch.device("cpu"),
                               eos_token_ids=tuple(tokenizer.eos_token_ids), static=static, config=MethodConfig())
        propose, observe = drafter.propose, drafter.observe

        def timed_propose(t0):
            flush.sum()
            tic = time.perf_counter()
            tree = propose(t0)
            steps.append(time.perf_counter() - tic)
            return tree

        def timed_observe(*a, **k):
            flush.sum()
            tic = time.perf_counter()
            observe(*a, **k)
            steps[-1] += time.perf_counter() - tic
        drafter.propose, drafter.observe = timed_propose, timed_observe
        return drafter

    held_out = held_out_traces(tokenizer, args.traces)
    for _ in range(2):  # the first round compiles and maps the store's pages
        steps.clear()
        for times in spent.values():
            times.clear()
        tokens = sum(replay(fresh(), trace).to_dict()["new_tokens"] for trace in held_out)
    us = np.array(steps) * 1e6
    print(f"{args.store} {args.method}, {len(held_out)} traces, flush {args.flush_mb} MB: {len(us)} steps, "
          f"{tokens / len(us):.2f} tokens/step, µs/step median {np.median(us):.1f} p90 {np.percentile(us, 90):.1f} "
          f"mean {us.mean():.1f}", file=sys.stdout)
    for name, times in spent.items():
        if times:
            t = np.array(times) * 1e6
            print(f"  {name}: {len(t) / len(us):.2f} calls/step, µs median {np.median(t):.1f} p90 "
                  f"{np.percentile(t, 90):.1f}, per step {t.sum() / len(us):.1f}")


if __name__ == "__main__":
    main()
