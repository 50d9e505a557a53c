"""Batch-generation throughput on a local Ray instance: 1 worker against 2, interleaved.

One driver process starts local Ray once (--cpus CPUs, no dashboard, a small object store) and
runs the same `samctl generate --input ... --ray --workers W --threads 1` batch for W alternating
1, 2, 1, 2, ... (--rounds pairs). Each run starts its actors afresh (model and store loading
included in its wall time), so the numbers are end-to-end batch throughput. Outputs of every run
are checked equal (text and ids) to the first one's.

    python tools/bench/bench_ray.py --model /work/runs/smollm2 --input /work/runs/ray/bench_prompts.jsonl \\
        --max-new-tokens 48 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from samctl.cli import main as samctl_main  # noqa: E402
from samctl.cluster import LOCAL, start_ray  # noqa: E402


def run(args: list[str]) -> int:
    try:
        samctl_main(args)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def outputs(path: Path) -> tuple[list[dict], int]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    tokens = sum(r.get("metrics", {}).get("new_tokens", 0) for r in records)
    return [{k: v for k, v in r.items() if k != "metrics"} for r in records], tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--sam", default=None)
    parser.add_argument("--max-new-tokens", default="48")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of (1 worker, 2 workers) runs")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    args = parser.parse_args()

    start_ray(LOCAL, num_cpus=args.cpus, object_store_mb=500)
    base = ["generate", "--model", args.model, "--input", args.input, "--max-new-tokens", args.max_new_tokens,
            "--threads", "1", "--quiet", "--ray"] + (["--sam", args.sam] if args.sam else []) \
        + (["--chat"] if args.chat else [])
    walls: dict[int, list[float]] = {1: [], 2: []}
    reference = None
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for workers in ((1, 2) if r % 2 == 0 else (2, 1)):
                out = Path(tmp) / f"out_{r}_{workers}.jsonl"
                tic = time.perf_counter()
                code = run([*base, "--workers", str(workers), "--output", str(out)])
                walls[workers].append(time.perf_counter() - tic)
                records, tokens = outputs(out)
                assert code == 0, f"run exited {code}"
                reference = reference or records
                assert records == reference, "outputs differ between runs"
                print(f"round {r} workers {workers}: {walls[workers][-1]:.1f} s, {tokens} tokens", flush=True)
    one, two = statistics.median(walls[1]), statistics.median(walls[2])
    print(json.dumps({"records": len(reference), "new_tokens": tokens, "wall_1_worker_s": walls[1],
                      "wall_2_workers_s": walls[2], "tokens_per_s_1": round(tokens / one, 2),
                      "tokens_per_s_2": round(tokens / two, 2), "speedup_2_over_1": round(one / two, 3),
                      "per_round_ratio": [round(a / b, 3) for a, b in zip(walls[1], walls[2])]}))


if __name__ == "__main__":
    main()
