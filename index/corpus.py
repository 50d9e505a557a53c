"""Corpus readers: turn folders, record files, Hugging Face datasets and stdin into documents.

A document is a (source, text) pair; this module yields strings and never tokenizes. Inputs:

- a folder: its files, recursively in sorted order, hidden ones left out: those whose extension is
  in TEXT_EXTENSIONS, or that `include` globs match, less those `exclude` globs match (a glob
  matches the path relative to the folder or the file name). Binary, non-UTF-8 and non-regular
  files (a FIFO would block the read for ever) are skipped and listed in `CorpusCounts.skipped`.
  Each file is one document; a `.json`/`.jsonl`/`.parquet` file is read as records (below).
- a `.json` file (a list of records, one record, or JSON lines), a `.jsonl` file (read line by
  line, never whole), a `.parquet` file: one document per record.
- any other file named explicitly (`<(command)` is a FIFO): one document, its UTF-8 text.
- `hf:NAME[:SPLIT]`, `hf:NAME:CONFIG:SPLIT`: a Hugging Face dataset (split `train` by default), or
  a folder written by `save_to_disk` as NAME.
- `-`: standard input: JSON lines when its first non-blank line is a JSON object, else one document.

A record's text (`record_text`) comes from the fields the user names, else from the first known
shape (_SHAPES). Blank documents are dropped and counted; a record whose field holds no text is
left out and listed in `CorpusCounts.skipped_records`, with a warning once the inputs are read.
Read for prompts (`iter_prompts`), a record becomes its user turns only (`record_turns`), with its
own answer when its shape has one (`record_answer`).

This module does not know tokenizers, token ids or store files.
"""
from __future__ import annotations

import fnmatch
import itertools
import json
import logging
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

from samctl.index.errors import ConfigError, UserError

TEXT_EXTENSIONS = frozenset(
    """
    .txt .text .md .markdown .rst .adoc .tex .org .csv .tsv .html .htm .xml .css .scss
    .py .pyi .ipynb .c .h .cc .cpp .cxx .hh .hpp .hxx .cu .cuh .cs .java .kt .kts .scala .groovy
    .go .rs .swift .m .mm .js .jsx .mjs .ts .tsx .vue .rb .php .pl .pm .lua .r .jl .hs .ml .mli
    .ex .exs .erl .clj .dart .zig .nim .sh .bash .zsh .fish .ps1 .sql .proto .graphql
    .yaml .yml .toml .ini .cfg .conf .cmake .gradle .dockerfile .mk
    """.split()
)
RECORD_EXTENSIONS = frozenset([".json", ".jsonl", ".parquet"])
_BINARY_PROBE = 8192
_FIELD_HINT = "name the fields to read with {fields}"  # a ConfigError template

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Document:
    """One unit of text; matches in the datastore never cross two documents."""

    source: str  # where it came from: "path", "path:line", "hf:name[split]#row", "<stdin>:line"
    text: str
    turns: tuple[str, ...] = ()  # read for prompts: the user turns, in order (text joins them)
    answer: str = ""  # read for prompts: the record's own answer to its first turn, when it has one


@dataclass
class CorpusCounts:
    """What a reader saw; filled in while iterating."""

    files: int = 0
    documents: int = 0
    characters: int = 0
    empty: int = 0  # documents dropped because their text was blank
    skipped: list[str] = field(default_factory=list)  # "path (why)": files left out of folders
    skipped_records: list[str] = field(default_factory=list)  # "where: why": records with a field that is not text


class NoText(UserError):
    """A record's field holds something that is not text: the reader leaves the record out."""


class CorpusReader:
    def __init__(self, inputs: Iterable[str], include: Iterable[str] = (), exclude: Iterable[str] = (),
                 fields: Iterable[str] = (), stdin: TextIO | None = None, prompts: bool = False) -> None:
        self.inputs = list(inputs)
        self.prompts = prompts
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self.fields = tuple(fields)
        self.stdin = stdin
        self.counts = CorpusCounts()
        if not self.inputs:
            raise UserError("no input given: pass folders, files, hf:NAME or - for stdin")
        if self.inputs.count("-") > 1:
            raise UserError("standard input (-) can be read only once: pass - once")
        for spec in self.inputs:
            if spec != "-" and not spec.startswith("hf:") and not os.path.exists(spec):
                raise UserError(f"{spec} does not exist: pass a folder, a .json/.jsonl/.parquet "
                                "or text file, hf:NAME, or - for stdin")

    def __iter__(self) -> Iterator[Document]:
        for spec in self.inputs:
            for document in self._documents(spec):
                if document is None:
                    continue
                if not document.text.strip():
                    self.counts.empty += 1
                    continue
                self.counts.documents += 1
                self.counts.characters += len(document.text)
                yield document
        skipped = self.counts.skipped_records
        if skipped:
            log.warning(f"warning: skipped {len(skipped)} record(s) with a field that holds no text (first: {skipped[0]})")

    def _documents(self, spec: str) -> Iterator[Document | None]:
        if spec == "-":
            return _stdin_documents(self.stdin or sys.stdin, self._record)
        if spec.startswith("hf:"):
            return _hf_documents(spec, self._record)
        if os.path.isdir(spec):
            return self._folder_documents(Path(spec))
        return self._file_documents(Path(spec), explicit=True)

    def _folder_documents(self, top: Path) -> Iterator[Document | None]:
        for path in _walk(top):
            relative = path.relative_to(top).as_posix()
            if self._selected(relative, path.name, path.suffix.lower()):
                problem = _not_regular(path)
                if problem is not None:
                    self.counts.skipped.append(f"{path} ({problem})")
                    continue
                yield from self._file_documents(path, explicit=False)

    def _selected(self, relative: str, name: str, suffix: str) -> bool:
        def matches(patterns: tuple[str, ...]) -> bool:
            return any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(name, p) for p in patterns)

        chosen = matches(self.include) if self.include else suffix in TEXT_EXTENSIONS
        return chosen and not matches(self.exclude)

    def _file_documents(self, path: Path, explicit: bool) -> Iterator[Document | None]:
        self.counts.files += 1
        suffix = path.suffix.lower()
        if suffix in RECORD_EXTENSIONS:
            for where, record in _read_records(path):
                yield self._record(record, where)
            return
        text = _read_text(path)
        if text is None:
            if explicit:
                raise UserError(f"{path} is binary or not UTF-8 text: pass text files, or "
                                ".json/.jsonl/.parquet records")
            self.counts.skipped.append(f"{path} (binary or not UTF-8)")
            return
        yield Document(str(path), text, (text,) if self.prompts else ())

    def _record(self, record: dict[str, Any], where: str) -> Document | None:
        try:
            if self.prompts:
                turns = record_turns(record, self.fields, where)
                return Document(where, "\n".join(turns), turns, record_answer(record, self.fields, where))
            return Document(where, record_text(record, self.fields, where))
        except NoText as err:
            self.counts.skipped_records.append(str(err))
            return None


def iter_prompts(inputs: Iterable[str], fields: Iterable[str] = ()) -> Iterator[Document]:
    """The prompts of `inputs`: documents whose `turns` are a record's user turns (a plain-text
    document is one turn)."""
    return iter(CorpusReader(inputs, fields=fields, prompts=True))


# ---------------------------------------------------------------------------------------------
# files


def _walk(top: Path) -> Iterator[Path]:
    for directory, subdirs, files in os.walk(top):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(directory) / name


def _not_regular(path: Path) -> str | None:
    """Why a file found in a folder cannot be read as a document, or None when it can."""
    try:
        mode = path.stat().st_mode  # follows symbolic links
    except FileNotFoundError:
        return "dangling symbolic link"
    except OSError as err:
        return f"cannot stat: {err.strerror or err}"
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device"}
    return next((f"{name}, not a regular file" for test, name in kinds.items() if test(mode)), "not a regular file")


def _read_text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from err
    if b"\0" in data[:_BINARY_PROBE]:
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def _read_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if path.suffix.lower() == ".parquet":
        return _parquet_records(path)
    if path.suffix.lower() == ".jsonl":
        return _json_lines(_file_lines(path), str(path))
    text = _read_text(path)
    if text is None:
        raise UserError(f"{path} is binary or not UTF-8: pass a UTF-8 JSON or JSON lines file")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":
                raise UserError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}): fix the file") from err
        else:
            records = data if isinstance(data, list) else [data]
            return ((f"{path} record {i}", _as_record(r, f"{path} record {i}")) for i, r in enumerate(records, 1))
    return _json_lines(text.splitlines(), str(path))


def _file_lines(path: Path) -> Iterator[str]:
    try:
        with open(path, "rb") as probe:
            if b"\0" in probe.read(_BINARY_PROBE):
                raise UserError(f"{path} is binary: pass a UTF-8 JSON lines file")
        with open(path, encoding="utf-8-sig") as handle:
            yield from handle
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 (byte {err.start} of a line): convert it first") from err
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from err


def _json_lines(lines: Iterable[str], name: str) -> Iterator[tuple[str, dict]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{where} is not valid JSON ({err.msg}): fix or remove the line") from err
        yield where, _as_record(value, where)


def _as_record(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where} is a {type(value).__name__}, not a JSON object: pass one object per record")
    return value


def _parquet_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise UserError(f"reading {path} needs pyarrow: pip install pyarrow") from err
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        for row, record in enumerate(itertools.chain.from_iterable(b.to_pylist() for b in batches), 1):
            yield f"{path} row {row}", record
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"cannot read {path} as Parquet ({err}): check the file") from err


# ---------------------------------------------------------------------------------------------
# stdin and Hugging Face datasets


def _stdin_documents(stream: TextIO, convert: Callable[[dict[str, Any], str], Document | None]) -> Iterator[Document | None]:
    # plain text is one document, its lines joined by \n
    try:
        head: list[str] = []
        for line in stream:
            head.append(line)
            if line.strip():
                break
        if head and _is_json_object(head[-1]):
            for where, record in _json_lines(itertools.chain(head, stream), "<stdin>"):
                yield convert(record, where)
        else:
            text = "\n".join(("".join(head) + stream.read()).splitlines())
            yield convert({"text": text}, "<stdin>")
    except UnicodeDecodeError as err:
        raise UserError("standard input is not UTF-8 text: convert it first") from err


def _is_json_object(line: str) -> bool:
    if not line.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _hf_documents(spec: str, convert: Callable[[dict[str, Any], str], Document | None]) -> Iterator[Document | None]:
    name, config, split = _parse_hf_spec(spec)
    dataset = _load_hf(spec, name, config, split)
    for row, record in enumerate(dataset, 1):
        yield convert(record, f"hf:{name}[{split}] row {row}")


def _parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise UserError(f"{spec!r} is not a dataset spec: use hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else "train"


def _load_hf(spec: str, name: str, config: str | None, split: str):
    try:
        import datasets
        from huggingface_hub.utils import logging as hub_logging
    except ImportError as err:
        raise UserError(f"reading {spec} needs the datasets package: pip install datasets") from err
    hub_logging.set_verbosity_error()  # its retry warnings would break the one-line error (samctl says why)
    try:
        if _saved_to_disk(Path(name)):
            loaded = datasets.load_from_disk(name)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise UserError(f"{spec}: the saved dataset has no split {split!r} "
                                    f"(splits: {', '.join(loaded)}): pass hf:{name}:SPLIT")
                loaded = loaded[split]
            return loaded
        return datasets.load_dataset(name, config, split=split)
    except (OSError, ValueError) as err:
        # Offline or unknown names end here (ConnectionError and FileNotFoundError are OSErrors).
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"cannot load dataset {name!r} ({reason}): check the name and split, "
                        "or pass a local folder written by save_to_disk as hf:FOLDER") from err


def _saved_to_disk(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in ("dataset_dict.json", "state.json"))


# ---------------------------------------------------------------------------------------------
# record shapes


def _refuse_null(record: dict[str, Any], names: Iterable[str], where: str) -> None:
    """A record whose first known field present is null holds no text: NoText (skipped with a
    warning, as a field that holds a number list)."""
    null = next((name for name in names if name in record), None)
    if null is not None:
        raise NoText(f"{where}: field {null!r} is null, not text")


def record_text(record: dict[str, Any], fields: tuple[str, ...], where: str) -> str:
    if fields:
        present = [f for f in fields if record.get(f) is not None]
        if not present:
            _refuse_null(record, fields, where)
            raise ConfigError("{where} has none of the fields {names} (it has {keys}): check {fields}",
                              where=where, names=", ".join(fields), keys=_keys(record))
        return "\n".join(_field_text(record[f], f, where) for f in present)
    for shape in _SHAPES:
        chosen = [_first_present(record, slot) for slot in shape]
        if chosen[0] is None:
            continue
        parts = [_field_text(record[name], name, where) for name in chosen if name is not None]
        return "\n".join(p for p in parts if p)
    _refuse_null(record, [name for shape in _SHAPES for name in shape[0]], where)
    raise ConfigError("{where} has no known text fields (it has {keys}): " + _FIELD_HINT, where=where,
                      keys=_keys(record))


# Known record shapes, tried in order. A shape is a list of slots joined with newlines; a slot
# lists alternative field names (the first present one is used). The first slot must be present,
# the others are optional (prompt-only files have no answers).
_SHAPES: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("turns",), ("reference",)),  # Spec-Bench
    (("messages", "conversations"),),  # chat: lists of {role/from, content/value}
    (("instruction",), ("input",), ("output", "response")),  # Alpaca
    (("question",), ("answer",)),  # GSM8K
    (("prompt",), ("completion", "response", "output")),
    (("text",),),
)


def record_turns(record: dict[str, Any], fields: tuple[str, ...], where: str) -> tuple[str, ...]:
    """The user turns of one record (never the answers): the named `fields` as one turn, or else
    the first known prompt shape."""
    if fields:
        return (record_text(record, fields, where),)
    if record.get("turns") is not None:
        return tuple(_item_text(turn, "turns", where) for turn in _as_list(record["turns"], "turns", where))
    chat = _first_present(record, ("messages", "conversations"))
    if chat is not None:
        turns = tuple(_item_text(m, chat, where) for m in _as_list(record[chat], chat, where)
                      if isinstance(m, dict) and (m.get("role") or m.get("from")) in _USER_ROLES)
        if not turns:
            raise ConfigError("{where}: field {name!r} has no user message (role user or from human): " + _FIELD_HINT,
                              where=where, name=chat)
        return turns
    if record.get("instruction") is not None:
        parts = [_field_text(record[name], name, where) for name in ("instruction", "input")
                 if record.get(name) is not None]
        return ("\n\n".join(p.strip() for p in parts if p.strip()),)
    name = _first_present(record, ("question", "prompt", "text"))
    if name is None:
        _refuse_null(record, ("turns", "messages", "conversations", "instruction", "question", "prompt", "text"), where)
        raise ConfigError("{where} has no known prompt fields (it has {keys}): " + _FIELD_HINT, where=where,
                          keys=_keys(record))
    return (_field_text(record[name], name, where),)


_USER_ROLES = frozenset(["user", "human"])
# A prompt field and the fields that may hold its answer, for the shapes that carry one.
_ANSWERS = (("instruction", ("output", "response")), ("question", ("answer",)),
            ("prompt", ("completion", "response", "output")))


def record_answer(record: dict[str, Any], fields: tuple[str, ...], where: str) -> str:
    """The answer a record holds to its first user turn (Alpaca `output`, GSM8K `answer`, a
    `prompt`'s `completion`), or "" when its shape has none or `fields` name what to read."""
    if fields or record.get("turns") is not None or _first_present(record, ("messages", "conversations")):
        return ""
    for prompt, answers in _ANSWERS:
        if record.get(prompt) is not None:
            name = _first_present(record, answers)
            return "" if name is None else _field_text(record[name], name, where)
    return ""


def _as_list(value: Any, name: str, where: str) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise NoText(f"{where}: field {name!r} is a {type(value).__name__}, not a list of turns")


def _first_present(record: dict[str, Any], slot: tuple[str, ...]) -> str | None:
    return next((name for name in slot if record.get(name) is not None), None)


def _field_text(value: Any, name: str, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list):
        return "\n".join(_item_text(item, name, where) for item in value)
    raise NoText(f"{where}: field {name!r} is a {type(value).__name__}, not text")


def _item_text(item: Any, name: str, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, list):
        return "\n".join(_item_text(inner, name, where) for inner in item)
    if isinstance(item, dict):
        for key in ("content", "value", "text"):
            if isinstance(item.get(key), str):
                return item[key]
    raise NoText(f"{where}: field {name!r} holds a {type(item).__name__} that is not text")


def _keys(record: dict[str, Any]) -> str:
    keys = sorted(map(str, record))
    return ", ".join(keys[:10]) + (", ..." if len(keys) > 10 else "") if keys else "no fields"
