"""CPU linear backends side by side, in one process: plain float32, prepacked float32, int8.

What it measures (BENCHMARKS.md, "CPU int8 and prepacked weights"), all interleaved so that a busy
machine slows every backend alike:
1. the verify-cost curve t(1..64) of each backend after a 256-token context (fastest of --rounds);
2. tokens/s of `ar`, `adaptive` (and hf-pld on plain float32, llama.cpp when llama-cpp-python is
   installed) on each question's first turn, prefill included, with every method's greedy tokens
   checked against its own backend's `ar`;
3. quality against plain float32: teacher-forced top-1 agreement over the first 128 generated
   tokens of float32's greedy output, the mean identical greedy prefix, and next-token loss on
   held-out text (the questions' prompts).

    python tools/bench/bench_cpu_linear.py --model M.gguf --questions code.jsonl --limit 4 \\
        --questions2 specbench_question.jsonl --limit2 1 --threads 1 --out runs/cpu_linear.json

Against llama.cpp (issue 30): a `.gguf` model with llama-cpp-python installed adds llama.cpp greedy
and its prompt lookup (`LlamaPromptLookupDecoding`) on the same token ids, one thread for
decoding and for prompt batches alike; `--backends packed,int8` leaves plain float32 (and hf-pld)
out. The summary on stderr gives tokens/s per question file (sum of tokens over sum of seconds)
and each row's ratio to llama.cpp greedy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from samctl.commands.bench import EngineRunner, HfRunner, read_questions  # noqa: E402
from samctl.decode.engine.cost import measure_verify_cost  # noqa: E402
from samctl.decode.methods import method_config  # noqa: E402
from samctl.config import SessionConfig  # noqa: E402
from samctl.models import load_engine  # noqa: E402
from samctl.session import Session  # noqa: E402

BACKENDS = {"plain": ("none", False), "packed": ("none", True), "int8": ("int8", True)}
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def curves(engines: dict, rounds: int) -> dict[str, list[float]]:
    best = {name: np.full(len(WIDTHS), np.inf) for name in engines}
    for _ in range(rounds):  # interleaved: one sweep per backend per round
        for name, engine in engines.items():
            t = measure_verify_cost(engine.target, 64, 256, rounds=1, widths=WIDTHS)
            best[name] = np.minimum(best[name], [t[w - 1] for w in WIDTHS])
    return {name: [round(float(v), 3) for v in b] for name, b in best.items()}


class LlamaCppRunner:
    """llama.cpp greedy (or prompt lookup) on the same token ids; its KV cache reset per run."""

    def __init__(self, path: str, lookup: bool) -> None:
        self.path, self.lookup = path, lookup
        self.llm, self.n_ctx = None, 0

    def _context(self, n: int) -> None:
        # a context just large enough (rounded up to 1024): with prompt lookup llama-cpp-python keeps
        # logits for every position (n_ctx x vocab floats), but sizes that array by the logits_all
        # argument (n_batch rows without it: a prompt over 512 tokens then fails), so it is passed
        if n <= self.n_ctx:
            return
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.n_ctx = -(-n // 1024) * 1024
        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if self.lookup else None
        threads = torch.get_num_threads()  # n_threads_batch (prefill, verify blocks) defaults to every core
        self.llm = None
        self.llm = Llama(model_path=self.path, n_threads=threads, n_threads_batch=threads, n_ctx=self.n_ctx,
                         verbose=False, draft_model=draft, logits_all=self.lookup)

    def run(self, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
        self._context(len(prompt) + max_new + 16)  # + the widest lookup block
        self.llm.reset()
        tokens = []
        start = time.perf_counter()
        for tok in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(int(tok))
            if tok in eos or len(tokens) >= max_new:
                break
        return tokens, time.perf_counter() - start


def speed(engines: dict, prompts: list[tuple[str, list[int]]], max_new: int, gguf: str | None) -> dict:
    # prompts: (group, token ids); rows are checked against their own backend's `ar` (llama.cpp's
    # against its greedy)
    runners = {}
    for name, engine in engines.items():
        runners[(name, "ar")] = EngineRunner("ar", _session(engine, "ar"))
        if name != "plain":
            runners[(name, "adaptive")] = EngineRunner("adaptive", _session(engine, "adaptive"))
    plain = engines.get("plain")
    if plain is not None:
        pld = method_config({}, plain.device).pld
        runners[("plain", "hf-pld")] = HfRunner("hf-pld", plain, {"prompt_lookup_num_tokens": pld.num_draft,
                                                                 "max_matching_ngram_size": pld.max_ngram})
    if gguf:
        for lookup in (False, True):
            runners[("llama.cpp", "lookup" if lookup else "greedy")] = LlamaCppRunner(gguf, lookup)
    eos = set(next(iter(engines.values())).eos_token_ids)
    for runner in runners.values():  # warm-up: lazy imports, allocator growth, first cost curves
        _run(runner, prompts[0][1], 8, eos)
    rows = []
    for group, prompt in prompts:
        outs = {}
        for key, runner in runners.items():
            tokens, seconds = _run(runner, prompt, max_new, eos)
            outs[key] = tokens
            rows.append({"group": group, "backend": key[0], "method": key[1], "tokens": len(tokens), "s": seconds})
        for row in rows[-len(runners):]:
            base = outs.get((row["backend"], "ar"), outs.get((row["backend"], "greedy"), outs.get(("plain", "ar"))))
            row["mismatch"] = outs[(row["backend"], row["method"])] != base
        print(group, {f"{b}/{m}": round(r["tokens"] / r["s"], 1) for (b, m), r in zip(runners, rows[-len(runners):])},
              file=sys.stderr, flush=True)
    return {"rows": rows}


def summary(rows: list[dict], sets: dict[str, str]) -> str:
    """A Markdown table: tokens/s per question set (sum of tokens / sum of seconds), the ratio to
    llama.cpp greedy when it ran, and greedy mismatches against the row's own baseline."""
    names = list(dict.fromkeys(sets.values()))
    keys = list(dict.fromkeys((r["backend"], r["method"]) for r in rows))
    rate = {(k, n): sum(r["tokens"] for r in rows if (r["backend"], r["method"]) == k and sets[r["group"]] == n)
            / max(1e-9, sum(r["s"] for r in rows if (r["backend"], r["method"]) == k and sets[r["group"]] == n))
            for k in keys for n in names}
    base = ("llama.cpp", "greedy")
    lines = ["| backend / method | " + " | ".join(f"{n} tok/s (x llama.cpp greedy)" for n in names) + " | mismatches |",
             "|---|" + "---:|" * (len(names) + 1)]
    for k in keys:
        cells = [f"{rate[(k, n)]:.2f}" + (f" ({rate[(k, n)] / rate[(base, n)]:.2f})" if (base, n) in rate else "")
                 for n in names]
        bad = sum(bool(r.get("mismatch")) for r in rows if (r["backend"], r["method"]) == k)
        lines.append(f"| {k[0]} {k[1]} | " + " | ".join(cells) + f" | {bad} |")
    return "\n".join(lines)


def _session(engine, method: str) -> Session:
    return Session.over(engine, SessionConfig(method=method, quiet=True))


def _run(runner, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
    if isinstance(runner, LlamaCppRunner):
        return runner.run(prompt, max_new, eos)
    turn = runner.run(prompt, max_new)
    return turn.tokens, turn.time_s


@torch.inference_mode()
def quality(engines: dict, prompts: list[tuple[str, list[int]]], max_new: int) -> dict:
    """Each backend against plain float32: teacher-forced agreement on float32's greedy output,
    the identical greedy prefix, and next-token loss (nats) on the prompts' own text."""
    out = {}
    greedy = {}
    for name, engine in engines.items():
        runner = EngineRunner("ar", _session(engine, "ar"))
        greedy[name] = [runner.run(p, max_new).tokens for _, p in prompts]
    for name, engine in engines.items():
        agree = total = 0
        prefixes, nll, count = [], 0.0, 0
        for (_, prompt), ref_out, own in zip(prompts, greedy["plain"], greedy[name]):
            seq = torch.tensor(prompt + ref_out)
            logits = engine.model(input_ids=seq[None]).logits[0].float()
            choice = logits[len(prompt) - 1 : -1].argmax(-1)
            agree += int((choice == seq[len(prompt):]).sum())
            total += len(ref_out)
            prefixes.append(next((i for i, (a, b) in enumerate(zip(own, ref_out)) if a != b), min(len(own), len(ref_out))))
            logp = torch.log_softmax(logits[: len(prompt) - 1], -1)
            nll -= float(logp.gather(1, seq[1 : len(prompt), None]).sum())
            count += len(prompt) - 1
        out[name] = {"agreement": agree / max(total, 1), "generated": total, "mean_identical_prefix": float(np.mean(prefixes)),
                     "nll": nll / max(count, 1), "nll_tokens": count}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--questions", required=True, help="Spec-Bench-format JSONL (group: its categories)")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--questions2", default=None, help="a second question file (e.g. Spec-Bench)")
    p.add_argument("--limit2", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the cost curves")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: curves,speed,quality")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of "
                   f"{','.join(BACKENDS)} (quality needs plain)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    chosen = [b for b in args.backends.split(",") if b]
    if not chosen or set(chosen) - set(BACKENDS):
        p.error(f"--backends: choose among {', '.join(BACKENDS)}")
    engines = {name: load_engine(args.model, "cpu", "float32", quantize=BACKENDS[name][0],
                                 prepack=BACKENDS[name][1]) for name in chosen}
    questions = read_questions(Path(args.questions), None, args.limit)
    sets = {q.group: Path(args.questions).stem for q in questions}
    if args.questions2:
        more = read_questions(Path(args.questions2), None, args.limit2)
        sets.update({q.group: Path(args.questions2).stem for q in more})
        questions += more
    ref = next(iter(engines.values()))
    prompts = [(q.group, ref.encode(q.turns[0], chat=True)) for q in questions]
    skip = set(args.skip.split(","))
    if "plain" not in engines:
        skip.add("quality")
    gguf = args.model if args.model.endswith(".gguf") and _has_llama_cpp() else None
    report = {"command": "python tools/bench/bench_cpu_linear.py " + " ".join(sys.argv[1:]), "threads": args.threads,
              "questions": len(prompts), "max_new_tokens": args.max_new_tokens, "widths": WIDTHS,
              "llama_cpp": _version("llama_cpp") if gguf else None, "torch": torch.__version__,
              "transformers": _version("transformers"), "loadavg_start": os.getloadavg()}
    if "curves" not in skip:
        report["curves_ms"] = curves(engines, args.rounds)
        print(json.dumps(report["curves_ms"]), file=sys.stderr, flush=True)
    if "quality" not in skip:
        report["quality"] = quality(engines, prompts, args.max_new_tokens)
        print(json.dumps(report["quality"]), file=sys.stderr, flush=True)
    if "speed" not in skip:
        report["speed"] = speed(engines, prompts, args.max_new_tokens, gguf)["rows"]
        report["summary"] = summary(report["speed"], sets)
        print(report["summary"], file=sys.stderr, flush=True)
    report["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


def _version(module: str) -> str:
    return getattr(__import__(module), "__version__", "?")


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


if __name__ == "__main__":
    main()
