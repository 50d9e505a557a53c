"""Benchmark `model.generate(custom_generate=samctl.hf...)` against samctl's own generate path.

Same model, same method, same prompts, in one process, alternating which side goes first each
round. The samctl side is what `samctl generate` runs (the decode loop on the engine, tokens/s
from its metrics); the transformers side is the wall time of the whole `model.generate` call
(input preparation, logits-processor checks and output assembly included). Each side keeps its
own drafter across calls and sees the same sequence of prompts, so memories grow alike. Both
first run every prompt once untimed (JIT caches, allocator growth). Rates are per wall second
and per CPU second of this process (`time.process_time`, far steadier on a busy shared machine).

    python tools/bench/bench_hf.py --model /work/runs/smollm2 --prompts samctl/data/prompts/code_edit.txt --chat
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import samctl.hf  # noqa: E402
from samctl.decode.loop import GenerationConfig, generate as decode_generate  # noqa: E402
from samctl.decode.methods import method_config  # noqa: E402
from samctl.models import load_engine  # noqa: E402
from samctl.session import build_drafter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--prompts", nargs="+", default=[str(ROOT / "samctl/data/prompts/code_edit.txt"),
                                                     str(ROOT / "samctl/data/prompts/summarize.txt")])
    ap.add_argument("--method", default="adaptive")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engine = load_engine(args.model)
    model, tok = engine.model, engine.tokenizer
    texts = [Path(p).read_text() for p in args.prompts]
    prompts = [engine.encode(t, args.chat) for t in texts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=engine.eos_token_ids)
    drafter = build_drafter(args.method, engine, None, method_config({}, engine.device))
    custom = samctl.hf.make_generate(method=args.method, tokenizer=tok)

    def samctl_side(ids):
        cpu = time.process_time()
        result = decode_generate(engine.target, drafter, ids, gen)
        return result.tokens, result.metrics.tokens_per_s, len(result.tokens) / (time.process_time() - cpu)

    def hf_side(ids):
        x = torch.tensor([ids])
        tic, cpu = time.perf_counter(), time.process_time()
        out = model.generate(x, attention_mask=torch.ones_like(x), custom_generate=custom, do_sample=False,
                             max_new_tokens=args.max_new_tokens, eos_token_id=list(engine.eos_token_ids) or None,
                             pad_token_id=engine.eos_token_ids[0] if engine.eos_token_ids else 0)
        seconds, cpu = time.perf_counter() - tic, time.process_time() - cpu
        new = out[0, len(ids):].tolist()
        return new, len(new) / seconds, len(new) / cpu

    for ids in prompts:  # untimed warm-up of both sides
        samctl_side(ids)
        hf_side(ids)
    rates: dict[str, list[float]] = {"samctl": [], "hf": [], "samctl_cpu": [], "hf_cpu": []}
    identical = True
    for r in range(args.rounds):
        for ids in prompts:
            order = (("samctl", samctl_side), ("hf", hf_side))
            outs = {}
            for name, side in (order if r % 2 == 0 else order[::-1]):
                tokens, rate, cpu_rate = side(ids)
                outs[name] = tokens
                rates[name].append(rate)
                rates[name + "_cpu"].append(cpu_rate)
            identical &= outs["samctl"] == outs["hf"]
    ratios = [h / s for h, s in zip(rates["hf"], rates["samctl"])]
    cpu_ratios = [h / s for h, s in zip(rates["hf_cpu"], rates["samctl_cpu"])]
    result = {"model": engine.name, "method": args.method, "prompts": len(prompts), "rounds": args.rounds,
              "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "samctl_tok_s": round(statistics.median(rates["samctl"]), 2),
              "hf_custom_generate_tok_s": round(statistics.median(rates["hf"]), 2),
              "ratio_median": round(statistics.median(ratios), 4),
              "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
              "samctl_tok_per_cpu_s": round(statistics.median(rates["samctl_cpu"]), 2),
              "hf_tok_per_cpu_s": round(statistics.median(rates["hf_cpu"]), 2),
              "cpu_ratio_median": round(statistics.median(cpu_ratios), 4),
              "cpu_ratio_range": [round(min(cpu_ratios), 4), round(max(cpu_ratios), 4)], "identical": identical}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
