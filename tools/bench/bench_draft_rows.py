"""Draft-model methods in the batched engine: one run of --method over --records at --batch-size,
timed in this process's CPU seconds, for A/B runs of two checkouts (PYTHONPATH) on one machine.

The batched budget spends by a verify-cost curve; one measured apart per checkout would make the
two runs draft different widths (a curve is keyed by the checkout's path and engine code). So the
curve comes from a file both runs read (--cost; written by `--write-cost` once), and with it the
runs verify the same trees: tokens per row-step and outputs are equal when the drafting is.
Default model: the embedded target and its embedded draft (no download).

    python tools/bench/bench_draft_rows.py --write-cost /tmp/cost8.npy --batch-size 8
    for v in old new; do PYTHONPATH=/tmp/$v python tools/bench/bench_draft_rows.py --method sd \\
        --records prompts.jsonl --batch-size 8 --cost /tmp/cost8.npy --json $v.json; done
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from samctl.decode.engine.cost import measure_batch_cost
from samctl.decode.loop import BatchStats, GenerationConfig, generate_batch
from samctl.session import Session, SessionConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="sd")
    ap.add_argument("--model", default=None, help="default: the embedded target")
    ap.add_argument("--draft-model", default=None, help="default: the embedded draft (with the embedded target)")
    ap.add_argument("--records", help="JSONL with a prompt field")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cost", help="the batch's cost curve (.npy, t_ms over 1.. total inputs)")
    ap.add_argument("--write-cost", help="measure the curve at --batch-size, write it here and stop")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = SessionConfig(model=args.model, draft_model=args.draft_model, method=args.method,
                           max_new_tokens=args.max_new_tokens, threads=1, quiet=True)
    session = Session(config)
    if args.write_cost:
        np.save(args.write_cost, measure_batch_cost(session.engine.model, args.batch_size, 8))
        return
    prompts = [session.encode(json.loads(line)["prompt"]) for line in open(args.records) if line.strip()]
    cost = np.load(args.cost)
    # batch 1 drafts with the session's kept drafter (row 0 of the draft's batch), as `generate` does
    make = (lambda: session.drafter) if args.batch_size == 1 else session.fresh_drafter
    generate_batch(session.engine.model, make, prompts[:2], GenerationConfig(max_new_tokens=8), 2, cost=cost)  # warm-up
    stats = BatchStats()
    tic, cpu = time.perf_counter(), time.process_time()
    results = generate_batch(session.engine.model, make, prompts, session.generation, args.batch_size, cost=cost,
                             stats=stats, max_width=16)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - tic
    tokens = sum(len(r.tokens) for r in results)
    summary = stats.to_dict()
    report = {"method": args.method, "records": len(prompts), "batch_size": args.batch_size, "tokens": tokens,
              "steps": stats.steps, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
              "tokens_per_cpu_s": round(tokens / cpu, 1),
              "tokens_per_row_step": round(tokens / sum(r.metrics.steps for r in results), 2),
              "host_ms_per_step": summary["host_ms_per_step"], "forward_ms_per_step": summary["forward_ms_per_step"],
              "outputs": [r.tokens for r in results]}
    print(json.dumps({k: v for k, v in report.items() if k != "outputs"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
