"""The forward's two backends (`hf`, `native`) side by side on one model, in one process.

    python tools/bench/bench_backends.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --questions specbench_question.jsonl --per-category 2 --code-edits 4 --max-new-tokens 128

For each `--quantize` (none, int8): the verify cost t(1) and t(8) after a 256-token context (CPU
time of this process, one thread, best of rounds, the backends interleaved), then `ar` and
`adaptive` on every prompt (Spec-Bench's first turns, `--per-category` of each category, and
`--code-edits` rewrites of files of the Python standard library), backends alternating prompt by
prompt: tokens per CPU-second of each, and whether every output equals that backend's `ar` and
the other backend's. Prints Markdown; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from samctl.config import SessionConfig  # noqa: E402
from samctl.decode.engine.native import backend_name  # noqa: E402
from samctl.decode.tree import DraftTree  # noqa: E402
from samctl.models import engine_for, load_engine  # noqa: E402
from samctl.session import Session  # noqa: E402

EDIT = "Rename the function `{name}` to `{name}_v2` everywhere in this code and return the whole code:\n\n{code}"


def code_edits(n: int) -> list[str]:
    """n rewrites of the first function-bearing stretch (about 60 lines) of standard-library files."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        lines = path.read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
        if start is None or len(lines) < start + 60:
            continue
        name = lines[start][4:].split("(")[0]
        out.append(EDIT.format(name=name, code="\n".join(lines[start : start + 60])))
        if len(out) == n:
            break
    return out


def verify_ms(target, width: int, rounds: int = 3, steps: int = 10) -> float:
    gen = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(rounds):
        tic = time.process_time()
        for _ in range(steps):
            ids = torch.randint(0, 1000, (width,), generator=gen)
            target.verify(ids, DraftTree.chain(ids[1:].numpy()))
            target.keep(np.arange(1))
        best = min(best, (time.process_time() - tic) / steps * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--questions", required=True, help="Spec-Bench question.jsonl")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--code-edits", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--quantize", default="none,int8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in Path(args.questions).read_text().splitlines() if line.strip()]
    by_category: dict[str, list] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    prompts = [(c, t) for c in sorted(by_category) for t in by_category[c][: args.per_category]]
    prompts += [("code_edit", t) for t in code_edits(args.code_edits)]
    print(f"python {' '.join(sys.argv)}\n\ntorch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"one thread; {len(prompts)} prompts, {args.max_new_tokens} new tokens\n")
    print("| quantize | backend | t(1) ms | t(8) ms | t(8)/t(1) | ar tok/CPU-s | adaptive tok/CPU-s | adaptive/ar | "
          "outputs = own ar | = other backend |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for quantize in args.quantize.split(","):
        base = load_engine(args.model, "cpu", quantize=quantize)
        sessions = {}
        for backend in ("hf", "native"):
            engine = engine_for(base.model, base.tokenizer, name=base.name, backend=backend)
            config = SessionConfig(model=base.name, quantize=quantize, backend=backend, chat=True, quiet=True,
                                   max_new_tokens=args.max_new_tokens, threads=1)
            session = Session.over(engine, config)
            # one session per method, made once: each warms up on its first prompt only
            sessions[backend] = ({m: session.for_method(m) for m in ("ar", "adaptive")}, backend_name(base.model))
        costs = {}
        for backend, (by_method, _) in sessions.items():
            target = by_method["ar"].engine.target
            target.prefill(torch.randint(0, 1000, (256,)), reserve=512)
            costs[backend] = {}
        for _ in range(2):  # interleaved rounds
            for backend, (by_method, _) in sessions.items():
                for width in (1, 8):
                    t = verify_ms(by_method["ar"].engine.target, width)
                    costs[backend][width] = min(costs[backend].get(width, t), t)
        cpu = {(b, m): 0.0 for b in sessions for m in ("ar", "adaptive")}
        tokens = dict.fromkeys(cpu, 0)
        same_ar = dict.fromkeys(sessions, 0)
        outputs: dict[str, list] = {b: [] for b in sessions}
        for i, (_, text) in enumerate(prompts):
            order = list(sessions) if i % 2 == 0 else list(sessions)[::-1]
            for backend in order:
                by_method = sessions[backend][0]
                ids = by_method["ar"].encode(text)
                got = {}
                for method in ("ar", "adaptive") if i % 2 == 0 else ("adaptive", "ar"):
                    result = by_method[method].generate(ids)
                    cpu[(backend, method)] += result.metrics.cpu_s
                    tokens[(backend, method)] += result.metrics.new_tokens
                    got[method] = result.tokens
                same_ar[backend] += got["ar"] == got["adaptive"]
                outputs[backend].append(got["ar"])
        across = sum(a == b for a, b in zip(outputs["hf"], outputs["native"]))
        for backend, (_, name) in sessions.items():
            ar = tokens[(backend, "ar")] / cpu[(backend, "ar")]
            ad = tokens[(backend, "adaptive")] / cpu[(backend, "adaptive")]
            t1, t8 = costs[backend][1], costs[backend][8]
            print(f"| {quantize} | {name} | {t1:.2f} | {t8:.2f} | {t8 / t1:.2f} | {ar:.1f} | {ad:.1f} | {ad / ar:.2f} | "
                  f"{same_ar[backend]}/{len(prompts)} | {across}/{len(prompts)} |")
        del sessions, base


if __name__ == "__main__":
    main()
