"""Benchmark growing an automaton store: append new documents versus rebuild everything.

On the Python standard library's source (tokenized once, cached by tools/bench/bench_index.py): a store
over the first `--old` tokens (whole files) is written uncompressed, then, alternately in this
process, (a) it is loaded (memory-mapped) and the next `--new` tokens are appended
(`SuffixAutomaton.appended`) and (b) the automaton over old + new is built from scratch; each
result is written as a store. Both results are checked equal state for state.

    python tools/bench/bench_append.py                          # 8M + 1M tokens, llama2 tokenizer
    python tools/bench/bench_append.py --old 2000000 --new 250000 --rounds 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from samctl.index.automaton import SuffixAutomaton  # noqa: E402
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore  # noqa: E402
from samctl.index.load import load_datastore
from tools.bench.bench_index import DEFAULT_TOKENIZER, corpus, head  # noqa: E402


def _meta(tokens: int, documents: int) -> StoreMeta:
    return StoreMeta(tokenizer_name="bench", tokenizer_fingerprint="bench", vocab_size=1 << 20, eos_token_id=None,
                     build=BuildConfig(kind="sam", compress=False, append_eos=False),
                     corpus=CorpusStats(documents=documents, tokens=tokens))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=int, default=8_000_000, help="tokens in the existing store (whole files)")
    ap.add_argument("--new", type=int, default=1_000_000, help="tokens appended (whole files)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of (append, rebuild)")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--stdlib", type=Path, default=Path(__import__("sysconfig").get_paths()["stdlib"]))
    args = ap.parse_args()

    tokens, offsets, facts = corpus(args.stdlib, args.tokenizer, args.old + args.new + 200_000)
    old_tokens, old_offsets = head(tokens, offsets, args.old)
    d = len(old_offsets) - 1
    all_tokens, all_offsets = head(tokens, offsets, len(old_tokens) + args.new)
    new_tokens = all_tokens[len(old_tokens):]
    new_offsets = all_offsets[d:] - all_offsets[d]
    with tempfile.TemporaryDirectory(dir=ROOT / "out") as tmp:
        old_path, out_path = Path(tmp) / "old.sam", Path(tmp) / "new.sam"
        save_datastore(old_path, SuffixAutomaton.build(old_tokens, old_offsets), _meta(len(old_tokens), d))
        SuffixAutomaton.build(new_tokens[:1000], np.array([0, 1000]))  # JIT cache warm for both paths
        times: dict[str, list[float]] = {k: [] for k in ("append", "rebuild", "append_only", "rebuild_only",
                                                         "append_cpu", "rebuild_cpu", "append_only_cpu",
                                                         "rebuild_only_cpu")}
        for r in range(args.rounds):
            for side in (("append", "rebuild") if r % 2 == 0 else ("rebuild", "append")):
                tic, cpu = time.perf_counter(), time.process_time()
                if side == "append":
                    old = load_datastore(old_path).structure
                    mid, mid_cpu = time.perf_counter(), time.process_time()
                    sam = old.appended(new_tokens, new_offsets)
                else:
                    mid, mid_cpu = time.perf_counter(), time.process_time()
                    sam = SuffixAutomaton.build(all_tokens, all_offsets)
                built, built_cpu = time.perf_counter(), time.process_time()
                save_datastore(out_path, sam, _meta(len(all_tokens), len(all_offsets) - 1))
                times[side].append(time.perf_counter() - tic)
                times[side + "_only"].append(built - mid)
                times[side + "_cpu"].append(time.process_time() - cpu)
                times[side + "_only_cpu"].append(built_cpu - mid_cpu)
                if side == "append":
                    grown = sam.to_arrays()
                else:
                    full = sam.to_arrays()
                del sam
        equal = all(np.array_equal(grown[k], full[k]) for k in ("states", "edges", "tokens", "meta"))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "old_tokens": int(len(old_tokens)), "new_tokens": int(len(new_tokens)), "rounds": args.rounds,
        "tokenizer": facts["tokenizer"], "equal_to_rebuild": bool(equal),
        "append_s": round(med["append"], 3), "rebuild_s": round(med["rebuild"], 3),
        "speedup": round(med["rebuild"] / med["append"], 2),
        "append_build_s": round(med["append_only"], 3), "rebuild_build_s": round(med["rebuild_only"], 3),
        "build_speedup": round(med["rebuild_only"] / med["append_only"], 2),
        "append_cpu_s": round(med["append_cpu"], 3), "rebuild_cpu_s": round(med["rebuild_cpu"], 3),
        "cpu_speedup": round(med["rebuild_cpu"] / med["append_cpu"], 2),
        "build_cpu_speedup": round(med["rebuild_only_cpu"] / med["append_only_cpu"], 2),
        "runs": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }
    print(f"| old + new tokens | append (load + insert + write) | rebuild (build + write) | speedup |\n"
          f"|---|---|---|---|\n| {result['old_tokens']:,} + {result['new_tokens']:,} | {result['append_s']:.2f} s "
          f"(insert {result['append_build_s']:.2f} s) | {result['rebuild_s']:.2f} s (build "
          f"{result['rebuild_build_s']:.2f} s) | {result['speedup']:.1f}x (structure alone "
          f"{result['build_speedup']:.1f}x) |\n| CPU time | {result['append_cpu_s']:.2f} s | "
          f"{result['rebuild_cpu_s']:.2f} s | {result['cpu_speedup']:.1f}x (structure alone "
          f"{result['build_cpu_speedup']:.1f}x) |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
