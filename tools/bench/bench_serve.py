"""Benchmark `samctl serve` end to end over HTTP at 1, 4 and 16 concurrent clients, with and without
Predicted Outputs, and the same load against `transformers serve` when its URL is given.

The workload is code editing: each request asks to rename a parameter in one function taken from
samctl/data/sample_corpus (16 distinct functions, parsed with `ast`), through the chat template;
its `prediction` is the function as it is. At c clients, max(c x --per-client, --min-requests)
requests are sent by c threads, request i editing function i mod 16, so no two concurrent
requests repeat.
The samctl server runs in this process (uvicorn on a free local port, the app of samctl.server on
the batched engine, --batch-size rows). Every configuration first runs once untimed; within a
round, the configurations alternate in order. Reported per configuration and client count
(medians over rounds): completion tokens per wall second, requests/s, p50 and p99 request latency,
tokens per verify step, accepted / rejected prediction tokens.

    python tools/bench/bench_serve.py --model /work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 1 \
        --clients 1,4,16 --batch-size 16 --max-tokens 96 --rounds 2 \
        [--transformers-url http://127.0.0.1:8011]   # a running `transformers serve MODEL_FOLDER`
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from samctl.server import create_app  # noqa: E402
from samctl.session import Session, SessionConfig  # noqa: E402

CORPUS = ROOT / "samctl" / "data" / "sample_corpus"


def edits(n: int = 16) -> list[tuple[str, str]]:
    """n (prompt, prediction) pairs: functions of 6..24 lines from the sample corpus, each with an
    instruction to rename its first parameter; the prediction is the function unchanged."""
    out = []
    for path in sorted(CORPUS.glob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef) or not 6 <= node.end_lineno - node.lineno + 1 <= 24:
                continue
            params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            if not params:
                continue
            code = "\n".join(lines[node.lineno - 1: node.end_lineno])
            indent = len(code) - len(code.lstrip())
            code = "\n".join(line[indent:] for line in code.splitlines())
            prompt = (f"Rewrite this function with the following change: rename `{params[0]}` to "
                      f"`{params[0]}_value` everywhere.\n\n```python\n{code}\n```")
            out.append((prompt, code))
            if len(out) == n:
                return out
    return out


def serve(session: Session, batch_size: int) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(session, batch_size=batch_size)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def run(url: str, bodies: list[dict], clients: int) -> dict:
    """Every body once, from `clients` concurrent clients -> rates and latencies."""
    def one(body: dict) -> tuple[float, dict]:
        tic = time.perf_counter()
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
        response.raise_for_status()
        return time.perf_counter() - tic, response.json()["usage"]

    wall = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, bodies))
    wall = time.perf_counter() - wall
    tokens = sum(u["completion_tokens"] for _, u in done)
    latencies = sorted(t for t, _ in done)
    details = [u.get("completion_tokens_details") or {} for _, u in done]
    return {"requests": len(bodies), "tokens": tokens, "wall_s": wall, "req_per_s": len(bodies) / wall,
            "tok_per_s": tokens / wall, "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "tokens_per_step": statistics.mean(u.get("mean_acceptance_length", 1.0) for _, u in done),
            "accepted_prediction": statistics.mean(d.get("accepted_prediction_tokens", 0) for d in details),
            "rejected_prediction": statistics.mean(d.get("rejected_prediction_tokens", 0) for d in details)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder or .gguf file (default: the embedded model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="the samctl server's rows in flight")
    p.add_argument("--clients", default="1,4,16", help="comma-separated concurrent clients")
    p.add_argument("--per-client", type=int, default=1, help="requests each client sends in a cell, one after "
                   "the other (1: one wave of c requests; more: the batch stays full between waves)")
    p.add_argument("--min-requests", type=int, default=4, help="requests per cell at least")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--quantize", choices=("none", "int8"), default="none", help="the server's linear layers")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--memory", type=int, default=0, help="adaptive's cross-request memory (default 0: the rounds "
                   "repeat the requests, so the memory alone would draft every answer after the first round)")
    p.add_argument("--transformers-url", default=None, help="a running `transformers serve` to load the same way")
    p.add_argument("--transformers-model", default=None, help="the model id it serves (default: its first)")
    args = p.parse_args()

    session = Session(SessionConfig(model=args.model, threads=args.threads, settings={"memory": args.memory},
                                    quantize=args.quantize, quiet=True))
    server, url = serve(session, args.batch_size)
    pairs = edits()

    def bodies(model: str, prediction: bool, n: int, extra: dict) -> list[dict]:
        out = []
        for i in range(n):
            prompt, code = pairs[i % len(pairs)]
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                    "temperature": 0, **extra}
            if prediction:
                body["prediction"] = {"type": "content", "content": code}
            out.append(body)
        return out

    targets = {"samctl adaptive": (url, session.engine.name, False, {}),
               "samctl adaptive+prediction": (url, session.engine.name, True, {})}
    if args.transformers_url:
        model = args.transformers_model or httpx.get(f"{args.transformers_url}/v1/models").json()["data"][0]["id"]
        targets["transformers serve"] = (args.transformers_url, model, False, {})
    for name, (base, model, prediction, extra) in targets.items():  # untimed: warm-up, cost curves, JIT caches
        run(base, bodies(model, prediction, 2, extra), 2)
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for clients in (int(c) for c in args.clients.split(",")):
            names = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in names:
                base, model, prediction, extra = targets[name]
                n = max(clients * args.per_client, args.min_requests)
                results.setdefault(f"{name} x{clients}", []).append(run(base, bodies(model, prediction, n, extra),
                                                                        clients))
                print(f"round {r} {name} x{clients}: {results[f'{name} x{clients}'][-1]['tok_per_s']:.1f} tok/s "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    server.should_exit = True
    print("| configuration | tok/s | req/s | p50 latency s | p99 latency s | tokens/step | accepted / rejected prediction |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"| {name} | {med['tok_per_s']:.1f} | {med['req_per_s']:.2f} | {med['p50_s']:.2f} | {med['p99_s']:.2f} | "
              f"{med['tokens_per_step']:.2f} | {med['accepted_prediction']:.0f} / {med['rejected_prediction']:.0f} |")
    print(json.dumps({"model": session.engine.name, "threads": args.threads, "batch_size": args.batch_size,
                      "memory": args.memory, "max_tokens": args.max_tokens, "load_avg": os.getloadavg(),
                      "results": results}), file=sys.stderr)


if __name__ == "__main__":
    main()
