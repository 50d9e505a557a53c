"""Model-free predictions against end-to-end measurements: `samctl simulate` checked by `samctl bench`.

    python tools/bench/predicted_vs_measured.py --bench ../runs/bench_code --traces ../runs/data/code_edit_refs.jsonl \
        --cost-curve ../runs/smollm2_cpu_curve.json --max-new-tokens 128 [--sam STORE]

1) measured: from the bench's records.jsonl, per category and method, the decode speedup over
   `ar` = ar's decode time / the method's, summed over the category's turns (decode time = a
   turn's time minus its prefill, which both sides pay alike and simulate does not model), and
   the bench's own speedup of total time beside it;
2) predicted: the same questions' reference traces (tools/gen_references.py: the model's own
   greedy output, so a replay takes the engine's steps) replayed through each retrievable method
   in file order, priced with the measured verify-cost curve (`samctl calibrate --json`):
   ar's decode forwards / the method's sum over steps of cost[drafted], plus its drafting time.
`adaptive` replays without its Token Recycle part (it learns from logits), which bench runs.
Prints a Markdown table; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from samctl.decode.drafters.adaptive import AdaptiveConfig  # noqa: E402
from samctl.decode.methods import REPLAYABLE, MethodConfig, make_drafter  # noqa: E402
from samctl.decode.simulate import CostModel, make_trace, replay  # noqa: E402
from samctl.index.load import load_datastore  # noqa: E402
from samctl.bench_report import report_category  # noqa: E402
from samctl.costs import read_cost_curve  # noqa: E402


REPLAY_CONFIG = MethodConfig(adaptive=AdaptiveConfig(recycle=False))


def measured(records_path: Path) -> tuple[dict, dict, set]:
    """-> ({(category, method): decode speedup}, {(category, method): total-time speedup}, question ids)"""
    decode_s: dict = defaultdict(float)
    total_s: dict = defaultdict(float)
    questions = set()
    for line in records_path.read_text().splitlines():
        r = json.loads(line)
        questions.add(r["question_id"])
        category = report_category(r["category"])
        for turn in r["turns"]:
            m = turn.get("metrics") or {}
            prefill = m.get("prefill_s", 0.0)  # hf-* runners have no split: their total counts
            decode_s[category, r["method"]] += turn["time_s"] - prefill
            total_s[category, r["method"]] += turn["time_s"]
    speedup = {k: decode_s[k[0], "ar"] / v for k, v in decode_s.items() if v > 0}
    total = {k: total_s[k[0], "ar"] / v for k, v in total_s.items() if v > 0}
    return speedup, total, questions


def predicted(traces_path: Path, questions: set, methods: list[str], cost: CostModel, store,
              max_new: int) -> dict:
    rows = [json.loads(line) for line in traces_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["question_id"] in questions]
    traces = [make_trace(r["prompt_ids"], r["output_ids"], (), max_new, category=report_category(r["category"]))
              for r in rows]
    curve = cost.curve()
    out = {}
    for method in methods:
        drafter = make_drafter(method, vocab_size=0, device="cpu", static=store, cost=curve, config=REPLAY_CONFIG)
        forwards, priced = defaultdict(float), defaultdict(float)
        for trace in traces:
            m = replay(drafter, trace)
            forwards[trace.category] += m.new_tokens - 1
            priced[trace.category] += float(np.sum(curve[np.asarray(m.step_drafted, dtype=np.int64)]))
            priced[trace.category] += m.draft_s / (cost.forward_ms / 1e3)
        for category in forwards:
            out[category, method] = forwards[category] / priced[category] if priced[category] else 1.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=Path, required=True, help="a samctl bench --out folder")
    ap.add_argument("--traces", type=Path, required=True, help="tools/gen_references.py output for its questions")
    ap.add_argument("--cost-curve", type=Path, required=True, help="samctl calibrate --json output")
    ap.add_argument("--max-new-tokens", type=int, required=True, help="as the bench ran")
    ap.add_argument("--sam", default=None, help="the store the bench ran with")
    args = ap.parse_args()
    speedup, total, questions = measured(args.bench / "records.jsonl")
    methods = sorted({m for _, m in speedup if m in REPLAYABLE and m != "ar"})
    store = load_datastore(args.sam).structure if args.sam else None
    cost = CostModel.from_curve(read_cost_curve(args.cost_curve))
    guess = predicted(args.traces, questions, methods, cost, store, args.max_new_tokens)
    print("| category | method | predicted decode speedup | measured decode speedup | predicted / measured "
          "| measured total-time speedup |")
    print("|---|---|---:|---:|---:|---:|")
    for (category, method), value in sorted(guess.items()):
        got = speedup.get((category, method))
        if got is None:
            continue
        print(f"| {category} | {method} | {value:.2f}x | {got:.2f}x | {value / got:.2f} | {total[category, method]:.2f}x |")


if __name__ == "__main__":
    main()
