"""Reference outputs for `samctl simulate`: a model's own greedy answers to a question file.

Reads a Spec-Bench-format question file (question_id, category, turns), answers every turn with
greedy decoding (turn by turn, the conversation rendered as `samctl bench` renders it: the chat
template with --chat, else turns joined by blank lines) and writes one JSONL row per turn:

    {"id": "<question_id>.<turn>", "question_id", "category", "turn",
     "prompt_ids", "output_ids", "prompt", "output", "tokenizer": {"name", "fingerprint"}}

`output_ids` are the generated ids (EOS included when the model stopped on it), so a replay sees
exactly what the engine saw: simulate reads prompt_ids/output_ids as they are, and refuses them
when its tokenizer's fingerprint differs from the one recorded. The answers are written by the
trainers' answer writer (samctl.train.answers.write_answers: the batched engine, --batch-size rows
at once, with a lossless drafter, --method, default pld, which gives the same tokens as plain
greedy decoding, faster) into OUT.answers-KEY.jsonl (KEY names the model, questions and
settings) as each finishes, with progress on stderr; a rerun resumes from that file, and OUT is
written from it, in question order, when every turn is answered. Questions that do not fit the model's context are skipped, as in bench. Write the
output outside the repository:

    python tools/gen_references.py --questions ../shared/data/specbench_question.jsonl \\
        --out ../runs/data/specbench_refs.jsonl --max-new-tokens 256 --chat --threads 1
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from samctl.heads import model_fingerprint
from samctl.index.errors import UserError
from samctl.commands.bench import fitting_questions, read_questions
from samctl.session import Session, SessionConfig
from samctl.tokenizer import tokenizer_fingerprint
from samctl.train.answers import answers_key, write_answers
from samctl.train.prompts import Prompt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", required=True, help="Spec-Bench-format JSONL")
    p.add_argument("--out", required=True, help="JSONL to write (keep it outside the repository)")
    p.add_argument("--model", default=None, help="model folder or .gguf file (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    p.add_argument("--limit", type=int, default=None, help="first N questions per category (as bench --limit)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--method", default="pld", help="lossless drafter used to decode faster (greedy output is the same)")
    p.add_argument("--batch-size", type=int, default=8, help="answers written at once by the batched engine")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a shared machine)")
    a = p.parse_args(argv)
    try:
        rows, questions, skipped = write_references(a)
    except UserError as err:
        raise SystemExit(f"gen_references: error: {err}") from err
    print(f"wrote {rows} turns of {questions} questions to {a.out} ({skipped} skipped: longer than the "
          f"model's context)", file=sys.stderr)


def write_references(a: argparse.Namespace) -> tuple[int, int, int]:
    """Answer every fitting question; returns (rows written, questions answered, questions skipped)."""
    session = Session(SessionConfig(model=a.model, device=a.device, threads=a.threads, method=a.method,
                                    max_new_tokens=a.max_new_tokens, chat=a.chat))
    engine = session.engine
    # a path is recorded absolute, so that `simulate --tokenizer NAME` finds it from anywhere
    name = str(Path(engine.name).resolve()) if Path(engine.name).exists() else engine.name
    tokenizer = {"name": name, "fingerprint": tokenizer_fingerprint(engine.tokenizer)}
    questions = read_questions(Path(a.questions), a.categories, a.limit)
    questions, skipped = fitting_questions(questions, engine, a.max_new_tokens, a.chat)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = [Prompt(q.category, tuple(q.turns)) for q in questions]
    key = answers_key(model_fingerprint(engine.model, engine.tokenizer), prompts, a.max_new_tokens, a.chat)
    answers = write_answers(session, prompts, out.with_name(f"{out.name}.answers-{key}.jsonl"), batch_size=a.batch_size,
                            max_prompt_tokens=engine.target.max_positions,
                            log=lambda text: print(f"gen_references: {text}", file=sys.stderr, flush=True))
    with out.open("w", encoding="utf-8") as sink:
        for answer in answers:
            q = questions[answer.prompt]
            sink.write(json.dumps({
                "id": f"{q.qid}.{answer.turn}", "question_id": q.qid, "category": q.category, "turn": answer.turn,
                "prompt_ids": answer.prompt_ids, "output_ids": answer.output_ids,
                "prompt": engine.tokenizer.decode(answer.prompt_ids), "output": session.decode(answer.output_ids),
                "tokenizer": tokenizer,
            }, ensure_ascii=False) + "\n")
    return len(answers), len({answer.prompt for answer in answers}), skipped


if __name__ == "__main__":
    main()
