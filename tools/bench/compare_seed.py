"""samctl's automaton beside the seed's: SAM-Decoding's own `StaticSAM` (samd/sam/static_sam.py,
copied unchanged from its repository to a path given with --seed), on the same corpus.

Corpus: the head of the Python standard library as tools/bench/bench_index.py tokenizes it (Llama 2
SentencePiece by default), whole files, --tokens each. Every measurement runs in a fresh
process (`--child`), so one build's garbage cannot inflate the next one's peak:

    build     seconds and peak RSS added by the build (bytes per token), then the file it ships:
              the seed pickles its object (as SAM-Decoding's tools do), samctl writes a zstd store
    load      seconds to read that file back (pickle.load / load_datastore)
    queries   --queries spans inside documents (1-32 tokens, random document and place): the
              longest suffix found by StaticSAM (transfer_tokens from the root), by samctl
              (match) and by brute force over every occurrence of the span's last token; all
              three must agree.

    python tools/bench/compare_seed.py --seed /work/runs/seed/static_sam.py --tokens 1000000,2600000
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.bench_index import DEFAULT_TOKENIZER, corpus, head  # noqa: E402

from samctl.index.automaton import SuffixAutomaton  # noqa: E402
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore  # noqa: E402
from samctl.index.load import load_datastore

EOS = 2  # Llama 2's </s>: the seed appends it to each document, samctl's build would too


def rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def seed_class(path: str):
    spec = importlib.util.spec_from_file_location("seed_static_sam", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["seed_static_sam"] = module  # pickles name the class by module
    spec.loader.exec_module(module)
    return module.StaticSAM


def documents(n: int, stdlib: str) -> tuple[np.ndarray, np.ndarray]:
    tokens, offsets, _ = corpus(Path(stdlib), DEFAULT_TOKENIZER, 8_000_000)
    return head(tokens, offsets, n)


def warm_up(directory: str) -> None:
    """Imports and numba's cached kernels load before any timing (both sides' imports are paid
    outside the measurements: the seed's module imports torch)."""
    tiny = Path(directory) / "warm.sam"
    sam = SuffixAutomaton.build(np.array([1, 2, 1, 2], dtype=np.int32), np.array([0, 4]))
    save_datastore(tiny, sam, StoreMeta(tokenizer_name="-", tokenizer_fingerprint="-", vocab_size=8, eos_token_id=None,
                                        build=BuildConfig(), corpus=CorpusStats(documents=1, tokens=4)))
    load_datastore(tiny).sam.match(np.array([1, 2], dtype=np.int32))
    tiny.unlink()


def child(args: argparse.Namespace) -> dict:
    warm_up(args.dir)
    if args.side != "samctl":
        seed_class(args.seed)
    tokens, offsets = documents(args.n, args.stdlib)
    # EOS after each document on both sides, as both tools build their stores
    docs = [np.append(tokens[a:b], EOS).astype(np.int32) for a, b in zip(offsets[:-1], offsets[1:])]
    path = Path(args.dir) / ("seed.pkl" if args.side == "seed" else "samctl.sam")
    if args.what == "build":
        if args.side == "seed":
            cls = seed_class(args.seed)
            lists = [d.tolist() for d in docs]
            base = rss()
            tic = time.perf_counter()
            sam = cls.build(lists, EOS, verbose=False)
            build_s = time.perf_counter() - tic
            peak = rss() - base
            tic = time.perf_counter()
            with open(path, "wb") as out:
                pickle.dump(sam, out, protocol=pickle.HIGHEST_PROTOCOL)
            write_s = time.perf_counter() - tic
        else:
            flat = np.concatenate(docs)
            offs = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64)
            base = rss()
            tic = time.perf_counter()
            sam = SuffixAutomaton.build(flat, offs)
            build_s = time.perf_counter() - tic
            peak = rss() - base
            meta = StoreMeta(tokenizer_name="llama2", tokenizer_fingerprint="-", vocab_size=32000, eos_token_id=EOS,
                             build=BuildConfig(), corpus=CorpusStats(documents=len(docs), tokens=len(flat)))
            tic = time.perf_counter()
            save_datastore(path, sam, meta)
            write_s = time.perf_counter() - tic
        n = sum(len(d) for d in docs)
        return {"tokens": n, "build_s": build_s, "tokens_per_s": n / build_s, "peak_bytes_per_token": peak / n,
                "write_s": write_s, "file_mb": os.path.getsize(path) / 1e6}
    if args.what == "load":
        tic = time.perf_counter()
        if args.side == "seed":
            seed_class(args.seed)  # the pickle refers to the module's class
            with open(path, "rb") as handle:
                pickle.load(handle)
        else:
            load_datastore(path)
        return {"load_s": time.perf_counter() - tic}
    return queries(args, docs, path)


def queries(args: argparse.Namespace, docs: list[np.ndarray], path: Path) -> dict:
    cls = seed_class(args.seed)  # registered for unpickling
    with open(Path(args.dir) / "seed.pkl", "rb") as handle:
        seed = pickle.load(handle)
    ours = load_datastore(Path(args.dir) / "samctl.sam").sam
    buf = np.asarray(ours.tokens)  # documents separated by -1: a scan stops at a boundary
    rng = np.random.default_rng(0)
    agree_seed = agree_ours = 0
    texts = [d[:-1] for d in docs if len(d) > 1]  # without their EOS; empty files have nothing to query
    for _ in range(args.queries):
        doc = texts[int(rng.integers(len(texts)))]
        length = int(rng.integers(1, min(32, len(doc)) + 1))
        start = int(rng.integers(0, len(doc) - length + 1))
        query = doc[start:start + length]
        seed.reset()
        seed.transfer_tokens(query.tolist())
        truth = brute_force(buf, query)
        agree_seed += seed.cur_length == truth
        agree_ours += ours.match(query)[1] == truth
    assert cls is not None
    return {"queries": args.queries, "seed_agrees": agree_seed, "samctl_agrees": agree_ours}


def brute_force(buf: np.ndarray, query: np.ndarray) -> int:
    """Longest suffix of query occurring in buf: extend every occurrence of its last token
    backwards while the tokens agree."""
    alive = np.flatnonzero(buf == query[-1])
    best = 1 if len(alive) else 0
    for k in range(1, len(query)):
        alive = alive[alive >= k]
        alive = alive[buf[alive - k] == query[-1 - k]]
        if len(alive) == 0:
            break
        best = k + 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", required=True, help="SAM-Decoding's samd/sam/static_sam.py")
    parser.add_argument("--tokens", default="1000000,2600000")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--stdlib", default=str(Path(os.__file__).parent))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--what", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = {}
    for n in (int(t) for t in args.tokens.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            row = {}
            for what, side in (("build", "samctl"), ("build", "seed"), ("load", "samctl"), ("load", "seed"),
                               ("queries", "both")):
                cmd = [sys.executable, __file__, "--child", "--seed", args.seed, "--side", side, "--what", what,
                       "--n", str(n), "--dir", tmp, "--queries", str(args.queries), "--stdlib", args.stdlib]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{what} {side} at {n} tokens failed:\n{done.stderr}")
                out = done.stdout
                row[f"{what}_{side}"] = json.loads(out.strip().splitlines()[-1])
                print(n, what, side, row[f"{what}_{side}"], flush=True)
            results[n] = row
    print(json.dumps(results))


if __name__ == "__main__":
    main()
