"""Benchmark the batched engine on the mission's batch jobs (issue 26).

One process, one model, the same records for every side:
    batched   decode.loop.generate_batch with `--method` (default adaptive) at --batch-size
    batch-1   decode.loop.generate with the same method, one record at a time
    hf        transformers `model.generate`, greedy, left padding, --batch-size records per call
    plain     decode.loop.generate with `ar` (plain greedy, batch 1): the reference every other
              side's greedy output is compared with, token for token (mismatches reported)
The records are split into --rounds chunks; each round runs every side on its chunk, the order
rotating from round to round, so a busy moment on a shared machine hits every side alike.
Reported per side: tokens/s and records/hour over the summed wall time, and for the batched side
the forward time per step beside the host time per step (drafting, budget, acceptance, commit).

Records: document summaries and document questions (Spec-Bench `summarization` and `qa`), code
edits (CodeAlpaca answers with an edit instruction) and the prompts in samctl/data/prompts, in
the model's chat template, cut to --max-prompt tokens.

    python tools/bench/bench_batch.py --model /work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --records 64 --batch-size 64 --max-new-tokens 64 --threads 1
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from samctl.decode.loop import BatchStats, generate_batch  # noqa: E402
from samctl.decode.engine.cost import measure_batch_cost  # noqa: E402
from samctl.decode.loop import GenerationConfig, generate  # noqa: E402
from samctl.decode.methods import method_config  # noqa: E402
from samctl.models import load_engine  # noqa: E402
from samctl.session import build_drafter  # noqa: E402

DATA = Path("/work/shared/data")
EDITS = ("Add a comment above every function explaining what it does.",
         "Rename the variables to longer, descriptive names.",
         "Add type hints where they are missing.",
         "Fix the indentation and keep everything else unchanged.")


def mission_texts(n: int) -> list[str]:
    """n prompts, cycling summaries, document questions and code edits."""
    spec = [json.loads(line) for line in (DATA / "specbench_question.jsonl").read_text().splitlines() if line.strip()]
    summaries = [q["turns"][0] for q in spec if q["category"] == "summarization"]
    questions = [q["turns"][0] for q in spec if q["category"] == "qa"]
    code = [r for r in json.loads((DATA / "codealpaca.json").read_text()) if len(r.get("output", "")) > 200]
    edits = [f"{EDITS[i % len(EDITS)]}\n\n```\n{r['output']}\n```" for i, r in enumerate(code)]
    local = [p.read_text() for p in sorted((ROOT / "samctl/data/prompts").glob("*.txt"))]
    pools = [local + summaries, questions, edits]
    return [pools[i % 3][i // 3 % len(pools[i % 3])] for i in range(n)]


def category_texts(categories: str, n: int) -> list[str]:
    """n Spec-Bench prompts of the given categories (comma-separated), taken in turn from each."""
    spec = [json.loads(line) for line in (DATA / "specbench_question.jsonl").read_text().splitlines() if line.strip()]
    pools = [[q["turns"][0] for q in spec if q["category"] == c] for c in categories.split(",")]
    return [pools[i % len(pools)][i // len(pools) % len(pools[i % len(pools)])] for i in range(n)]


def hf_generate(model, prompts: list[list[int]], batch: int, new: int, eos: tuple[int, ...], pad: int) -> list[list[int]]:
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s: s + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 eos_token_id=list(eos), pad_token_id=pad)
        for row in gen[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out.append(row[:cut])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--method", default="adaptive")
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--categories", default="",
                    help="Spec-Bench categories (e.g. summarization,rag) in place of the mission's mix")
    ap.add_argument("--max-width", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sides", default="batched,hf,batch1,plain")
    ap.add_argument("--quantize", default="none", choices=("none", "int8"),
                    help="the samctl sides' model (the hf side stays float32, as transformers runs it)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engine = load_engine(args.model, device="cpu", dtype="float32", quantize=args.quantize)
    model, tok = engine.model, engine.tokenizer
    hf_model = model if args.quantize == "none" else load_engine(args.model, device="cpu", dtype="float32").model
    texts = category_texts(args.categories, args.records) if args.categories else mission_texts(args.records)
    prompts = [engine.encode(t, True)[-args.max_prompt:] for t in texts]
    eos = engine.eos_token_ids
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
    methods = method_config({}, engine.device)

    def drafter(name):
        return build_drafter(name, engine, None, methods)

    tic = time.perf_counter()
    cost = measure_batch_cost(model, args.batch_size, args.max_width, clock=time.process_time)
    cost_s = time.perf_counter() - tic
    single_adaptive, single_plain = drafter(args.method), drafter("ar")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    sides = args.sides.split(",")
    outputs = {s: [None] * len(prompts) for s in sides}
    wall = dict.fromkeys(sides, 0.0)
    cpu = dict.fromkeys(sides, 0.0)  # this process's CPU seconds: far steadier on a busy machine
    stats = BatchStats()
    chunk = -(-len(prompts) // args.rounds)
    # warm-up: numba caches, allocator growth (not timed)
    generate_batch(model, lambda: drafter(args.method), prompts[:2], GenerationConfig(max_new_tokens=4), 2, cost=cost)
    for r in range(args.rounds):
        idx = list(range(r * chunk, min(len(prompts), (r + 1) * chunk)))
        part = [prompts[i] for i in idx]
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            tic, cpu_tic = time.perf_counter(), time.process_time()
            if side == "batched":
                res = generate_batch(model, lambda: drafter(args.method), part, config, args.batch_size,
                                     cost=cost, max_width=args.max_width, stats=stats)
                got = [x.tokens for x in res]
            elif side == "hf":
                got = hf_generate(hf_model, part, args.batch_size, args.max_new_tokens, eos, pad)
            else:
                d = single_adaptive if side == "batch1" else single_plain
                got = [generate(engine.target, d, p, config).tokens for p in part]
            wall[side] += time.perf_counter() - tic
            cpu[side] += time.process_time() - cpu_tic
            for i, g in zip(idx, got):
                outputs[side][i] = g
            print(f"round {r} {side}: {time.perf_counter() - tic:.1f} s", file=sys.stderr, flush=True)

    ref = outputs.get("plain")
    report = {"model": args.model, "quantize": args.quantize, "method": args.method, "records": len(prompts), "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rounds": args.rounds,
              "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1),
              "batch_cost_measure_s": round(cost_s, 1),
              "t_ms_at": {str(n): round(float(cost[n - 1]), 1) for n in (1, 8, 16, 32, 64, 128, 256, 512)
                          if n <= len(cost)},
              "t_ms": [round(float(t), 2) for t in cost], "sides": {}}
    for side in sides:
        tokens = sum(len(o) for o in outputs[side])
        entry = {"tokens": tokens, "wall_s": round(wall[side], 2), "tokens_per_s": round(tokens / wall[side], 2),
                 "records_per_hour": round(3600 * len(prompts) / wall[side], 1), "cpu_s": round(cpu[side], 2),
                 "tokens_per_cpu_s": round(tokens / cpu[side], 2),
                 "records_per_cpu_hour": round(3600 * len(prompts) / cpu[side], 1)}
        if ref is not None and side != "plain":
            entry["greedy_mismatches"] = sum(a != b for a, b in zip(outputs[side], ref))
        report["sides"][side] = entry
    report["batched_stats"] = stats.to_dict()
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        rate = {s: report["sides"][s][key] for s in sides}
        if "batched" in rate:
            report[f"ratios_{key}"] = {f"batched/{s}": round(rate["batched"] / rate[s], 3) for s in sides if s != "batched"}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
