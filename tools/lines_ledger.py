"""Non-blank product lines by component at two commits: where a change in the product's size went.

    python tools/lines_ledger.py e17811b HEAD

Counts what the product-line count counts (`samctl/`, `decode/`, `index/`, Python files, without
`samctl/data/`); each file goes to the first component whose pattern matches its path.
Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess

COMPONENTS = [
    ("native forward and its kernels (int8, attention)",
     r"^decode/engine/(native|int8_forward|int8_gemm|vectors|attention|cpu_linear)\.py$"),
    ("engine (step loop, targets, caches, graphs, cost)", r"^decode/(loop|batch)\.py$|^decode/engine/"),
    ("suffix-array store kind", r"^index/(suffix_array|sa_layout|best_first)\.py$"),
    ("other stores (index/)", r"^index/"),
    ("drafters and methods (decode/)", r"^decode/"),
    ("commands, CLI, options", r"^samctl/(commands/|cli\.py$|options\.py$)"),
    ("server (server, scheduler, OpenAI API, config)", r"^samctl/(server|scheduler|openai_api|config)\.py$"),
    ("trainers", r"^samctl/train/"),
    ("the rest of the library (session, hf, models, tokenizer, records...)", r"^samctl/"),
]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def ledger(rev: str) -> collections.Counter:
    lines: collections.Counter = collections.Counter()
    for path in git("ls-tree", "-r", "--name-only", rev, "samctl", "decode", "index").split():
        if not path.endswith(".py") or path.startswith("samctl/data/"):
            continue
        name = next(name for name, pattern in COMPONENTS if re.search(pattern, path))
        lines[name] += sum(1 for line in git("show", f"{rev}:{path}").splitlines() if line.strip())
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    a, b = ledger(args.before), ledger(args.after)
    print(f"| component | {args.before} | {args.after} | change |\n|---|---:|---:|---:|")
    for name, _ in COMPONENTS + [("**all**", "")]:
        x, y = (sum(a.values()), sum(b.values())) if name == "**all**" else (a[name], b[name])
        print(f"| {name} | {x:,} | {y:,} | {y - x:+,} |")


if __name__ == "__main__":
    main()
