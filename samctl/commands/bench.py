"""`samctl bench`: every method on the same questions, in one process, with the same counting.

Protocol: the model, store and drafters load once; every method (ar always) runs a warm-up; then
each question runs through every method in turn, so that slow drifts of the machine hit all alike
(--repeats N: N such rounds, each (method, question) reporting its median-time run). Turn k's prompt
is the conversation so far with the method's own earlier answers. Counting, for every method: new
tokens are generated ids up to and including EOS, capped at --max-new-tokens; time is the wall time
of the whole generation, prefill included. The transformers peers (hf-greedy, hf-pld, hf-assisted)
run `model.generate` with the same max_new_tokens and EOS ids, their target forwards counted by a
forward hook. Every method's greedy tokens are compared with ar's, turn by turn (exit status 1 on a
difference in float32, but for the transformers peers under --quantize int8: they run the float32
model); bench_report describes the output files.
"""
from __future__ import annotations

import copy
import json
import logging
import platform
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import click

from samctl.decode.methods import DRAFT_METHODS, EAGLE_METHODS, METHODS, SELF_DRAFT_METHODS, method as method_entry
from samctl.index.errors import UserError
from samctl.bench_report import BASELINE, report_category, write_summary
from samctl.config import SessionConfig
from samctl.options import SAMPLING, check_count, command_line, parse_methods, session_options
from samctl.plan import plan
from samctl.progress import progress_bar
from samctl.decode.metrics import first_difference
from samctl.textio import ERRORS, check_utf8

if TYPE_CHECKING:  # torch, transformers and the decoder load with the model, not for --help
    from samctl.decode.drafters.base import Drafter
    from samctl.session import Engine, Session

log = logging.getLogger(__name__)
HF_METHODS = ("hf-greedy", "hf-pld", "hf-assisted")
ALL_BENCH_METHODS = METHODS + DRAFT_METHODS + EAGLE_METHODS + SELF_DRAFT_METHODS + HF_METHODS
WARMUP_TOKENS = 16
# Spec-Bench's six reported categories, 26 questions, shipped inside the package (samctl/data/questions)
SAMPLE_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "questions" / "specbench_sample.jsonl"


@dataclass(frozen=True)
class Question:
    qid: Any
    category: str  # as in the file
    group: str  # reported category: mt_bench for MT-bench's eight
    turns: tuple[str, ...]


@dataclass
class Turn:
    tokens: list[int]
    time_s: float
    steps: int | None  # target forwards after the prefill (None: unknown)
    draft_s: float | None  # None: not measured (transformers' generate)
    metrics: dict[str, Any] | None = None  # the engine's full metrics


class Runner(Protocol):
    name: str
    drafter: Drafter | None  # None: transformers' own generate

    def run(self, prompt: list[int], max_new_tokens: int) -> Turn: ...


@click.command("bench")
@session_options(exclude=("method", "memory_file") + SAMPLING, max_new_tokens=128,
                 store={"help": "Static datastore (sam methods, rest): a .sam file or a store directory (sharded, or a suffix array)."})
@click.option("--questions", "questions_path", default=str(SAMPLE_QUESTIONS), show_default=False,
              type=click.Path(exists=True, dir_okay=False),
              help="Spec-Bench-format JSONL: question_id, category, turns [default: the Spec-Bench sample that ships "
                   "with samctl, 26 questions in Spec-Bench's six reported categories].")
@click.option("--methods", "methods_spec", default="ar,adaptive,pld,sam,sam+recycle,recycle,hf-greedy,hf-pld", show_default=True,
              help=f"Comma-separated, from {', '.join(ALL_BENCH_METHODS)}; ar is always run (the baseline).")
@click.option("--limit", type=int, default=None, help="First N questions of each reported category.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Runs per method and question; the median-time run is reported.")
@click.option("--categories", default=None, help="Comma-separated categories to keep (reported or original names, e.g. mt_bench,summarization).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for records.jsonl, summary.md/json, speedup.png.")
def bench(config: SessionConfig, questions_path: str, methods_spec: str, limit: int | None, repeats: int,
          categories: str | None, out_dir: str) -> None:
    """Benchmark methods end to end on a question file: speedup per category against ar.

    \b
    samctl bench --limit 1 --out runs/cpu     # the Spec-Bench sample that ships with samctl
    samctl bench --model M --sam store.sam --questions q.jsonl --methods ar,pld,sam,rest --out runs/x
    """
    check_count("--repeats", repeats)
    methods = parse_methods(methods_spec, ALL_BENCH_METHODS)
    methods = [BASELINE] + [m for m in methods if m != BASELINE]
    questions = read_questions(Path(questions_path), categories, limit)
    import torch

    from samctl.session import Session

    # bench decodes greedily: a draft pair's embedded head is the one trained for that
    config = replace(config, method=BASELINE)
    models = {"draft_model": config.draft_model, "acc_head": config.acc_head, "eagle_head": config.eagle_head}
    base = replace(config, quiet=True, **dict.fromkeys(models))  # ar's: the draft and heads are the methods'
    session = Session(base)
    # ar is the baseline, not a choice: that it reads no store is worth a note only when no
    # benchmarked method reads it either (else the notes are those of the same plan without it)
    reads_store = any(m not in HF_METHODS and method_entry(m).uses_store for m in methods)
    for note in (plan(replace(base, store=None)) if reads_store else session.plan).notes if not config.quiet else ():
        log.info(note)
    engine = session.engine
    runners = {m: _runner(m, session, models) for m in methods}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fits, skipped = fitting_questions(questions, engine, config.max_new_tokens, config.chat)
    if not fits:
        raise UserError(f"no question fits the model's context of {engine.target.max_positions} tokens with "
                        f"--max-new-tokens {config.max_new_tokens}: lower --max-new-tokens")
    if skipped and not config.quiet:
        click.echo(f"samctl: note: skipped {skipped} question(s) whose prompt + max new tokens exceed the "
                   f"model's context ({engine.target.max_positions})", err=True)
    # Graphs are captured now, for the longest question, so that no capture lands in a timed run
    # (and before the cost curve is measured: it is measured in the mode it serves).
    longest = max(context_needed(q, engine, config.max_new_tokens, config.chat) for q in fits)
    from samctl.decode.engine.graphs import enable_cuda_graphs

    enable_cuda_graphs(engine.target, config.graphs, reserve=longest)
    _warm_up(runners, engine, fits[0], config.chat)
    records = _run_all(runners, engine, fits, config, repeats, out_dir / "records.jsonl")
    summary = write_summary(out_dir, records, methods, _run_info(session, config, repeats, methods, len(fits), skipped))
    mismatches = sum(summary["mismatches"].values())
    # float32: greedy output must equal ar's token for token, so a mismatch is a bug. Half
    # precision: verifying several tokens runs other kernels, near-tied argmaxes may flip, and a
    # divergence is reported (records hold each turn's first_difference), not failed.
    exact = engine.target.dtype == torch.float32
    peers_apart = peers_on_another_model(summary["mismatches"], config.quantize)
    failing = mismatches - sum(summary["mismatches"][m] for m in peers_apart)
    turns = sum(len(r["turns"]) * max(1, len(r["repeat_times_s"])) for r in records if r["method"] != BASELINE)
    if not config.quiet:
        overall = summary["table"]["overall"]
        best = max((m for m in methods if m != BASELINE), key=lambda m: overall[m]["speedup"] or 0.0, default=None)
        short = len(summary["short_answers"])
        click.echo(f"samctl: {len(fits)} questions x {len(methods)} methods -> {out_dir}/summary.md"
                   + (f"; best overall: {best} {overall[best]['speedup']:.2f}x" if best and overall[best]["speedup"] else "")
                   + (f" ({short} answer(s) under {summary['min_timed_tokens']} tokens left out)" if short else "")
                   + f"; greedy mismatches against ar: {mismatches}"
                   + ("" if exact or not turns else
                      f" of {turns} turns ({mismatches / turns:.1%}, {engine.target.dtype} near-ties; "
                      "first_difference per turn in records.jsonl)")
                   + (f" ({', '.join(peers_apart)}: transformers' float32 model, not the int8 one)" if peers_apart else ""),
                   err=True)
    if failing and exact:
        sys.exit(1)


def peers_on_another_model(mismatches: dict[str, int], quantize: str) -> list[str]:
    """The transformers peers whose differences from ar are reported, not failed: under --quantize
    int8 they run the float32 model, another model than ar's."""
    return [m for m, n in mismatches.items() if n and m in HF_METHODS] if quantize == "int8" else []


# ---------------------------------------------------------------------------------------------
# questions


def read_questions(path: Path, categories: str | None, limit: int | None) -> list[Question]:
    check_count("--limit", limit)
    questions = []
    for number, line in enumerate(path.read_bytes().decode("utf-8", ERRORS).splitlines(), start=1):
        check_utf8(line, f"{path}:{number}")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{number} is not JSON ({err.msg}): one question object per line") from err
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise UserError(f"{path}:{number} has no `turns` list of text: Spec-Bench format is "
                            '{"question_id": 1, "category": "qa", "turns": ["..."]}')
        category = str(row.get("category", "uncategorized"))
        questions.append(Question(row.get("question_id", number), category, report_category(category), tuple(turns)))
    if categories:
        wanted = {c.strip() for c in categories.split(",") if c.strip()}
        known = {q.group for q in questions} | {q.category for q in questions}
        if wanted - known:
            raise UserError(f"--categories names {', '.join(sorted(wanted - known))}, not in {path}: "
                            f"choose from {', '.join(sorted(known))}")
        questions = [q for q in questions if q.group in wanted or q.category in wanted]
    if limit is not None:
        questions = _first_per_group(questions, limit)
    if not questions:
        raise UserError(f"{path} holds no questions (after --categories): check the file and filter")
    return questions


def _first_per_group(questions: list[Question], limit: int) -> list[Question]:
    """The first `limit` of each group, taking its sub-categories in turn (file order kept)."""
    seen: Counter[str] = Counter()
    ranked = []  # (rank of the question within its category, index)
    for i, q in enumerate(questions):
        ranked.append((seen[q.category], i))
        seen[q.category] += 1
    taken: Counter[str] = Counter()
    chosen = set()
    for _, i in sorted(ranked):
        if taken[questions[i].group] < limit:
            taken[questions[i].group] += 1
            chosen.add(i)
    return [q for i, q in enumerate(questions) if i in chosen]


def fitting_questions(questions: list[Question], engine: Engine, max_new: int, chat: bool) -> tuple[list[Question], int]:
    """Questions whose every turn fits the context; turns after the first assume max_new-token answers."""
    fits = [q for q in questions if context_needed(q, engine, max_new, chat) <= engine.target.max_positions]
    return fits, len(questions) - len(fits)


def context_needed(question: Question, engine: Engine, max_new: int, chat: bool) -> int:
    """Tokens a question's last turn can reach: its turns, max_new-token answers, and a margin per
    turn for the chat template's framing of earlier answers."""
    length = len(engine.encode_conversation([{"role": "user", "content": t} for t in question.turns], chat))
    return length + len(question.turns) * (max_new + 16) + 1


# ---------------------------------------------------------------------------------------------
# runners


class EngineRunner:
    """A samctl method through its session; its drafter stays warm across questions, and every
    repeat of a question starts from the drafter's state before the question (`snapshot` /
    `restore`), so that a repeat measures speed, not what the drafter learned from the one before."""

    def __init__(self, name: str, session: Session) -> None:
        self.name, self.session = name, session
        self.engine, self.drafter = session.engine, session.drafter
        # What every copy of the drafter shares instead of copying: models, heads, the static store.
        self.shared = (self.engine.target, self.engine.model) + session.loaded_parts()

    def snapshot(self) -> Drafter:
        return self._copy(self.drafter)

    def restore(self, state: Drafter, last: bool) -> None:
        """Run on a copy of `state` (the state itself for the last repeat: nothing follows it)."""
        self.drafter = state if last else self._copy(state)

    def _copy(self, drafter: Drafter) -> Drafter:
        return copy.deepcopy(drafter, {id(x): x for x in self.shared})

    def run(self, prompt: list[int], max_new_tokens: int) -> Turn:
        from samctl.decode.loop import GenerationConfig, generate as decode_generate

        config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=self.engine.eos_token_ids)
        result = decode_generate(self.engine.target, self.drafter, prompt, config)
        m = result.metrics
        return Turn(result.tokens, m.time_s, m.steps, m.draft_s, m.to_dict())


class HfRunner:
    """transformers' own `generate` with the given extra settings; forwards counted by a hook."""

    def __init__(self, name: str, engine: Engine, extra: dict[str, Any]) -> None:
        from transformers.utils import logging as hf_logging

        self.name, self.engine, self.extra = name, engine, extra
        self.drafter = None
        self.forwards = 0
        # assisted generation warns about its own internal argument passing on every run
        hf_logging.set_verbosity_error()

    def run(self, prompt: list[int], max_new_tokens: int) -> Turn:
        import torch
        from transformers import GenerationConfig as HfGenerationConfig

        model, eos = self.engine.model, list(self.engine.eos_token_ids)
        settings = {k: v for k, v in self.extra.items() if k != "assistant_model"}
        gen_config = HfGenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                        pad_token_id=eos[0] if eos else 0, **settings)
        ids = torch.tensor([prompt], dtype=torch.int64, device=self.engine.device)
        self.forwards = 0
        hook = model.register_forward_hook(self._count)
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                                     assistant_model=self.extra.get("assistant_model"))
                elapsed = time.perf_counter() - start
        finally:
            hook.remove()
        tokens = _cut(out[0, len(prompt):].tolist(), set(eos), max_new_tokens)
        return Turn(tokens, elapsed, max(self.forwards - 1, 0), None)

    def _count(self, *_: Any) -> None:
        self.forwards += 1


def _cut(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    """The engine's counting: up to and including the first EOS, at most `limit` ids."""
    end = next((i + 1 for i, tok in enumerate(tokens) if tok in eos), len(tokens))
    return tokens[: min(end, limit)]


def _runner(method: str, session: Session, models: dict[str, str | None]) -> Runner:
    """The runner of `method` on the session's engine (samctl methods get sessions of their own,
    sharing the engine, store and heads)."""
    config = session.method_config
    if method == "hf-greedy":
        return HfRunner(method, session.engine, {})
    if method == "hf-pld":
        return HfRunner(method, session.engine, {"prompt_lookup_num_tokens": config.pld.num_draft,
                                                 "max_matching_ngram_size": config.pld.max_ngram})
    if method == "hf-assisted":
        return HfRunner(method, session.engine, {"assistant_model": session.for_method("sd", **models).draft_model.model})
    return EngineRunner(method, session.for_method(method, **models))


# ---------------------------------------------------------------------------------------------
# the run


def _warm_up(runners: dict[str, Runner], engine: Engine, question: Question, chat: bool) -> None:
    # First calls pay for JIT loading, allocator growth and lazy imports: kept out of the numbers.
    # samctl's methods warm as their sessions do (Session.warm_up), so the drafters measured start untaught.
    prompt = engine.encode_conversation([{"role": "user", "content": question.turns[0]}], chat)
    for runner in runners.values():
        if isinstance(runner, EngineRunner):
            runner.session.warm_up(prompt)
        else:
            runner.run(prompt, WARMUP_TOKENS)


def _run_all(runners: dict[str, Runner], engine: Engine, questions: list[Question], config: SessionConfig,
             repeats: int, records_path: Path) -> list[dict[str, Any]]:
    records = []
    with records_path.open("w", encoding="utf-8") as sink, \
            progress_bar("bench", "run", config.quiet, total=len(questions) * len(runners) * repeats) as bar:
        for q in questions:
            runs: dict[str, list[list[Turn]]] = {name: [] for name in runners}
            states = {name: runner.snapshot() for name, runner in runners.items()
                      if repeats > 1 and isinstance(runner, EngineRunner)}
            for r in range(repeats):  # repeats interleave the methods too
                for name, runner in runners.items():
                    if runner.drafter is not None:  # it keeps the coming outputs in its cross-request memory
                        runner.drafter.remember = True
                    if name in states:  # every repeat from the state before the question's first
                        runner.restore(states[name], last=r == repeats - 1)
                    runs[name].append(_run_question(runner, engine, q, config.max_new_tokens, config.chat))
                    bar.update(1, tokens=sum(len(t.tokens) for t in runs[name][-1]))
            baseline = _median_run(runs[BASELINE])
            for name in runners:  # ar first: the others compare with it
                record = _record(name, q, _median_run(runs[name]), baseline, engine, runs[name])
                records.append(record)
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                sink.flush()
    return records


def _median_run(runs: list[list[Turn]]) -> list[Turn]:
    """The repeat whose total time is the median (the lower one for an even count): a spike from
    another process on the machine moves a mean, not a median."""
    ordered = sorted(runs, key=lambda turns: sum(t.time_s for t in turns))
    return ordered[(len(ordered) - 1) // 2]


def _run_question(runner: Runner, engine: Engine, q: Question, max_new: int, chat: bool) -> list[Turn]:
    messages: list[dict[str, str]] = []
    turns = []
    for text in q.turns:
        messages.append({"role": "user", "content": text})
        turn = runner.run(engine.encode_conversation(messages, chat), max_new)
        messages.append({"role": "assistant", "content": engine.decode(turn.tokens)})
        turns.append(turn)
    return turns


def _record(method: str, q: Question, turns: list[Turn], baseline: list[Turn], engine: Engine,
            repeats: list[list[Turn]]) -> dict[str, Any]:
    diffs = [first_difference(t.tokens, b.tokens) for t, b in zip(turns, baseline)]
    # Every repeat's turns are checked against ar's: greedy output must not vary between runs either.
    mismatched = sum(first_difference(t.tokens, b.tokens) is not None for run in repeats for t, b in zip(run, baseline))
    new_tokens = sum(len(t.tokens) for t in turns)
    time_s = sum(t.time_s for t in turns)
    return {
        "method": method, "question_id": q.qid, "category": q.category, "group": q.group,
        "new_tokens": new_tokens, "time_s": round(time_s, 6),
        "tokens_per_s": round(new_tokens / time_s, 3) if time_s > 0 else 0.0,
        "steps": sum(t.steps for t in turns) if all(t.steps is not None for t in turns) else None,
        "draft_s": round(sum(t.draft_s for t in turns), 6) if all(t.draft_s is not None for t in turns) else None,
        "mismatched_turns": mismatched,
        "repeat_times_s": [round(sum(t.time_s for t in run), 6) for run in repeats],
        "repeat_steps": [sum(t.steps for t in run) if all(t.steps is not None for t in run) else None for run in repeats],
        "turns": [{"new_tokens": len(t.tokens), "time_s": round(t.time_s, 6),
                   "tokens_per_s": round(len(t.tokens) / t.time_s if t.time_s > 0 else 0.0, 3),
                   "steps": t.steps, "first_difference": d, "metrics": t.metrics, "text": engine.decode(t.tokens)}
                  for t, d in zip(turns, diffs)],
    }


def _run_info(session: Session, config: SessionConfig, repeats: int, methods: list[str], questions: int, skipped: int) -> dict[str, Any]:
    import torch

    from samctl.decode.engine.cpu_linear import linear_backend

    engine = session.engine
    return {
        "command": command_line("bench"),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": engine.name,
        "store": config.store,
        "draft_model": config.draft_model,
        "device": str(engine.device),
        "dtype": str(next(engine.model.parameters()).dtype).replace("torch.", ""),
        "linear": linear_backend(engine.model),
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "max_new_tokens": config.max_new_tokens,
        "repeats": repeats,
        "questions": questions,
        "skipped_questions": skipped,
        "chat": config.chat,
        "methods": ", ".join(methods),
        "method_config": json.dumps(asdict(session.method_config)),
    }
