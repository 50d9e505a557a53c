"""Benchmark the datastore structures in index/ on the Python standard library's source.

Measures, on ~8M tokens and a 1M-token slice (documents = source files, never split):
build throughput and peak memory of the suffix automaton against the dict-per-state design that
SAM-Decoding ships (run in child processes of this script, so the ratios share a machine state),
store size with and without compression, load time (memory map + validation) against pickle,
per-call cost of streaming `step` and a 16-token `continuation`, and the n-gram table.

    python tools/bench/bench_index.py                      # prints a Markdown table and a JSON line
    python tools/bench/bench_index.py --tokens 2000000 --slice 500000 --skip-dict-full

Tokenized ids are cached in out/bench_index/ (gitignored). The tokenizer argument is a folder
with a SentencePiece `tokenizer.model` (read with `sentencepiece` directly, which gives the same
ids as transformers' LlamaTokenizer) or a `tokenizer.json` (read with `tokenizers`).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_TOKENIZER = Path("/work/shared/data/tokenizers/llama2")
CACHE = ROOT / "out" / "bench_index"


# ---------------------------------------------------------------------------------------------
# The reference: SAM-Decoding's automaton design (a Python dict of transitions per state)
# ---------------------------------------------------------------------------------------------


class DictSAM:
    """Lists `next` (one dict per state), `link`, `length`, `min_endpos`, as in SAM-Decoding,
    extended to the same generalized construction (restart per document) as index/automaton.py
    so both build the same automaton."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.min_endpos = [0]

    def _clone(self, q: int, length: int) -> int:
        self.next.append(self.next[q].copy())
        self.link.append(self.link[q])
        self.length.append(length)
        self.min_endpos.append(self.min_endpos[q])
        return len(self.length) - 1

    def _split(self, p: int, token: int, q: int) -> int:
        clone = self._clone(q, self.length[p] + 1)
        self.link[q] = clone
        while p != -1 and self.next[p].get(token) == q:
            self.next[p][token] = clone
            p = self.link[p]
        return clone

    def _add(self, last: int, token: int, pos: int) -> int:
        q = self.next[last].get(token)
        if q is not None:
            if self.length[last] + 1 == self.length[q]:
                return q
            return self._split(last, token, q)
        cur = len(self.length)
        self.next.append({})
        self.link.append(0)
        self.length.append(self.length[last] + 1)
        self.min_endpos.append(pos)
        p = last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                self.link[cur] = self._split(p, token, q)
        return cur

    def add_documents(self, tokens: list[int], offsets: list[int]) -> None:
        pos = 0
        for d in range(len(offsets) - 1):
            last = 0
            for token in tokens[offsets[d] : offsets[d + 1]]:
                last = self._add(last, token, pos)
                pos += 1
            pos += 1  # the separator position, as in the flat automaton's buffer


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def stdlib_files(stdlib: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))


def load_encoder(path: Path):
    if (path / "tokenizer.model").exists():
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
        return lambda texts: sp.encode(texts), sp.get_piece_size()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)], tok.get_vocab_size()


def corpus(stdlib: Path, tokenizer: Path, max_tokens: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens [n] int32, doc_offsets [d+1] int64, facts): whole files up to max_tokens."""
    CACHE.mkdir(parents=True, exist_ok=True)
    cache = CACHE / f"stdlib_{tokenizer.name}_{max_tokens}.npz"
    if cache.exists():
        z = np.load(cache)
        return z["tokens"], z["offsets"], json.loads(str(z["facts"]))
    encode, vocab = load_encoder(tokenizer)
    files, lengths, chunks, n, chars = stdlib_files(stdlib), [], [], 0, 0
    t0 = time.perf_counter()
    for i in range(0, len(files), 64):
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[i : i + 64]]
        for text, ids in zip(texts, encode(texts)):
            if n >= max_tokens:
                break
            chunks.append(np.asarray(ids, dtype=np.int32))
            lengths.append(len(ids))
            n += len(ids)
            chars += len(text)
    seconds = time.perf_counter() - t0
    tokens = np.concatenate(chunks)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    facts = {"files": len(lengths), "chars": chars, "tokenize_s": seconds, "vocab": vocab,
             "tokenizer": str(tokenizer), "stdlib": str(stdlib)}
    np.savez(cache, tokens=tokens, offsets=offsets, facts=json.dumps(facts))
    return tokens, offsets, facts


def head(tokens: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first whole documents holding at least n tokens (or all)."""
    d = int(np.searchsorted(offsets, n))
    d = min(d, len(offsets) - 1)
    return tokens[: offsets[d]], offsets[: d + 1]


# ---------------------------------------------------------------------------------------------
# Child processes: one build each, peak memory from the kernel's high-water mark
# ---------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(build) -> dict:
    """Run build(); seconds and peak resident memory added while it ran (bytes)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    result = build()
    seconds = time.perf_counter() - t0
    peak = _rss_kib("VmHWM")
    return {"seconds": seconds, "peak_bytes": (peak - before) * 1024, "result": result}


def cold_load(path: str) -> dict:
    """A fresh process: import time, then the first and second load of the store (the first one
    also loads the compiled kernels from numba's cache)."""
    t0 = time.perf_counter()
    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.store import read_store

    out = {"import_s": time.perf_counter() - t0}
    for key in ("first_load_s", "second_load_s"):
        t0 = time.perf_counter()
        sam = SuffixAutomaton.from_arrays(read_store(path).arrays)
        sam.step(0, 0, 1)
        out[key] = time.perf_counter() - t0
    return out


def child(task: str, n: int, args: argparse.Namespace) -> dict:
    if task == "load":
        return cold_load(args.path)
    tokens, offsets, _ = corpus(Path(args.stdlib), Path(args.tokenizer), args.tokens)
    tokens, offsets = head(tokens, offsets, n)
    tokens, offsets = tokens.copy(), offsets.copy()
    out: dict = {"tokens": int(len(tokens)), "docs": int(len(offsets) - 1)}
    if task == "sam":
        from samctl.index.automaton import SuffixAutomaton

        SuffixAutomaton.build(tokens[:1000], np.array([0, 1000]))  # compile outside the measurement
        m = _measure(lambda: SuffixAutomaton.build(tokens, offsets))
        sam = m.pop("result")
        out.update(m, states=sam.num_states, edges=sam.num_edges,
                   bytes=sum(a.nbytes for a in sam.to_arrays().values()))
    elif task == "ngram":
        from samctl.index.ngram import NgramConfig, NgramTable

        NgramTable.build(tokens[:1000], np.array([0, 1000]), NgramConfig())
        m = _measure(lambda: NgramTable.build(tokens, offsets, NgramConfig()))
        table = m.pop("result")
        out.update(m, contexts=table.num_contexts, entries=table.num_entries, bytes=table.nbytes,
                   config=vars(table.config) if hasattr(table.config, "__dict__") else str(table.config))
    elif task == "dict":
        as_list, off_list = tokens.tolist(), offsets.tolist()
        m = _measure(lambda: DictSAM().add_documents(as_list, off_list) or None)
        out.update(m)
        # build again outside the measurement to pickle it (the measured one is gone)
        sam = DictSAM()
        sam.add_documents(as_list, off_list)
        out["states"] = len(sam.length)
        out["edges"] = sum(len(d) for d in sam.next)
        with tempfile.NamedTemporaryFile(dir=CACHE, suffix=".pkl", delete=False) as f:
            t0 = time.perf_counter()
            pickle.dump(sam, f, protocol=pickle.HIGHEST_PROTOCOL)
            out["pickle_dump_s"] = time.perf_counter() - t0
        out["pickle_bytes"] = os.path.getsize(f.name)
        del sam
        gc.collect()
        t0 = time.perf_counter()
        with open(f.name, "rb") as fh:
            pickle.load(fh)
        out["pickle_load_s"] = time.perf_counter() - t0
        os.unlink(f.name)
    out.pop("result", None)
    return out


def run_child(task: str, n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", task, "--n", str(n), "--tokens", str(args.tokens),
           "--stdlib", args.stdlib, "--tokenizer", args.tokenizer]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"child {task} {n} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# In-process measurements: store, load, per-call query cost
# ---------------------------------------------------------------------------------------------


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over repeats of the mean time per call, microseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return float(np.median(times))


def build_ratio(tokens: np.ndarray, offsets: np.ndarray, repeats: int) -> dict:
    """Flat versus dict automaton build on the same tokens, alternating in this process so that
    both see the same machine load; medians of `repeats` runs each."""
    from samctl.index.automaton import SuffixAutomaton

    SuffixAutomaton.build(tokens[:1000], np.array([0, 1000]))  # compile first
    as_list, off_list = tokens.tolist(), offsets.tolist()
    flat, ref = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sam = SuffixAutomaton.build(tokens, offsets)
        flat.append(time.perf_counter() - t0)
        del sam
        gc.collect()
        t0 = time.perf_counter()
        d = DictSAM()
        d.add_documents(as_list, off_list)
        ref.append(time.perf_counter() - t0)
        del d
        gc.collect()
    return {"tokens": int(len(tokens)), "flat_s": flat, "dict_s": ref,
            "flat_tps": len(tokens) / float(np.median(flat)), "dict_tps": len(tokens) / float(np.median(ref)),
            "ratio": float(np.median(ref) / np.median(flat))}


def query_costs(sam, queries: np.ndarray) -> dict:
    from samctl.index.automaton import sam_continuation_span, sam_step

    q = queries.tolist()
    pairs = []
    state, length = 0, 0
    for token in q:
        state, length = sam.step(state, length, token)
        pairs.append((state, length))
    states = [s for s, _ in pairs]

    def stream():
        s, n = 0, 0
        for token in q:
            s, n = sam.step(s, n, token)

    def cont():
        for s in states:
            sam.continuation(s, 16)

    arrays = sam.kernel_arrays

    def stream_kernel():
        st, ed, sl = arrays.states, arrays.edges, arrays.slots
        s, n = 0, 0
        for token in q:
            s, n = sam_step(st, ed, sl, s, n, token)

    def cont_kernel():
        st, buf, nb, col = arrays.states, arrays.tokens, arrays.n_tokens, arrays.end_col
        for s in states:
            sam_continuation_span(st, buf, nb, s, 16, col)

    def empty_loop():
        for token in q:
            pass

    lengths = np.array([n for _, n in pairs])
    cont_lens = [len(sam.continuation(s, 16)) for s in states[:20000]]
    return {
        "step_us": per_call_us(stream, len(q)),
        "continuation16_us": per_call_us(cont, len(q)),
        "step_kernel_us": per_call_us(stream_kernel, len(q)),
        "continuation16_kernel_us": per_call_us(cont_kernel, len(q)),
        "python_loop_us": per_call_us(empty_loop, len(q)),
        "mean_match_len": float(lengths.mean()),
        "mean_continuation_len": float(np.mean(cont_lens)),
        "calls": len(q),
    }


def store_costs(sam, table, path: Path) -> dict:
    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.store import read_store, write_store

    out = {}
    arrays = sam.to_arrays()
    for compress in (False, True):
        t0 = time.perf_counter()
        write_store(path, {"kind": "sam"}, arrays, compress=compress)
        key = "zstd" if compress else "raw"
        out[f"write_{key}_s"] = time.perf_counter() - t0
        out[f"file_{key}_bytes"] = path.stat().st_size
        for check_links in (True, False):
            loads = []
            for _ in range(5):
                t0 = time.perf_counter()
                store = read_store(path)
                loaded = SuffixAutomaton.from_arrays(store.arrays, check_links=check_links)
                loads.append(time.perf_counter() - t0)
                del loaded, store
            out[f"load_{key}{'' if check_links else '_nolinks'}_s"] = float(np.median(loads))
    write_store(path, {"kind": "sam"}, arrays, compress=False)
    res = subprocess.run([sys.executable, __file__, "--child", "load", "--path", str(path)],
                         capture_output=True, text=True, check=True)
    out["cold"] = json.loads(res.stdout.strip().splitlines()[-1])
    write_store(path, {"kind": "ngram"}, table.to_arrays(), compress=False)
    out["ngram_file_raw_bytes"] = path.stat().st_size
    write_store(path, {"kind": "ngram"}, table.to_arrays(), compress=True)
    out["ngram_file_zstd_bytes"] = path.stat().st_size
    path.unlink()
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}"


def markdown(r: dict) -> str:
    mb = 1e6
    s1, d1, s8 = r["sam_slice"], r["dict_slice"], r["sam_full"]
    d8 = r.get("dict_full")
    g8, st, q, ra = r["ngram_full"], r["store"], r["queries"], r["ratio"]
    f = r["facts"]
    rows = [
        ("corpus", f"{f['files']} stdlib files, {s8['tokens']:,} tokens ({r['slice_tokens']:,}-token slice), "
                   f"vocab {f['vocab']:,}; tokenizing took {f['tokenize_s']:.1f} s"),
        (f"build 1M slice, same process, alternating, median of {len(ra['flat_s'])}: tokens/s, flat vs dict",
         f"{ra['flat_tps']:,.0f} vs {ra['dict_tps']:,.0f} (**{ra['ratio']:.1f}x**)"),
        ("build 1M slice, separate processes: tokens/s, flat vs dict", f"{s1['tokens'] / s1['seconds']:,.0f} vs "
         f"{d1['tokens'] / d1['seconds']:,.0f} ({d1['seconds'] / s1['seconds']:.1f}x)"),
        ("build full, separate processes: tokens/s, flat" + (" vs dict" if d8 else ""),
         f"{s8['tokens'] / s8['seconds']:,.0f}" + (f" vs {d8['tokens'] / d8['seconds']:,.0f} "
         f"(**{d8['seconds'] / s8['seconds']:.1f}x**)" if d8 else " (dict not run on the full corpus)")),
        ("peak build memory 1M: bytes/token, flat vs dict", f"{s1['peak_bytes'] / s1['tokens']:.0f} vs "
         f"{d1['peak_bytes'] / d1['tokens']:.0f} (**{s1['peak_bytes'] / d1['peak_bytes']:.2f}x**)"),
        ("peak build memory full: bytes/token, flat" + (" vs dict" if d8 else ""),
         f"{s8['peak_bytes'] / s8['tokens']:.0f}" + (f" vs {d8['peak_bytes'] / d8['tokens']:.0f}" if d8 else "")),
        ("states / transitions per token (full)", f"{s8['states'] / s8['tokens']:.2f} / {s8['edges'] / s8['tokens']:.2f}"),
        ("automaton arrays (full)", f"{s8['bytes'] / mb:.0f} MB = {s8['bytes'] / s8['tokens']:.0f} bytes/token"),
        ("store file (full): raw / zstd", f"{st['file_raw_bytes'] / mb:.0f} MB / {st['file_zstd_bytes'] / mb:.0f} MB "
         f"(write {st['write_raw_s']:.2f} s / {st['write_zstd_s']:.2f} s)"),
        ("load (full), read_store + from_arrays: raw (mmap) / zstd",
         f"**{st['load_raw_s'] * 1e3:.0f} ms** / {st['load_zstd_s'] * 1e3:.0f} ms"),
        ("the same without the link-length check (`check_links=False`)",
         f"**{st['load_raw_nolinks_s'] * 1e3:.0f} ms** / {st['load_zstd_nolinks_s'] * 1e3:.0f} ms"),
        ("load (full, raw) in a fresh process: import, first load (incl. numba cache), second load",
         f"{st['cold']['import_s'] * 1e3:.0f} ms, {st['cold']['first_load_s'] * 1e3:.0f} ms, "
         f"{st['cold']['second_load_s'] * 1e3:.0f} ms"),
        ("dict pickle (1M): size, load", f"{d1['pickle_bytes'] / mb:.0f} MB, {d1['pickle_load_s'] * 1e3:.0f} ms"
         + (f"; full: {d8['pickle_bytes'] / mb:.0f} MB, {d8['pickle_load_s'] * 1e3:.0f} ms" if d8 else
            f"; full (extrapolated x{s8['tokens'] / s1['tokens']:.1f}): ~{d1['pickle_load_s'] * s8['tokens'] / s1['tokens']:.1f} s")),
        ("`step` per call (streaming, Python method / raw kernel)",
         f"**{q['step_us']:.2f} µs** / {q['step_kernel_us']:.2f} µs (mean match length {q['mean_match_len']:.1f})"),
        ("`continuation(state, 16)` per call (method / kernel)",
         f"**{q['continuation16_us']:.2f} µs** / {q['continuation16_kernel_us']:.2f} µs "
         f"(mean {q['mean_continuation_len']:.1f} tokens)"),
        ("empty Python loop per iteration (included above)", f"{q['python_loop_us']:.2f} µs"),
        ("n-gram table (full, max_n 4, min_count 2, top_k 8)",
         f"build {g8['seconds']:.1f} s ({g8['tokens'] / g8['seconds']:,.0f} tokens/s), peak "
         f"{g8['peak_bytes'] / g8['tokens']:.0f} bytes/token; {g8['contexts']:,} contexts, {g8['entries']:,} entries, "
         f"{g8['bytes'] / g8['tokens']:.1f} bytes/token; file raw {st['ngram_file_raw_bytes'] / mb:.0f} MB / zstd "
         f"{st['ngram_file_zstd_bytes'] / mb:.0f} MB"),
    ]
    lines = ["| measure | result |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    ap.add_argument("--tokens", type=int, default=8_000_000, help="corpus size (whole files)")
    ap.add_argument("--slice", type=int, default=1_000_000, help="size of the slice the dict SAM is built on")
    ap.add_argument("--skip-dict-full", action="store_true", help="do not build the dict SAM on the full corpus")
    ap.add_argument("--repeats", type=int, default=3, help="alternating build runs for the speed ratio")
    ap.add_argument("--queries", type=int, default=200_000, help="tokens streamed through step")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.n, args)))
        return

    t0 = time.perf_counter()
    tokens, offsets, facts = corpus(Path(args.stdlib), Path(args.tokenizer), args.tokens)
    print(f"corpus: {len(tokens):,} tokens, {len(offsets) - 1} files ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    r: dict = {"facts": facts, "machine": machine(), "slice_tokens": int(head(tokens, offsets, args.slice)[1][-1])}
    r["ratio"] = build_ratio(*head(tokens, offsets, args.slice), args.repeats)
    print(f"ratio: {r['ratio']}", file=sys.stderr)
    for key, task, n in [("sam_slice", "sam", args.slice), ("dict_slice", "dict", args.slice),
                         ("sam_full", "sam", args.tokens), ("ngram_full", "ngram", args.tokens)] + (
            [] if args.skip_dict_full else [("dict_full", "dict", args.tokens)]):
        r[key] = run_child(task, n, args)
        print(f"{key}: {r[key]}", file=sys.stderr)

    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.ngram import NgramConfig, NgramTable

    sam = SuffixAutomaton.build(tokens, offsets)
    table = NgramTable.build(tokens, offsets, NgramConfig())
    # queries: the corpus' tail, streamed through an automaton over the rest (real matches and misses)
    held_out = int(np.searchsorted(offsets, len(tokens) - args.queries, side="right")) - 1
    body = SuffixAutomaton.build(tokens[: offsets[held_out]], offsets[: held_out + 1])
    r["queries"] = query_costs(body, tokens[offsets[held_out] :])
    print(f"queries: {r['queries']}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        r["store"] = store_costs(sam, table, Path(tmp) / "bench.sam")
    print(f"store: {r['store']}", file=sys.stderr)
    print(f"\nMachine: {r['machine']}\n")
    print(markdown(r))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
