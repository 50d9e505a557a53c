"""JSONL batches over a Session: one input line -> one output line, in input order.

A record is a JSON object with its prompt in one of PROMPT_FIELDS (`turns`: a conversation) or the
field the caller names; its `id` (else `question_id`, else its line number) is copied to the
output with the text, finish reason and metrics. A bad record, a blank line included, gets an
`error` field and the rest go on; a line with no id to read gets its line number as `line`
instead, so that it never passes for a record's id. Resuming a killed run skips one input record
per output line already written (`finished_keys`, `unfinished`).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections import Counter, deque
from dataclasses import asdict
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator

from samctl.index.errors import UserError
from samctl.progress import progress_bar
from samctl.textio import check_utf8

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # parsing records (distill's resume, --resume) needs no model
    from samctl.decode.loop import GenerationResult
    from samctl.session import Session

PROMPT_FIELDS = ("prompt", "turns", "text", "question", "instruction")


class RecordRunner:
    """Records through one session, up to `batch_size` single-turn ones (a text `prediction` each, or
    none) at once on the batched engine; records with several turns, bad ones, and every record
    with compare, go one by one through `process`."""

    unit = "record"

    def __init__(self, session: Session, field: str | None = None, compare: bool = False,
                 batch_size: int = 1) -> None:
        self.session, self.field, self.compare, self.batch_size = session, field, compare, batch_size
        self._noted: set[str] = set()

    def batch(self, records: Iterable[tuple[int, str]], write: Callable[[str], None], quiet: bool,
              total: int | None = None) -> int:
        """Writes one output line per (line number, line) record, in input order; returns the failures."""
        failed = 0
        with progress_bar("generate", self.unit, quiet, total=total) as progress, progress.heartbeat():
            def emit(line: str, bad: bool, tokens: int) -> None:
                nonlocal failed
                failed += bad
                write(line)
                progress.update(1, tokens=tokens)

            self._run(records, emit)
        return failed

    def _run(self, records: Iterable[tuple[int, str]], emit: Callable[[str, bool, int], None]) -> None:
        if self.batch_size == 1 or self.compare:
            for number, line in records:
                out, bad = self.process(number, line)
                emit(out, bad, output_tokens(out))
            return
        # Batchable records stream through the session's batch, read as rows free up; the rest run
        # one by one when read. Each output line goes out as soon as every earlier one has.
        finished: dict[int, tuple[str, bool]] = {}  # by input position, until written
        ids: dict[int, Any] = {}  # input position -> record id, of the records in the batch
        written = 0

        def flush() -> None:
            nonlocal written
            while written in finished:
                line, bad = finished.pop(written)
                emit(line, bad, output_tokens(line))
                written += 1

        def batchable() -> Iterator[tuple[int, str, str | None]]:
            for pos, (number, line) in enumerate(records):
                try:
                    record = parse_record(line, number)
                    turns = prompt_turns(record, self.field)
                except UserError:
                    record, turns = {}, []
                prediction = record.get("prediction")
                if len(turns) == 1 and (prediction is None or isinstance(prediction, str)):
                    ids[pos] = record_key(record, number)
                    yield pos, turns[0], prediction
                else:
                    finished[pos] = self.process(number, line)
                    flush()

        from samctl.decode.loop import BatchStats

        stats = BatchStats()
        for result in self.session.stream_batch(batchable(), batch_size=self.batch_size, stats=stats):
            record_id = ids.pop(result.index)
            fields = {"error": result.error} if result.error else result_fields(self.session, result)
            finished[result.index] = json.dumps({"id": record_id, **fields}, ensure_ascii=False), bool(result.error)
            flush()
            for note in stats.notes:  # an out-of-memory that halved the batch, said once
                if note not in self._noted:
                    self._noted.add(note)
                    log.info(f"note: {note}")
        flush()

    def process(self, number: int, line: str) -> tuple[str, bool]:
        """(output line, whether it failed)."""
        try:
            record = parse_record(line, number)
        except UserError as err:
            return json.dumps({**line_key(line, number), "error": str(err)}, ensure_ascii=False), True
        key = {"id": record_key(record, number)}
        try:
            return json.dumps({**key, **self.run(record)}, ensure_ascii=False), False
        except UserError as err:
            return json.dumps({**key, "error": str(err)}, ensure_ascii=False), True

    def run(self, record: dict[str, Any]) -> dict[str, Any]:
        session = self.session
        turns = prompt_turns(record, self.field)
        prediction = record.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise UserError("the record's `prediction` is not text: give the expected output as a string")
        messages: list[dict[str, str]] = []
        texts, results = [], []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            ids = session.encode(messages)
            result = session.generate(ids, prediction=prediction if len(messages) == 1 else None)
            text = session.decode(result.tokens)
            messages.append({"role": "assistant", "content": text})
            texts.append(text)
            results.append((ids, result))
        out = result_fields(session, results[-1][1])
        if len(turns) > 1:
            out["turn_texts"] = texts
            out["metrics"] = [r.metrics.to_dict() for _, r in results]
        if self.compare:
            compared = [session.compare(ids, r) for ids, r in results]
            out["compare"] = compared if len(turns) > 1 else compared[0]
        return out


def result_fields(session: Session, result: GenerationResult) -> dict[str, Any]:
    fields = {"text": session.decode(result.tokens), "finish_reason": result.finish_reason,
              "metrics": result.metrics.to_dict()}
    if result.prediction is not None:  # decode.metrics.PredictionUsage: tokens, accepted, rejected
        fields["prediction_usage"] = asdict(result.prediction)
    return fields


def output_tokens(line: str) -> int:
    """New tokens of an output line, for progress."""
    metrics = json.loads(line).get("metrics", [])  # a list for multi-turn records, none for failed ones
    return sum(m["new_tokens"] for m in (metrics if isinstance(metrics, list) else [metrics]))


def count_records(lines: IO[str], done: Counter[str] | None = None) -> int | None:
    """Records in a seekable input (a file) less those `done` has output for (unfinished), for
    progress; None for a pipe."""
    if not lines.seekable():
        return None
    count = sum(1 for _ in unfinished(read_records(lines), Counter(done))) if done else sum(1 for _ in lines)
    lines.seek(0)
    return count


def batch_format(handle: IO[str], asked: str) -> tuple[str, Iterable[str]]:
    """("records" or "openai", the lines to read): `asked`, or for "auto" the shape of the first
    line (OpenAI Batch API lines have `custom_id` and `body`). A pipe's first line is read once
    and put back in front."""
    from samctl.openai_api import is_batch_line

    if asked != "auto":
        return asked, handle
    first = handle.readline()
    shape = "openai" if is_batch_line(first) else "records"
    if handle.seekable():
        handle.seek(0)
        return shape, handle
    return shape, itertools.chain([first] if first else [], handle)


def read_records(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """Every line, blank ones included: the output has one line per input line."""
    return enumerate(lines, start=1)


def record_key(record: dict[str, Any], number: int) -> Any:
    return record.get("id", record.get("question_id", number))


def line_key(line: str, number: int) -> dict[str, Any]:
    """What names a line's output: {"id": its record's id} (record_key); for a line refused only for
    a byte that is not UTF-8, the id its JSON holds all the same, when that id is UTF-8 itself (the
    bad byte is elsewhere); else {"line": its number}, which no record's id can be taken for."""
    with contextlib.suppress(UserError):
        return {"id": record_key(parse_record(line, number), number)}
    key = salvaged_field(line, lambda record: record_key(record, number))
    return {"line": number} if key is None else {"id": key}


def salvaged_field(line: str, field: Callable[[dict[str, Any]], Any]) -> Any:
    """`field(record)` of a line that is a JSON object but holds a byte that is not UTF-8
    elsewhere; None when it is no JSON object, or when the field's value holds the bad byte."""
    try:
        record = json.loads(line)  # a bad byte reads as a lone surrogate (textio), which JSON keeps
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    value = field(record)
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def output_key(number: int, line: str) -> str:
    """What names a record's output line, as JSON text (so id 7 and "7" differ, as do id 7 and line 7)."""
    return json.dumps(line_key(line, number))


def finished_keys(path: str) -> Counter[str]:
    """How many output lines an output file holds under each output_key; a torn last line (a
    killed run) is cut off first."""
    try:
        with open(path, "rb+") as handle:
            data = handle.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                handle.truncate(end)
    except FileNotFoundError:
        return Counter()
    done: Counter[str] = Counter()
    for number, line in enumerate(data[:end].decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
            done[json.dumps({"id": record["id"]} if "id" in record else {"line": record["line"]})] += 1
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UserError(f"--resume: line {number} of {path} is not a samctl output record: "
                            "pass the --output file of the run to resume") from err
    return done


def unfinished(records: Iterable[tuple[int, str]], done: Counter[str],
               skipped: Callable[[], None] = lambda: None) -> Iterator[tuple[int, str]]:
    """The records `done` (finished_keys) has no output line for: each output line accounts for one
    record, the first with its key, so a repeated id, or an id that is another line's number,
    never skips a record that has no output of its own; `skipped` is called for each one left out."""
    for number, line in records:
        key = output_key(number, line)
        if done[key] > 0:
            done[key] -= 1
            skipped()
        else:
            yield number, line


def parse_record(line: str, number: int) -> dict[str, Any]:
    check_utf8(line, f"line {number}")
    if not line.strip():
        raise UserError(f"line {number} is blank: one JSON object per line (the output keeps one "
                        "line per input line)")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"line {number} is not JSON ({err.msg}): one JSON object per line") from err
    if not isinstance(record, dict):
        raise UserError(f"line {number} is not a JSON object: one object per line, e.g. {{\"prompt\": \"...\"}}")
    return record


def prompt_turns(record: dict[str, Any], field: str | None) -> list[str]:
    names = (field,) if field else PROMPT_FIELDS
    for name in names:
        value = record.get(name)
        if name == "turns" and value is not None and not isinstance(value, list):
            raise UserError("`turns` must be a list of texts, one per turn, e.g. [\"first\", \"second\"]")
        if isinstance(value, list) and (bad := [i for i, v in enumerate(value, 1) if not isinstance(v, str)]):
            raise UserError(f"turn {bad[0]} of the record's `{name}` is not text: give every turn as a string")
        if isinstance(value, str) and value:
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return value
        if value == "" or (isinstance(value, list) and any(v == "" for v in value)):
            raise UserError(f"the record's `{name}` is empty: give the prompt text")
    raise UserError(f"no prompt: the record has none of the fields {', '.join(names)} as text; "
                    "name the field with --field")


class OpenAIBatchRunner(RecordRunner):
    """OpenAI Batch API lines (samctl.openai_api.BatchLine) through the server's scheduler and
    schemas, one BatchOutputLine per input line, in input order; `batch` counts the lines whose
    status is not 200."""

    unit = "request"

    def __init__(self, session: Session, model_name: str, batch_size: int) -> None:
        from samctl.scheduler import Sessions

        super().__init__(session, batch_size=batch_size)
        self.sessions = Sessions({session.config.store: session}, model_name=model_name)

    def _run(self, records: Iterable[tuple[int, str]], emit: Callable[[str, bool, int], None]) -> None:
        from samctl.scheduler import BatchScheduler

        scheduler = BatchScheduler(self.sessions, self.batch_size)
        window: deque[_BatchRequest] = deque()  # submitted, written in input order as each ends
        try:
            for number, line in records:
                window.append(self._submit(number, line, scheduler))
                while len(window) > 4 * self.batch_size:
                    emit(*window.popleft().result())
            while window:
                emit(*window.popleft().result())
        finally:
            scheduler.close()

    def _submit(self, number: int, line: str, scheduler) -> "_BatchRequest":
        from pydantic import ValidationError

        from samctl.openai_api import BatchLine, invalid, job_request
        from samctl.scheduler import Failed, Job, RequestError

        # kept for a line refused before its schema is read (a byte that is not UTF-8, a bad body)
        custom_id = salvaged_field(line, lambda record: record.get("custom_id"))
        custom_id = custom_id if isinstance(custom_id, str) else None
        try:
            check_utf8(line, f"line {number}")
            try:
                batch_line = BatchLine.model_validate_json(line)
                custom_id = batch_line.custom_id
                body = batch_line.request()
            except ValidationError as err:
                raise invalid(err.errors()) from err
            request = _BatchRequest(custom_id, body, self.sessions.model_name)
            scheduler.submit(Job(job_request(body, self.sessions), self.sessions, request.sink))
        except (UserError, RequestError) as err:
            request = _BatchRequest(custom_id, None, "")
            request.sink(Failed(err if isinstance(err, RequestError) else RequestError(str(err))))
        return request


class _BatchRequest:
    """One OpenAI Batch line in flight: its job's events, taken in by the worker thread."""

    def __init__(self, custom_id: str | None, body: Any, model_name: str) -> None:
        from samctl.openai_api import Reply

        self.custom_id, self.reply, self.ended = custom_id, Reply(body, model_name), threading.Event()

    def sink(self, event: Any) -> None:
        from samctl.scheduler import ENDS

        self.reply.add(event)
        if isinstance(event, ENDS):
            self.ended.set()

    def result(self) -> tuple[str, bool, int]:
        """(output line, whether it failed, new tokens), once the job has ended."""
        from samctl.openai_api import BatchOutputLine, BatchResponse, new_id
        from samctl.scheduler import RequestError

        self.ended.wait()
        request_id = new_id("req")
        try:
            body = self.reply.completion()
            status, error, tokens = 200, None, body.usage.completion_tokens
        except RequestError as err:
            body, status, error, tokens = None, err.status, err.body()["error"], 0
        out = BatchOutputLine(id=new_id("batch_req"), custom_id=self.custom_id, error=error,
                              response=BatchResponse(status_code=status, request_id=request_id, body=body))
        return out.model_dump_json(), status != 200, tokens
