"""A real code corpus assembled offline, every store kind built from it, drafting cost per step.

    python tools/bench/bench_corpus.py assemble --out out/corpus --max-mb 300
    python tools/bench/bench_corpus.py assemble --out out/big --max-mb 1100 --wheels wheels/
    python tools/bench/bench_corpus.py build --out out/corpus --tokenizer bytes --kinds sa,ngram,sam
    python tools/bench/bench_corpus.py draft --out out/corpus --tokenizer bytes --kinds sa,ngram,sam --traces 40

assemble: the Python sources of the installed distributions (importlib.metadata, sorted by name;
each distribution's RECORD `.py` files, sorted) and then the standard library, one document per
file, into corpus.jsonl, until --max-mb; with --wheels, then the `.py` files of every wheel in that
folder (`pip download --no-deps --only-binary=:all: NAME`, sorted by file name) whose distribution
is not installed; packages.tsv lists every distribution taken (name,
version, files, bytes), so the corpus can be assembled again. Held-out traces come from
/usr/lib/python3/dist-packages (Debian's packages, none of which is in the corpus).
build: tokenizes once (tokens.npy, offsets.npy), then builds each kind in a fresh process through
index/kinds.py, as `samctl build` does, and reports build time, bytes on disk per token and the
peak RSS of that process and its children (infini-gram's indexer included).
draft: replays `sam` and `adaptive` over the held-out traces (a file's first half as the prompt,
the rest as the output) from each store and without one, and reports drafting cost per step
(propose + observe, median and p90) and mean accepted tokens per step.
Results go to results.jsonl beside the corpus and are printed as Markdown rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np

HELD_OUT = Path("/usr/lib/python3/dist-packages")


def assemble(out: Path, max_bytes: int, wheels: Path | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    total, rows = 0, []
    seen: set[str] = set()
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as corpus:
        for name, version, files in _sources(wheels):
            taken, size = 0, 0
            for path in files:
                if total >= max_bytes:
                    break
                real = os.path.realpath(path) if isinstance(path, Path) else str(path)
                if real in seen:
                    continue
                seen.add(real)
                try:
                    text = path.read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text.strip():
                    continue
                corpus.write(json.dumps({"text": text}) + "\n")
                taken, size, total = taken + 1, size + len(text.encode()), total + len(text.encode())
            if taken:
                rows.append(f"{name}\t{version}\t{taken}\t{size}")
            if total >= max_bytes:
                break
    (out / "packages.tsv").write_text("name\tversion\tfiles\tbytes\n" + "\n".join(rows) + "\n")
    print(f"{out / 'corpus.jsonl'}: {total / 1e6:.1f} MB from {len(rows)} distributions")


def _sources(wheels: Path | None = None):
    dists = sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    installed = {_canonical(d.metadata["Name"] or "") for d in dists}
    for dist in dists:
        files = sorted(str(dist.locate_file(f)) for f in (dist.files or []) if str(f).endswith(".py"))
        yield dist.metadata["Name"], dist.version, [Path(f) for f in files if os.path.isfile(f)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    yield "python-stdlib", platform.python_version(), files
    for wheel in sorted(wheels.glob("*.whl")) if wheels else []:
        name, version = wheel.name.split("-")[:2]
        if _canonical(name) in installed:
            continue
        archive = zipfile.ZipFile(wheel)
        names = sorted(n for n in archive.namelist() if n.endswith(".py"))
        yield name, version, [zipfile.Path(archive, n) for n in names]


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def tokenize(out: Path, tokenizer: str) -> tuple[np.ndarray, np.ndarray]:
    from samctl.tokenizer import load_tokenizer, tokenize_documents

    cache = out / f"tokens-{tokenizer.replace('/', '_')}.npz"
    if cache.exists():
        data = np.load(cache)
        return data["tokens"], data["offsets"]
    tok = load_tokenizer(tokenizer)
    start = time.perf_counter()
    with open(out / "corpus.jsonl", encoding="utf-8") as f:
        tokens, offsets = tokenize_documents((json.loads(line)["text"] for line in f), tok)
    print(f"tokenized {len(tokens):,} tokens in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    np.savez(cache, tokens=tokens, offsets=offsets, vocab=np.array([tok.vocab_size]), name=np.array([tok.name]),
             fingerprint=np.array([tok.fingerprint]), eos=np.array([tok.eos_token_ids[0] if tok.eos_token_ids else -1]))
    return tokens, offsets


_BUILD_ONE = """
import json, os, resource, sys, time
import numpy as np
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
from samctl.index.kinds import KINDS, BuildOptions
cache, kind, path, memory, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
data = np.load(cache)
tokens, offsets = data["tokens"], data["offsets"]
if limit:  # the first documents, up to `limit` tokens
    offsets = offsets[: np.searchsorted(offsets, limit, side="right")]
    tokens = tokens[: offsets[-1]]
eos = int(data["eos"][0])
meta = StoreMeta(str(data["name"][0]), str(data["fingerprint"][0]), int(data["vocab"][0]), eos if eos >= 0 else None,
                 BuildConfig(kind=kind, compress=False), CorpusStats(documents=len(offsets) - 1, tokens=len(tokens)))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
entry = KINDS[kind]
structure = entry.build(tokens, offsets, meta, BuildOptions(path=path, memory_limit=memory, threads=1))
built = time.perf_counter()
if not entry.directory:
    save_datastore(path, structure, meta)
end = time.perf_counter()
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
peak = max(own.ru_maxrss, kids.ru_maxrss)
cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime  # loading the tokens included
size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) if os.path.isdir(path) else os.path.getsize(path)
print(json.dumps({"kind": kind, "tokens": int(len(tokens)), "documents": int(len(offsets) - 1), "build_s": built - start,
                  "write_s": end - built, "bytes": size, "bytes_per_token": size / len(tokens),
                  "peak_rss_mb": peak / 1024, "rss_before_build_mb": base / 1024, "cpu_s": cpu, **entry.counts(structure)}))
"""


def build(out: Path, tokenizer: str, kinds: list[str], memory: int, max_tokens: int) -> None:
    tokenize(out, tokenizer)
    cache = out / f"tokens-{tokenizer.replace('/', '_')}.npz"
    for kind in kinds:
        path = out / f"store-{tokenizer.replace('/', '_')}.{kind}"
        proc = subprocess.run([sys.executable, "-c", _BUILD_ONE, str(cache), kind, str(path), str(memory),
                               str(max_tokens)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{kind}: failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        result = {"step": "build", "tokenizer": tokenizer, **json.loads(proc.stdout), **_machine()}
        _record(out, result)
        print(f"| {kind} | {result['tokens']:,} | {result['build_s']:.1f} s (+ write {result['write_s']:.1f} s) | "
              f"{result['bytes_per_token']:.2f} | {result['peak_rss_mb']:,.0f} MB |")


def held_out_traces(tok, n: int) -> list:
    """Up to n replay traces from HELD_OUT's .py files of 2-20k characters: a file's first half
    (in tokens) as the prompt, the next 256 tokens as the output."""
    from samctl.decode.simulate import make_trace

    traces = []
    for path in sorted(HELD_OUT.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if 2000 < len(text) < 20000:
            ids = np.array(tok.encode(text), dtype=np.int32)
            half = len(ids) // 2
            traces.append(make_trace(ids[:half], ids[half:half + 256]))
        if len(traces) >= n:
            break
    return traces


def draft(out: Path, tokenizer: str, kinds: list[str], n_traces: int) -> None:
    import torch

    from samctl.decode.methods import MethodConfig, make_drafter
    from samctl.decode.simulate import replay
    from samctl.index.load import load_datastore
    from samctl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    traces = held_out_traces(tok, n_traces)
    stores = {"none": None}
    for kind in kinds:
        path = out / f"store-{tokenizer.replace('/', '_')}.{kind}"
        if path.exists():
            stores[kind] = load_datastore(path).structure
    for name, static in stores.items():
        for method in ("sam", "adaptive"):
            drafter = make_drafter(method, vocab_size=tok.vocab_size, device=torch.device("cpu"),
                                   eos_token_ids=tuple(tok.eos_token_ids), static=static, config=MethodConfig())
            steps_us, accepted, steps = [], 0, 0
            for trace in traces:
                m = replay(drafter, trace).to_dict()
                steps_us.append((m["draft_us_median"], m["draft_us_p90"], m["steps"]))
                accepted += m["new_tokens"]
                steps += m["steps"]
            # per-trace medians and p90s, weighted by steps: one number per store and method
            med = float(np.average([s[0] for s in steps_us], weights=[s[2] for s in steps_us]))
            p90 = float(np.average([s[1] for s in steps_us], weights=[s[2] for s in steps_us]))
            result = {"step": "draft", "tokenizer": tokenizer, "store": name, "method": method, "traces": len(traces),
                      "steps": steps, "tokens_per_step": accepted / max(steps, 1), "draft_us_median": med,
                      "draft_us_p90": p90, **_machine()}
            _record(out, result)
            print(f"| {name} | {method} | {len(traces)} traces, {steps:,} steps | {accepted / max(steps, 1):.2f} | "
                  f"{med:.1f} | {p90:.1f} |")


def _machine() -> dict:
    return {"machine": f"{platform.machine()} {os.cpu_count()} cores", "load": os.getloadavg()[0],
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _record(out: Path, result: dict) -> None:
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["assemble", "build", "draft"])
    parser.add_argument("--out", type=Path, default=Path("out/corpus"))
    parser.add_argument("--max-mb", type=float, default=300)
    parser.add_argument("--wheels", type=Path, help="a folder of downloaded wheels whose sources come after the installed ones")
    parser.add_argument("--tokenizer", default="bytes")
    parser.add_argument("--kinds", default="sa,ngram,sam")
    parser.add_argument("--memory", type=int, default=4 << 30, help="bytes the sa sort may hold")
    parser.add_argument("--traces", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=0, help="build over the first documents, up to this many tokens")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    if args.step == "assemble":
        assemble(args.out, int(args.max_mb * 1e6), args.wheels)
    elif args.step == "build":
        build(args.out, args.tokenizer, kinds, args.memory, args.max_tokens)
    else:
        draft(args.out, args.tokenizer, kinds, args.traces)


if __name__ == "__main__":
    main()
