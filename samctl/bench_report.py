"""`samctl bench` results: per-category aggregation, summary.md, summary.json and the speedup plot.

Input: the records bench writes to records.jsonl, one per (method, question).
Counting (Spec-Bench's, with the same token counting on both sides):
    tokens/s of a question = its new tokens over all turns / its wall time over all turns
    speedup               = mean over questions of the method's tokens/s
                            / mean over the same questions of ar's tokens/s
    speedup (total time)  = (total tokens / total time) of the method / the same for ar
    vs hf-greedy          = the speedup computed against hf-greedy (transformers' generate)
                            instead of ar, when the run has it
    mean accepted tokens  = (new tokens - turns) / decode steps, pooled (each turn's first token
                            comes from its prefill); plain decoding: 1.00
    draft share           = drafting time / wall time
A question whose `ar` answer has fewer than MIN_TIMED_TOKENS new tokens is kept out of every
speedup (its time is mostly the prefill and the timer's noise) and listed instead; each table
heading gives n, the questions it averages.
This module knows records and files, not models.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BASELINE = "ar"
HF_BASELINE = "hf-greedy"
OVERALL = "overall"
MIN_TIMED_TOKENS = 8  # shorter answers are listed, not timed into a speedup
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def report_category(category: Any) -> str:
    """The category results are reported under: MT-bench's eight together, as Spec-Bench does."""
    category = str(category) if category not in (None, "") else "uncategorized"
    return "mt_bench" if category in MT_BENCH else category


def short_answers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The questions whose baseline answer is too short to time: question_id, group, new_tokens."""
    return [{"question_id": r["question_id"], "group": r["group"], "new_tokens": r["new_tokens"]}
            for r in records if r["method"] == BASELINE and r["new_tokens"] < MIN_TIMED_TOKENS]


def aggregate(records: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """{group: {method: row}} over the groups in first-seen order, then "overall"; questions with a
    short answer (`short_answers`) are left out of every row."""
    groups = list(dict.fromkeys(r["group"] for r in records))
    short = {(s["question_id"], s["group"]) for s in short_answers(records)}
    records = [r for r in records if (r["question_id"], r["group"]) not in short]
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for group in groups + [OVERALL]:
        rows = [r for r in records if group == OVERALL or r["group"] == group]
        base = _totals([r for r in rows if r["method"] == BASELINE])
        hf = _totals([r for r in rows if r["method"] == HF_BASELINE]) if HF_BASELINE in methods else None
        table[group] = {m: _row(_totals([r for r in rows if r["method"] == m]), base, hf) for m in methods}
    return table


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps_known = all(r["steps"] is not None for r in rows)
    return {
        "questions": len(rows),
        "turns": sum(len(r["turns"]) for r in rows),
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "time_s": sum(r["time_s"] for r in rows),
        "draft_s": sum(r["draft_s"] or 0.0 for r in rows),
        "steps": sum(r["steps"] for r in rows) if steps_known and rows else None,
        "mean_rate": sum(r["tokens_per_s"] for r in rows) / len(rows) if rows else 0.0,
        "mismatched_turns": sum(r["mismatched_turns"] for r in rows),
        "draft_known": all(r["draft_s"] is not None for r in rows),
    }


def _row(t: dict[str, Any], base: dict[str, Any], hf: dict[str, Any] | None) -> dict[str, Any]:
    rate = t["new_tokens"] / t["time_s"] if t["time_s"] > 0 else 0.0
    base_rate = base["new_tokens"] / base["time_s"] if base["time_s"] > 0 else 0.0
    accepted = (t["new_tokens"] - t["turns"]) / t["steps"] if t["steps"] else None
    return {
        "questions": t["questions"],
        "new_tokens": t["new_tokens"],
        "time_s": round(t["time_s"], 4),
        "tokens_per_s": round(t["mean_rate"], 3),
        "speedup": round(t["mean_rate"] / base["mean_rate"], 3) if base["mean_rate"] > 0 else None,
        "speedup_total_time": round(rate / base_rate, 3) if base_rate > 0 else None,
        "speedup_vs_hf_greedy": round(t["mean_rate"] / hf["mean_rate"], 3) if hf and hf["mean_rate"] > 0 else None,
        "mean_accepted": round(accepted, 3) if accepted is not None else None,
        "draft_share": round(t["draft_s"] / t["time_s"], 4) if t["draft_known"] and t["time_s"] > 0 else None,
        "mismatched_turns": t["mismatched_turns"],
    }


_COLUMNS = (("speedup", "speedup"), ("speedup_total_time", "speedup (total time)"),
            ("speedup_vs_hf_greedy", "vs hf-greedy"),
            ("mean_accepted", "accepted tokens/step"), ("tokens_per_s", "tokens/s"),
            ("draft_share", "draft share"), ("mismatched_turns", "greedy mismatches"), ("questions", "questions"))


def markdown(summary: dict[str, Any]) -> str:
    """summary.md: the run's setting, then a table per category and one overall."""
    run = summary["run"]
    lines = ["# samctl bench", ""]
    lines += [f"- {key}: {value}" for key, value in run.items()]
    lines += ["", "Speedup: mean over questions of tokens/s, divided by the same for `ar` (Spec-Bench); "
              "total time: throughput over the whole category against `ar`'s; vs hf-greedy: the Spec-Bench "
              "speedup against transformers' `generate`. Tokens are generated ids up to and including EOS, "
              "capped at max_new_tokens, for every method.", ""]
    short = summary.get("short_answers", [])
    for group, rows in summary["table"].items():
        n = rows[BASELINE]["questions"] if BASELINE in rows else 0
        left_out = sum(1 for s in short if group == OVERALL or s["group"] == group)
        lines += [f"## {group} (n = {n}" + (f"; {left_out} short answer(s) left out" if left_out else "") + ")", "",
                  "| method | " + " | ".join(h for _, h in _COLUMNS) + " |",
                  "|---|" + "---:|" * len(_COLUMNS)]
        for method, row in rows.items():
            lines.append(f"| {method} | " + " | ".join(format_cell(row[k], k) for k, _ in _COLUMNS) + " |")
        lines.append("")
    if short:
        lines += [f"Left out of the speedups: answers shorter than {MIN_TIMED_TOKENS} tokens (mostly prefill and "
                  "timer noise): " + ", ".join(f"question {s['question_id']} ({s['group']}, {s['new_tokens']} "
                                               f"token{'s' if s['new_tokens'] != 1 else ''})" for s in short), ""]
    total = sum(summary["mismatches"].values())
    lines.append(f"Greedy mismatches against `ar` (turns whose tokens differ, over all repeats): {total}"
                 + ("" if not total else " — " + ", ".join(f"{m}: {n}" for m, n in summary["mismatches"].items() if n)))
    return "\n".join(lines) + "\n"


def format_cell(value: Any, key: str) -> str:
    """A table cell of the figure `key`, as summary.md and simulate's tables show it."""
    if value is None:
        return "—"
    if key.startswith("speedup"):
        return f"{value:.2f}x"
    if key == "draft_share":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bar chart of speedup against ar, per category, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    groups = list(summary["table"])
    methods = [m for m in summary["methods"] if m != BASELINE]
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(min(16.0, 3.0 + 1.5 * len(groups)), 4.5))
    for i, method in enumerate(methods):
        values = [summary["table"][g][method]["speedup"] or 0.0 for g in groups]
        ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup vs ar (mean tokens/s ratio)")
    ax.set_title(summary["run"].get("model", ""), fontsize=9)
    ax.legend(fontsize=8, ncol=min(len(methods), 5), loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_summary(out_dir: Path, records: list[dict[str, Any]], methods: list[str], run: dict[str, Any]) -> dict[str, Any]:
    summary = {
        "run": run,
        "methods": methods,
        "table": aggregate(records, methods),
        "short_answers": short_answers(records),
        "min_timed_tokens": MIN_TIMED_TOKENS,
        "mismatches": {m: sum(r["mismatched_turns"] for r in records if r["method"] == m) for m in methods},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out_dir / "summary.md").write_text(markdown(summary), encoding="utf-8")
    plot(summary, out_dir / "speedup.png")
    return summary
