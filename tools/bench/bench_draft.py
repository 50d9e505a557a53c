"""Per-step drafting cost of `adaptive` and SAM-Decoding with a large static store, beside the model's forward time.

What it measures (the engine issue's performance check):
1. A static suffix-automaton store over the Python standard library's source, tokenized with the
   model's tokenizer up to --tokens tokens (8M by default), written uncompressed and loaded the
   way `generate` loads it (memory-mapped).
2. Drafting cost per decode step, propose + observe on the CPU, for `adaptive` and `sam`, each
   with that store and with only the dynamic automaton, replayed (decode.simulate.replay, no model) over a
   code-editing set made by tools/make_code_edit_set.py: median and p90 over all steps.
3. The target model's forward time on the CPU for verify inputs of 1, 16, 40 (chains) and 81
   (a Token Recycle tree) tokens after a ~1k-token context, median of --reps runs.

    python tools/make_code_edit_set.py --out out/data/code_edit.jsonl --n 80
    python tools/bench/bench_draft.py --questions out/data/code_edit.jsonl

Tokenized ids and the store are cached in out/bench_draft/ (gitignored).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from samctl.decode.drafters.adaptive import AdaptiveDrafter
from samctl.decode.drafters.sam import SamDrafter
from samctl.decode.drafters.recycle import RecycleConfig, build_template
from samctl.decode.metrics import Metrics
from samctl.decode.simulate import make_trace, replay
from samctl.decode.tree import DraftTree
from samctl.index.automaton import SuffixAutomaton
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
from samctl.index.load import load_datastore
from samctl.models import load_engine
from samctl.tokenizer import DEFAULT_MODEL_DIR, load_tokenizer, tokenize_documents

OUT = Path("out/bench_draft")


def stdlib_tokens(tokenizer, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    cache = OUT / f"stdlib_{tokenizer.fingerprint}_{max_tokens}.npz"
    if cache.exists():
        z = np.load(cache)
        return z["tokens"], z["offsets"]
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    texts, chars = [], 0
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        chars += len(texts[-1])
        if chars > 6 * max_tokens:  # well over max_tokens at any sane tokenizer; trimmed below
            break
    tokens, offsets = tokenize_documents(texts, tokenizer)
    keep = int(np.searchsorted(offsets, max_tokens, side="right")) - 1
    tokens, offsets = tokens[: offsets[keep]], offsets[: keep + 1]
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(cache, tokens=tokens, offsets=offsets)
    return tokens, offsets


def static_store(tokenizer, max_tokens: int) -> tuple[Path, dict]:
    path = OUT / f"stdlib_{tokenizer.fingerprint}_{max_tokens}.sam"
    facts: dict = {}
    if not path.exists():
        tokens, offsets = stdlib_tokens(tokenizer, max_tokens)
        tic = time.perf_counter()
        automaton = SuffixAutomaton.build(tokens, offsets)
        facts["build_s"] = round(time.perf_counter() - tic, 2)
        meta = StoreMeta(
            tokenizer_name=tokenizer.name, tokenizer_fingerprint=tokenizer.fingerprint,
            vocab_size=tokenizer.vocab_size, eos_token_id=(tokenizer.eos_token_ids or (None,))[0],
            build=BuildConfig(kind="sam", compress=False),
            corpus=CorpusStats(documents=len(offsets) - 1, tokens=len(tokens)),
        )
        save_datastore(path, automaton, meta, compress=False)
    tic = time.perf_counter()
    store = load_datastore(path)
    facts["load_s"] = round(time.perf_counter() - tic, 3)
    facts["tokens"] = store.sam.num_tokens
    facts["states"] = store.sam.num_states
    return path, facts | {"store": store}


def drafting_cost(store, questions: Path, tokenizer, limit: int) -> dict[str, dict]:
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()][:limit]
    traces = [make_trace(tokenizer.encode(r["turns"][0]), tokenizer.encode(r["reference"][0]),
                         tokenizer.eos_token_ids) for r in rows]
    results = {}
    size = f"{store.sam.num_tokens / 1e6:.0f}M"
    drafters = {
        f"adaptive + {size} static store": lambda: AdaptiveDrafter(static=store.sam),
        "adaptive, dynamic only": lambda: AdaptiveDrafter(),
        f"sam + {size} static store": lambda: SamDrafter(static=store.sam),
        "sam, dynamic only": lambda: SamDrafter(),
    }
    for name, make in drafters.items():
        replay(make(), traces[0])  # warm caches and the JIT before timing, on a drafter of its own
        drafter = make()
        steps: list[float] = []
        accepted = Metrics()
        for trace in traces:
            m = replay(drafter, trace)
            steps.extend(m.step_draft_us)
            accepted.new_tokens += m.new_tokens
            accepted.steps += m.steps
        results[name] = {
            "steps": len(steps),
            "median_us": round(statistics.median(steps), 2),
            "p90_us": round(float(np.quantile(steps, 0.9)), 2),
            "mean_us": round(statistics.fmean(steps), 2),
            "mean_accepted": round((accepted.new_tokens - len(traces)) / max(accepted.steps, 1), 3),
            "sources": dict(drafter.sources) if hasattr(drafter, "sources") else drafter.report()["calibration"],
        }
    return results


def forward_times(model_dir: str, reps: int) -> dict[int, float]:
    engine = load_engine(model_dir, device="cpu")
    target = engine.target
    context = torch.randint(0, engine.vocab_size, (1000,))
    target.prefill(context)
    tree_parents, _ = build_template(RecycleConfig())
    shapes = {1: DraftTree.empty(), 16: DraftTree.chain(np.zeros(15, dtype=np.int64)),
              40: DraftTree.chain(np.zeros(39, dtype=np.int64)),
              81: DraftTree(tokens=np.zeros(80, dtype=np.int64), parents=tree_parents)}
    results = {}
    for q, tree in shapes.items():
        ids = torch.zeros(q, dtype=torch.int64)
        times = []
        for _ in range(reps + 2):
            tic = time.perf_counter()
            target.verify(ids, tree)
            times.append(time.perf_counter() - tic)
            target.keep(np.zeros(1, dtype=np.int64))  # the context grows by one token: immaterial
        results[q] = round(1e3 * statistics.median(times[2:]), 3)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model folder (its tokenizer builds the store)")
    ap.add_argument("--questions", type=Path, required=True, help="code-edit JSONL from tools/make_code_edit_set.py")
    ap.add_argument("--tokens", type=int, default=8_000_000)
    ap.add_argument("--limit", type=int, default=80, help="questions replayed")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    path, facts = static_store(tokenizer, args.tokens)
    store = facts.pop("store")
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), python {platform.python_version()}",
        "store": {"path": str(path), **facts},
        "drafting": drafting_cost(store, args.questions, tokenizer, args.limit),
        "forward_ms": forward_times(args.model, args.reps),
    }
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
