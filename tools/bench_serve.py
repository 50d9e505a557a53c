"""Benchmark `samctl serve` end to end over HTTP: requests/s, tokens/s and latency, with and without
Predicted Outputs, and plain decoding (`method: ar`) beside them, at 1 and more concurrent clients.

The server runs in this process (uvicorn on a free local port, the app of samctl.server) so that
the CPU time of the whole thing (HTTP, JSON, decoding) is measured with `time.process_time`,
far steadier than wall time on a busy shared machine. The workload is a code edit: the prompt
holds a file and an instruction, the prediction is the file as it is. Each configuration first
runs once untimed; within a round the configurations alternate.

    python tools/bench_serve.py --prompt samctl/data/prompts/code_edit.txt --rounds 3 --clients 1,4
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from samctl.server import create_app  # noqa: E402
from samctl.session import Session, SessionConfig  # noqa: E402


def serve(session: Session) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(session), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def run(url: str, body: dict, clients: int, requests: int) -> dict:
    """`requests` requests from `clients` concurrent clients -> rates and latencies."""
    def one(_: int) -> tuple[float, dict]:
        tic = time.perf_counter()
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        return time.perf_counter() - tic, answer["usage"]

    wall, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, range(requests)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(u["completion_tokens"] for _, u in done)
    latencies = sorted(t for t, _ in done)
    return {"requests": requests, "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
            "req_per_s": requests / wall, "tok_per_s": tokens / wall, "tok_per_cpu_s": tokens / cpu,
            "p50_s": statistics.median(latencies), "max_s": latencies[-1],
            "mean_acceptance_length": statistics.mean(u["mean_acceptance_length"] for _, u in done),
            "accepted_prediction": statistics.mean(u["completion_tokens_details"]["accepted_prediction_tokens"]
                                                   for _, u in done),
            "rejected_prediction": statistics.mean(u["completion_tokens_details"]["rejected_prediction_tokens"]
                                                   for _, u in done)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--prompt", default=str(ROOT / "samctl/data/prompts/code_edit.txt"))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default="1,4", help="comma-separated concurrent clients")
    p.add_argument("--requests", type=int, default=4, help="requests per configuration and round")
    p.add_argument("--memory", type=int, default=None, help="adaptive's cross-request memory (0: off; the "
                   "requests repeat, so the memory alone drafts the whole answer after the first)")
    args = p.parse_args()

    text = Path(args.prompt).read_text()
    code = re.search(r"```\w*\n(.*?)```", text, re.S)
    prediction = code.group(1) if code else text
    settings = {} if args.memory is None else {"memory": args.memory}
    session = Session(SessionConfig(model=args.model, threads=args.threads, settings=settings, quiet=True))
    server, url = serve(session)
    base = {"model": session.engine.name, "messages": [{"role": "user", "content": text}],
            "max_tokens": args.max_tokens}
    configs = {"ar": {**base, "method": "ar"}, "adaptive": base,
               "adaptive+prediction": {**base, "prediction": {"type": "content", "content": prediction}}}
    for body in configs.values():  # untimed: warm-up, cost curve, JIT caches
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    results: dict[str, list[dict]] = {}
    for clients in (int(c) for c in args.clients.split(",")):
        for r in range(args.rounds):
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in names:
                results.setdefault(f"{name} x{clients}", []).append(run(url, configs[name], clients, args.requests))
    server.should_exit = True
    print("| configuration | req/s | tok/s | tok/CPU-s | p50 latency s | tokens/step | accepted / rejected prediction |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"| {name} | {med['req_per_s']:.2f} | {med['tok_per_s']:.1f} | {med['tok_per_cpu_s']:.1f} | "
              f"{med['p50_s']:.2f} | {med['mean_acceptance_length']:.2f} | "
              f"{med['accepted_prediction']:.0f} / {med['rejected_prediction']:.0f} |")
    print(json.dumps({"model": session.engine.name, "threads": args.threads, "memory": args.memory, "max_tokens": args.max_tokens,
                      "results": results}), file=sys.stderr)


if __name__ == "__main__":
    main()
