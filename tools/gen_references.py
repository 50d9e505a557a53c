"""Reference outputs for `samctl simulate`: a model's own greedy answers to a question file.

Reads a Spec-Bench-format question file (question_id, category, turns), answers every turn with
greedy decoding (turn by turn, the conversation rendered as `samctl bench` renders it: the chat
template with --chat, else turns joined by blank lines) and writes one JSONL row per turn:

    {"id": "<question_id>.<turn>", "question_id", "category", "turn",
     "prompt_ids", "output_ids", "prompt", "output"}

`output_ids` are the generated ids (EOS included when the model stopped on it), so a replay sees
exactly what the engine saw: simulate reads prompt_ids/output_ids as they are. Decoding runs
through the samctl engine with a lossless drafter (--method, default pld), which gives the same
tokens as plain greedy decoding, faster. Questions that do not fit the model's context are
skipped, as in bench. Write the output outside the repository:

    python tools/gen_references.py --questions ../shared/data/specbench_question.jsonl \\
        --out ../runs/data/specbench_refs.jsonl --max-new-tokens 256 --chat
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from decode.loop import GenerationConfig, generate
from decode.methods import MethodConfig
from samctl.commands.bench import fitting_questions, read_questions
from samctl.runtime import build_drafter, load_engine


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", required=True, help="Spec-Bench-format JSONL")
    p.add_argument("--out", required=True, help="JSONL to write (keep it outside the repository)")
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    p.add_argument("--limit", type=int, default=None, help="first N questions per category (as bench --limit)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--method", default="pld", help="lossless drafter used to decode faster (greedy output is the same)")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)

    engine = load_engine(a.model, a.device)
    questions = read_questions(Path(a.questions), a.categories, a.limit)
    questions, skipped = fitting_questions(questions, engine, a.max_new_tokens, a.chat)
    drafter = build_drafter(a.method, engine, None, MethodConfig())
    config = GenerationConfig(max_new_tokens=a.max_new_tokens, eos_token_ids=engine.eos_token_ids)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start, tokens, rows = time.perf_counter(), 0, 0
    with out.open("w", encoding="utf-8") as sink:
        for n, q in enumerate(questions, start=1):
            messages: list[dict[str, str]] = []
            for k, turn in enumerate(q.turns):
                messages.append({"role": "user", "content": turn})
                prompt = engine.encode_conversation(messages, a.chat)
                result = generate(engine.target, drafter, prompt, config)
                answer = engine.decode(result.tokens)
                messages.append({"role": "assistant", "content": answer})
                sink.write(json.dumps({
                    "id": f"{q.qid}.{k}", "question_id": q.qid, "category": q.category, "turn": k,
                    "prompt_ids": list(map(int, prompt)), "output_ids": result.tokens,
                    "prompt": engine.tokenizer.decode(prompt), "output": answer,
                }, ensure_ascii=False) + "\n")
                tokens += len(result.tokens)
                rows += 1
            print(f"\r{n}/{len(questions)} questions, {tokens} tokens, {time.perf_counter() - start:.0f} s",
                  end="", file=sys.stderr, flush=True)
    print(f"\nwrote {rows} turns of {len(questions)} questions to {out} ({skipped} skipped: longer than the "
          f"model's context)", file=sys.stderr)


if __name__ == "__main__":
    main()
