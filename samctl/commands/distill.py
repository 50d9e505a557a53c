"""`samctl distill`: a store over the model's own answers (SAM-Decoding's self-distilled store).

Phases: 1) answer every prompt with samctl's decoding, with `generate --input`'s batch semantics,
appending each answer to an answers file as it is done (a second run resumes from there) 2) build
an automaton over each record's turns and answers joined by blank lines, plus any --also corpora
3) write it atomically, its header (`written_by`) recording which model wrote the answers and how.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import click

from samctl.config import SessionConfig
from samctl.index.errors import UserError
from samctl.options import batch_size, batch_size_option_with, session_options
from samctl.textio import ERRORS, check_output_path

@click.command("distill")
@session_options(exclude=("memory_file",), raw=("chat",),
                 method={"help": "How the answers are generated (any method gives the same greedy answers; adaptive "
                                 "is fastest)."},
                 store={"type": click.Path(exists=True), "help": "A store to draft from while generating (not part of "
                        "the output): a .sam file or a store directory (sharded, or a suffix array)."},
                 chat={"cli": "--chat/--no-chat", "default": None,
                       "help": "Apply the tokenizer's chat template to the prompts (the way the model will be asked) "
                               "[default: --chat when the model has a chat template, else --no-chat]."})
@click.option("--prompts", "prompts_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL prompts, one record per line (as `generate --input`).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Store file to write (.sam).")
@click.option("--answers", "answers_path", type=click.Path(dir_okay=False),
              help="JSONL file of the answers, appended to as they come; an existing one is resumed "
                   "[default: OUTPUT.answers.jsonl].")
@click.option("--also", "also", multiple=True, metavar="INPUT",
              help="Also put this corpus in the store (as `samctl build` reads it; repeatable).")
@click.option("--field", "prompt_field", metavar="NAME",
              help="the record field holding the prompt (default: prompt, turns, text, question, instruction)")
@batch_size_option_with()
@click.option("--compress/--no-compress", default=True, show_default=True, help="zstd-compress the store's arrays.")
def distill(config: SessionConfig, chat: bool | None, **opts: Any) -> None:
    """Generate the model's own answers to prompts and build a store from them.

    \b
    samctl distill --model M --prompts train_questions.jsonl -o self.sam
    samctl generate --model M --sam self.sam --chat --prompt "..."     # drafts from its own answers
    """
    start = time.perf_counter()
    from samctl.records import RecordRunner
    from samctl.session import Session

    answers_path = Path(opts["answers_path"] or opts["output"] + ".answers.jsonl")
    _check_paths(opts["output"], answers_path, opts["prompts_path"], opts["also"])
    session = Session(config)
    engine, sampling = session.engine, config.sampling
    chat = _chat_mode(chat, engine, config.quiet)
    if chat:
        session = session.for_method(config.method, chat=True)
    producer = _producer(config, chat, opts["prompt_field"], engine)
    done = _answered(answers_path, producer, config.quiet)

    # 1) answers, appended as they finish, in input order, so that an interrupted run loses at most
    # the records in flight
    runner = RecordRunner(session, field=opts["prompt_field"],
                          batch_size=batch_size(config, opts["batch_size"], on_gpu=engine.device.type != "cpu"))
    if done and not config.quiet:
        click.echo(f"samctl: resuming: {len(done)} prompt(s) already answered in {answers_path}", err=True)
    with open(opts["prompts_path"], encoding="utf-8", errors=ERRORS) as prompts, \
            open(answers_path, "a", encoding="utf-8") as out:
        def write(line: str) -> None:
            # Each answer records what produced it, so that a later run never resumes with others'.
            out.write(json.dumps({**json.loads(line), "produced_by": producer}, ensure_ascii=False) + "\n")
            out.flush()

        records = _unanswered(prompts, done)
        failed = runner.batch(records, write, config.quiet)
    if failed and not config.quiet:
        click.echo(f"samctl: {failed} prompt(s) failed (see their `error` in {answers_path}); "
                   "run again to retry them", err=True)
    generated = time.perf_counter()
    # 2) documents: each record's turns and answers, then the --also corpora
    documents = list(_documents(opts["prompts_path"], answers_path, opts["prompt_field"]))
    if not documents:
        raise UserError(f"no prompt was answered ({answers_path}): check the prompts file and the errors there")
    written_by = {
        "model": engine.name, "method": config.method, "prompts": str(opts["prompts_path"]),
        "answers": str(len(documents)), "max_new_tokens": str(config.max_new_tokens),
        "decoding": "greedy" if sampling.greedy else json.dumps(asdict(sampling)),
        "chat_template": str(chat).lower(),
    }
    summary = _build_store(opts, config.model, documents, written_by)
    if not config.quiet:
        click.echo(f"{summary}; answers {generated - start:.1f} s, total {time.perf_counter() - start:.1f} s")


def _check_paths(output: str, answers_path: Path, prompts_path: str, also: tuple[str, ...]) -> None:
    """Refuse before the model loads what the run could not read or write, or should not replace."""
    for item in also:
        if item != "-" and not item.startswith("hf:") and not os.path.lexists(item):
            raise UserError(f"--also {item} does not exist: pass a folder, a .json/.jsonl/.parquet or text file, or hf:NAME")
    check_output_path("-o", output, (("--prompts", prompts_path),), store=True)
    check_output_path("--answers", str(answers_path), (("--prompts", prompts_path),))


def _unanswered(lines, done: set[Any]) -> Iterator[tuple[int, str]]:
    from samctl.records import parse_record, read_records, record_key

    for number, line in read_records(lines):
        try:
            key = record_key(parse_record(line, number), number)
        except UserError:
            key = number
        if key not in done:
            yield number, line


def _chat_mode(chat: bool | None, engine: Any, quiet: bool) -> bool:
    """--chat/--no-chat as given; unset, the chat template when the model has one."""
    has_template = bool(getattr(engine.tokenizer, "chat_template", None))
    if chat and not has_template:
        raise UserError(f"model {engine.name} has no chat template: pass --no-chat to answer the prompts as plain text")
    if chat is None and not has_template and not quiet:
        click.echo(f"samctl: note: model {engine.name} has no chat template: the prompts are given as plain "
                   "text (--no-chat)", err=True)
    return has_template if chat is None else chat


def _producer(config: SessionConfig, chat: bool, field: str | None, engine: Any) -> dict[str, Any]:
    """What decides the answers: the model (by fingerprint), its dtype, the prompt rendering and
    the decoding. The method is left out: every method gives the model's own answers."""
    from samctl.heads import model_fingerprint

    return {"model": engine.name, "model_fingerprint": model_fingerprint(engine.model, engine.tokenizer),
            "dtype": str(engine.target.dtype).removeprefix("torch."), "chat": chat,
            "field": field, "max_new_tokens": config.max_new_tokens,
            "sampling": "greedy" if config.sampling.greedy else asdict(config.sampling)}


def _same_producer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return {k: v for k, v in a.items() if k != "model"} == {k: v for k, v in b.items() if k != "model"}


def _describe(producer: Any) -> str:
    if not isinstance(producer, dict):
        return "an unrecorded setup"
    sampling = producer.get("sampling")
    decoding = "greedy" if sampling == "greedy" else f"sampling {sampling}"
    return (f"{producer.get('model')}, {'chat' if producer.get('chat') else 'no-chat'}, {decoding}, "
            f"max {producer.get('max_new_tokens')} new tokens, {producer.get('dtype')}")


def _answered(path: Path, producer: dict[str, Any], quiet: bool) -> set[Any]:
    """Ids of the records answered without error in an answers file (a torn last line is skipped).
    An answers file written by another model or other settings is started over, never mixed in."""
    done: set[Any] = set()
    if not path.is_file():
        return done
    for record in _answer_records(path):
        if not _same_producer(record.get("produced_by") or {}, producer):
            if not quiet:
                click.echo(f"samctl: {path} holds answers by {_describe(record.get('produced_by'))}; this run is "
                           f"{_describe(producer)}: starting the answers over", err=True)
            path.unlink()
            return set()
        if "error" not in record and isinstance(record.get("text"), str):
            done.add(record.get("id"))
    return done


def _answer_records(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of an answers file; a line cut short by an interruption is skipped (that
    record is generated again)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


def _documents(prompts_path: str, answers_path: Path, field: str | None) -> Iterator[str]:
    """Prompt turns and answers of every answered record, in the prompts file's order."""
    from samctl.records import parse_record, prompt_turns, read_records, record_key

    answers = {record.get("id"): record for record in _answer_records(answers_path)  # a later answer to an id wins
               if "error" not in record and isinstance(record.get("text"), str)}
    with open(prompts_path, encoding="utf-8", errors=ERRORS) as lines:
        for number, line in read_records(lines):
            try:
                record = parse_record(line, number)
                turns = prompt_turns(record, field)
            except UserError:
                continue
            answer = answers.get(record_key(record, number))
            if answer is None:
                continue
            texts = answer.get("turn_texts") or [answer["text"]]
            yield "\n\n".join(part for pair in zip(turns, texts) for part in pair)


def _build_store(opts: dict[str, Any], model: str | None, documents: list[str], written_by: dict[str, str]) -> str:
    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.corpus import CorpusReader
    from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
    from samctl.tokenizer import load_tokenizer, tokenize_documents

    tok = load_tokenizer(model or "default")
    texts: Iterator[str] = iter(documents)
    reader = None
    if opts["also"]:
        reader = CorpusReader(opts["also"], (), (), (), stdin=click.get_text_stream("stdin"))
        texts = itertools.chain(texts, (d.text for d in reader))
    tokens, offsets = tokenize_documents(texts, tok, append_eos=True)
    automaton = SuffixAutomaton.build(tokens, offsets)
    extra = reader.counts if reader is not None else None
    corpus = CorpusStats(documents=len(offsets) - 1, tokens=int(len(tokens)),
                         characters=sum(len(d) for d in documents) + (extra.characters if extra else 0),
                         files=1 + (extra.files if extra else 0),
                         inputs=(f"answers to {opts['prompts_path']}",) + tuple(opts["also"]))
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    meta = StoreMeta(tokenizer_name=tok.name, tokenizer_fingerprint=tok.fingerprint, vocab_size=tok.vocab_size,
                     eos_token_id=eos, build=BuildConfig(kind="sam", compress=opts["compress"]), corpus=corpus,
                     written_by=written_by)
    save_datastore(opts["output"], automaton, meta)
    return (f"wrote {opts['output']}: {len(documents):,} answers by {written_by['model']}"
            f"{f' + {len(offsets) - 1 - len(documents):,} documents of --also' if reader else ''}, "
            f"{len(tokens):,} tokens, {automaton.num_states:,} states")
