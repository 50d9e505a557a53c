"""Benchmark the draft-model methods (sd with several K, specdec++, sam+draft) against `ar`.

    python tools/bench/bench_draft_methods.py --target samctl/models/default/target \
        --draft samctl/models/default/draft --acc-head samctl/models/default/acc_head \
        --prompts ../shared/data/codealpaca.json --num-prompts 20 --max-new-tokens 128 --gammas 2 4 6

Greedy decoding through samctl's loop, one target/draft pair loaded once. For every prompt each
method runs in turn (interleaved, so slow drifts of a shared machine hit all methods alike) after
one warm-up generation per method; each prompt runs --repeats times per method and its time is the
median. Counting follows Spec-Bench's (as samctl/bench_report.py):
- mean accepted tokens (MAT): tokens committed per target forward, bonus included (ar = 1.00),
  over all prompts;
- acceptance rate: accepted drafted tokens / drafted tokens, over all prompts;
- tokens/s: the mean over prompts of each prompt's rate, prefill included; speedup = that mean
  over ar's (a ratio of means of per-prompt rates, as Spec-Bench).
Every method's output is checked equal to ar's, token for token.

Prompts: an Alpaca-shape JSON list (shuffled with --seed exactly as `samctl train acc-head`
does, then taken from the end, so they are not among the head's training prompts as long as both
counts fit in the file) or a Spec-Bench JSONL (first turn of each row, in file order).
Writes a JSON record to --out and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from samctl.decode.drafters.base import NoDraft  # noqa: E402
from samctl.decode.configs import DraftConfig, SpecDecConfig  # noqa: E402
from samctl.decode.loop import GenerationConfig, generate  # noqa: E402
from samctl.decode.methods import MethodConfig  # noqa: E402
from samctl.index.errors import UserError  # noqa: E402
from samctl.heads import load_acc_head  # noqa: E402
from samctl.models import load_draft, load_engine  # noqa: E402
from samctl.session import build_drafter  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--acc-head", nargs="+", default=[], help="SpecDec++ head folder(s); specdec++ is skipped without one")
    ap.add_argument("--prompts", required=True, help="Alpaca-shape JSON list or Spec-Bench JSONL")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--stop-thresholds", type=float, nargs="+", default=[0.3])
    ap.add_argument("--bounds", type=int, nargs=2, default=[2, 20], metavar=("MIN", "MAX"))
    ap.add_argument("--sam-draft", action="store_true", help="also run sam+draft (gamma = the middle of --gammas)")
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="runs per prompt and method; times are their median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", help="JSON record of the run")
    return ap.parse_args(argv)


def read_prompts(path: str, n: int, seed: int) -> list[str]:
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return [row["turns"][0] for row in rows if row.get("turns")][:n]
    rows = json.loads(Path(path).read_text(encoding="utf-8"))
    texts = [r["instruction"] + (f"\n\n{r['input']}" if isinstance(r.get("input"), str) and r["input"].strip() else "")
             for r in rows if isinstance(r, dict) and isinstance(r.get("instruction"), str) and r["instruction"].strip()]
    random.Random(seed).shuffle(texts)  # the same order as `samctl train acc-head`
    return texts[-n:]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = load_engine(args.target, args.device, args.dtype)
    draft = load_draft(args.draft, engine)
    heads = {Path(path).name: load_acc_head(path, engine, draft) for path in args.acc_head}
    chat = not args.no_chat and bool(getattr(engine.tokenizer, "chat_template", None))
    prompts = [engine.encode(t, chat) for t in read_prompts(args.prompts, args.num_prompts, args.seed)]
    if not prompts:
        raise UserError(f"no prompts in {args.prompts}")

    methods: dict[str, object] = {"ar": lambda: NoDraft()}
    for gamma in args.gammas:
        config = MethodConfig(draft=DraftConfig(gamma=gamma))
        methods[f"sd K={gamma}"] = lambda c=config: build_drafter("sd", engine, None, c, draft=draft)
    for head_name, head in heads.items():
        for threshold in args.stop_thresholds:
            config = MethodConfig(specdec=SpecDecConfig(threshold, *args.bounds))
            label = f"specdec++ {head_name} thr={threshold}" if len(heads) > 1 else f"specdec++ thr={threshold}"
            methods[label] = lambda c=config, h=head: build_drafter("specdec++", engine, None, c, draft=draft, head=h)
    if args.sam_draft:
        config = MethodConfig(draft=DraftConfig(gamma=sorted(args.gammas)[len(args.gammas) // 2]))
        methods["sam+draft"] = lambda c=config: build_drafter("sam+draft", engine, None, c, draft=draft)
    drafters = {name: make() for name, make in methods.items()}

    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=engine.eos_token_ids)
    for drafter in drafters.values():  # warm-up: first-call costs stay out of the numbers
        generate(engine.target, drafter, prompts[0], GenerationConfig(max_new_tokens=16))
    runs: dict[str, list[dict]] = {name: [] for name in drafters}
    mismatches = {name: 0 for name in drafters}
    start = time.perf_counter()
    for ids in prompts:
        reference = None
        times: dict[str, list[float]] = {name: [] for name in drafters}
        for _ in range(args.repeats):
            for name, drafter in drafters.items():
                result = generate(engine.target, drafter, ids, gen)
                times[name].append(result.metrics.time_s)
                if len(times[name]) > 1:
                    continue  # greedy: every repeat commits the same tokens in the same steps
                reference = result.tokens if reference is None else reference
                mismatches[name] += result.tokens != reference
                runs[name].append(result.metrics.to_dict())
        for name, measured in times.items():
            record = runs[name][-1]
            scale = statistics.median(measured) / record["time_s"]
            for key in ("time_s", "draft_s", "verify_s", "other_s", "prefill_s"):
                record[key] = round(record[key] * scale, 6)  # the first run's split, at the median time
            record["tokens_per_s"] = round(record["new_tokens"] / record["time_s"], 3)
            record["times_s"] = [round(t, 6) for t in measured]
    wall = time.perf_counter() - start

    summary = {name: aggregate(records) for name, records in runs.items()}
    base = summary["ar"]["tokens_per_s"]
    for name in summary:
        summary[name]["speedup"] = round(summary[name]["tokens_per_s"] / base, 3) if base else None
        summary[name]["greedy_mismatches"] = mismatches[name]
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "wall_s": round(wall, 1),
        "specdec": {"heads": args.acc_head, "stop_thresholds": args.stop_thresholds, "bounds": args.bounds},
        "summary": summary, "per_prompt": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(markdown(summary))
    return record


def aggregate(records: list[dict]) -> dict:
    steps = sum(r["steps"] for r in records)
    drafted = sum(r["drafted"] for r in records)
    return {
        "new_tokens": sum(r["new_tokens"] for r in records),
        "mean_accepted": round(sum(r["new_tokens"] - 1 for r in records) / steps, 3) if steps else 0.0,
        "acceptance_rate": round(sum(r["accepted"] for r in records) / drafted, 3) if drafted else None,
        "mean_draft_len": round(drafted / steps, 2) if steps else 0.0,
        "tokens_per_s": round(statistics.fmean(r["tokens_per_s"] for r in records), 2),
        "draft_share": round(sum(r["draft_s"] for r in records) / sum(r["time_s"] for r in records), 3),
    }


def markdown(summary: dict) -> str:
    lines = ["| method | MAT (tokens/step) | acceptance rate | drafted/step | tokens/s | speedup | draft time share | greedy = ar |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        rate = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.3f}"
        lines.append(f"| {name} | {s['mean_accepted']:.2f} | {rate} | {s['mean_draft_len']:.2f} | "
                     f"{s['tokens_per_s']:.1f} | {s['speedup']:.2f}x | {s['draft_share']:.2f} | "
                     f"{'yes' if s['greedy_mismatches'] == 0 else 'NO: ' + str(s['greedy_mismatches'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        print(f"bench_draft_methods: {err}", file=sys.stderr)
        sys.exit(2)
