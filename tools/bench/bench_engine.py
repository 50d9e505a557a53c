"""Engine overhead curve: what the decode loop costs beyond the target's forwards.

    python tools/bench/bench_engine.py --model /work/runs/smollm2 --threads 1

1) the target's greedy continuation of a prompt (HF model.generate, also timed: the baseline);
2) `ar` through samctl's loop, same tokens, tokens/s against HF;
3) verify cost t(n): one forward of n chain tokens at the mid-generation context, n = 1..64;
4) the `oracle` drafter at depth k = 1, 2, 4, 8, ...: every draft is accepted, so each step makes
   k + 1 tokens; tokens/s against the ideal (k + 1) / t(k + 1), and host overhead per step
   (step wall time minus the time inside the model's forward).
Prints Markdown tables. Numbers are for the machine it runs on; nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from samctl.decode.drafters.base import NoDraft  # noqa: E402
from samctl.decode.engine.kv_cache import with_cache  # noqa: E402
from samctl.decode.drafters.oracle import OracleDrafter  # noqa: E402
from samctl.decode.loop import GenerationConfig, generate  # noqa: E402
from samctl.models import load_engine  # noqa: E402

PROMPT = (
    "Summarize the following passage in two sentences.\n\n"
    "The committee met on Tuesday to review the budget for the coming year. After a long debate "
    "about the cost of repairs to the old bridge, the members agreed to postpone the new library "
    "until the spring, and to ask the city for a loan to cover the repairs. The mayor said the "
    "decision was hard but necessary, since the bridge carries most of the traffic into town.\n\nSummary:"
)


class ForwardTimer:
    """Sums the wall time spent inside the model's forward (CPU: synchronous, so exact)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self._start = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def hf_generate(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    tic = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist(), time.perf_counter() - tic


def verify_cost(target, prompt: list[int], context: int, widths: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one chain forward of n tokens after `context` cached tokens."""
    ids = torch.tensor(prompt[:1] * context)
    target.prefill(ids, reserve=context + max(widths))
    costs = {}
    with torch.inference_mode():
        for n in widths:
            tokens = torch.tensor(prompt[:n] if len(prompt) >= n else prompt[:1] * n)[None]
            positions = torch.arange(context, context + n)[None]
            times = []
            for _ in range(repeats):
                tic = time.perf_counter()
                target.model(input_ids=tokens, position_ids=positions, **with_cache(target.model, target.cache), use_cache=True)
                times.append(time.perf_counter() - tic)
                target.cache.set_length(context)
            costs[n] = statistics.median(times)
    return costs


def timed_runs(target, drafter, prompt, n: int, repeats: int):
    best = None
    timer = ForwardTimer(target.model)
    for _ in range(repeats):
        timer.total = 0.0
        result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=n))
        run = (result, timer.total)
        if best is None or result.metrics.time_s < best[0].metrics.time_s:
            best = run
    timer.remove()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--depths", default="1,2,4,8,16")
    parser.add_argument("--widths", default="1,2,3,4,5,6,8,9,12,16,17,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(args.model, "cpu", "float32")
    target, n = engine.target, args.new_tokens
    prompt = engine.encode(PROMPT, chat=False)

    hf_runs = [hf_generate(engine.model, prompt, n) for _ in range(args.repeats)]
    reference = hf_runs[0][0]
    hf_s = min(t for _, t in hf_runs)
    ar, ar_forward = timed_runs(target, NoDraft(), prompt, n, args.repeats)
    assert ar.tokens == reference, "ar through the loop differs from model.generate in float32"
    print(f"model {args.model}, prompt {len(prompt)} tokens, {n} new tokens, threads {args.threads}\n")
    print("| decoder | tok/s | vs HF generate | host overhead / step |\n|---|---|---|---|")
    print(f"| HF generate | {n / hf_s:.1f} | 1.00x | |")
    print(f"| samctl ar | {ar.metrics.tokens_per_s:.1f} | {ar.metrics.tokens_per_s * hf_s / n:.3f}x | "
          f"{_overhead(ar.metrics, ar_forward) * 1e6:.0f} µs |")

    widths = [int(w) for w in args.widths.split(",")]
    depths = [int(k) for k in args.depths.split(",")]
    widths = sorted(set(widths) | {k + 1 for k in depths} | {1})
    cost = verify_cost(target, prompt, len(prompt) + n // 2, widths, max(5, args.repeats))
    print("\n| n | t(n) ms | t(n)/t(1) |\n|---|---|---|")
    for w in widths:
        print(f"| {w} | {cost[w] * 1e3:.2f} | {cost[w] / cost[1]:.2f} |")

    print("\n| k drafted | tokens/step | tok/s | ideal (k+1)/t(k+1) | ratio | speedup vs ar | "
          "ideal (k+1)t(1)/t(k+1) | host overhead / step |\n|---|---|---|---|---|---|---|---|")
    for k in depths:
        result, forward = timed_runs(target, OracleDrafter(np.asarray(reference), k), prompt, n, args.repeats)
        assert result.tokens == reference, f"oracle k={k} output differs"
        m = result.metrics
        decode_s = m.time_s - m.prefill_s
        rate = m.new_tokens / m.time_s
        steady = (m.new_tokens - 1) / decode_s  # the prefill's token is not a step's
        ideal = (k + 1) / cost[k + 1]
        overhead = _overhead(m, forward)
        print(f"| {k} | {m.mean_accepted:.2f} | {rate:.1f} (steady {steady:.1f}) | {ideal:.1f} | "
              f"{steady / ideal:.2f} | {m.tokens_per_s / ar.metrics.tokens_per_s:.2f}x | "
              f"{(k + 1) * cost[1] / cost[k + 1]:.2f}x | {overhead * 1e6:.0f} µs |")


def _overhead(metrics, forward_s: float) -> float:
    # Seconds per step outside the model's forwards. forward_s includes the prefill forward, and
    # prefill_s is that forward plus the first choice (a few µs), so it cancels it.
    return (metrics.time_s - metrics.prefill_s - (forward_s - metrics.prefill_s)) / metrics.steps


if __name__ == "__main__":
    main()
