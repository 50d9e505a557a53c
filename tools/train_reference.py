"""Train samctl's reference models: a byte-level BPE tokenizer, a Llama target and a small Llama draft.

No model can be downloaded where samctl is developed, and random weights accept no drafts, so this
script trains small real models on local corpora only:

- the Python standard library source (`sysconfig.get_paths()['stdlib']`, tests and site-packages
  left out),
- Debian's plain-text package documentation (`/usr/share/doc`: copyright, README, NEWS, *.txt ...,
  gzip-compressed ones included),
- the instruction sets in `--data-dir` (GSM8K, Code Alpaca, GPTeacher role-play), when present,
- synthetic tasks built from those texts whose answers copy from the prompt (the workload samctl
  speeds up): code edits of stdlib chunks, lead-sentence summaries, question answering by quoting,
  plain repetition, and random token ids repeated 2-4 times (which only copying can predict).

Every source is split by document (file path or row number) into train and held-out parts, so the
held-out loss per source is measured on documents the models never saw. Both models share the
tokenizer and are saved as ordinary Hugging Face folders (bfloat16 safetensors, tied embeddings,
`generation_config.json` with the EOS id) that `AutoModelForCausalLM` / `AutoTokenizer` load offline.

The script knows nothing of samctl's decoding code: it only produces model folders and a
`train_report.json` (command, configuration, data mixture, sizes, speed, held-out losses).
Deterministic given `--seed` and `--max-steps`; with `--minutes` the step count follows the clock,
and the report records the steps taken so that `--max-steps` reproduces the run. `--init-from`
continues training saved models (keeping their tokenizer) and `--mixture` reweights the sources, so
a run can be staged: the embedded default needed a copy-heavy stage before the models copied.

    python tools/train_reference.py --out runs/default --minutes 42 --threads 1 --data-dir ../shared/data
    python tools/train_reference.py --device cuda --preset gpu-base --out runs/gpu-base --minutes 25
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import hashlib
import inspect
import json
import math
import os
import random
import re
import shlex
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from samctl.index.corpus import iter_prompts
from samctl.train.prompts import INSTRUCTION_SETS

EOS_TOKEN = "<|endoftext|>"
INSTRUCTION_HEADER = "### Instruction:\n"
RESPONSE_HEADER = "### Response:\n"
# Renders exactly what `instruction_prompt` builds, so the training data and
# `tokenizer.apply_chat_template(..., add_generation_prompt=True)` agree token for token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '### Response:\\n' }}{%- endif -%}"
)
HELDOUT_PERCENT = 3  # share of documents of every source kept out of training
CHARS_PER_TOKEN = 3.3  # rough, only to size how much text to generate per source
TOKENIZER_MAX_LENGTH = 1_000_000  # left open on the tokenizer; the model config has the real limit


# ----------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class ModelShape:
    """A Llama shape; `params` is derived for a given vocabulary (tied embeddings)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    def params(self, vocab: int) -> int:
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return vocab * self.hidden + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden


@dataclass(frozen=True)
class Preset:
    """Named sizes: vocabulary, both model shapes, sequence length and data volume."""

    vocab_size: int
    target: ModelShape
    draft: ModelShape
    seq_len: int
    batch_size: int
    target_lr: float
    draft_lr: float
    data_tokens: int  # training tokens to generate (the loop cycles over them)
    eval_tokens: int  # held-out tokens per source


PRESETS: dict[str, Preset] = {
    # Sized for a 2-core CPU. Measured with bf16 autocast and one thread on a machine shared with
    # other jobs: 1.0k-3.8k tokens/s for the target, 2.5k-3.7k for the draft (tools/README.md).
    "cpu-small": Preset(
        vocab_size=4096,
        target=ModelShape(hidden=256, layers=6, intermediate=704, heads=4, kv_heads=4),
        draft=ModelShape(hidden=128, layers=4, intermediate=352, heads=4, kv_heads=4),
        seq_len=1024, batch_size=4, target_lr=2e-3, draft_lr=3e-3,
        data_tokens=14_000_000, eval_tokens=16_384,
    ),
    "gpu-base": Preset(
        vocab_size=8192,
        target=ModelShape(hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=12),
        draft=ModelShape(hidden=256, layers=4, intermediate=704, heads=4, kv_heads=4),
        seq_len=2048, batch_size=16, target_lr=6e-4, draft_lr=2e-3,
        data_tokens=60_000_000, eval_tokens=65_536,
    ),
    # For tests: seconds on a CPU.
    "tiny": Preset(
        vocab_size=512,
        target=ModelShape(hidden=32, layers=2, intermediate=64, heads=2, kv_heads=2),
        draft=ModelShape(hidden=16, layers=1, intermediate=32, heads=2, kv_heads=2),
        seq_len=512, batch_size=2, target_lr=3e-3, draft_lr=3e-3,
        data_tokens=20_000, eval_tokens=512,
    ),
}

# Share of training tokens per source. Copy-heavy synthetic tasks dominate: they teach the
# induction behaviour (copy what followed the same context earlier) that retrieval drafts rely on.
MIXTURE: dict[str, float] = {
    "code_edit": 0.22,
    "summarize": 0.12,
    "quote_qa": 0.12,
    "repeat": 0.10,
    "random_repeat": 0.10,
    "stdlib_code": 0.11,
    "debian_docs": 0.05,
    "gsm8k": 0.07,
    "codealpaca": 0.06,
    "roleplay": 0.05,
}
# Sources generated in token space once the tokenizer exists (no text, no template).
TOKEN_SOURCES = ("random_repeat",)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run; recorded in `train_report.json`."""

    out: str
    preset: str = "cpu-small"
    seed: int = 0
    device: str = "cpu"
    minutes: float | None = None  # training budget for both models together
    max_steps: int | None = None  # per model; overrides the clock when both are given
    target_share: float = 0.7  # share of `minutes` spent on the target
    threads: int = 2
    amp: str = "auto"  # bf16 autocast: auto = on where the hardware supports it
    checkpoint_minutes: float = 5.0
    warmup_steps: int = 60
    data_dir: str | None = None
    stdlib_dir: str | None = None
    docs_dir: str = "/usr/share/doc"
    data_tokens: int | None = None  # overrides the preset's
    models: tuple[str, ...] = ("target", "draft")
    init_from: str | None = None  # continue <init_from>/{target,draft} where present, keep its tokenizer
    mixture: tuple[tuple[str, float], ...] = ()  # overrides MIXTURE: listed sources only, renormalised
    lr: float | None = None  # peak learning rate for every model trained (default: the preset's)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}: pick one of {sorted(PRESETS)}")
        if self.minutes is None and self.max_steps is None:
            raise ValueError("give --minutes, --max-steps or both")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"--minutes must be positive, got {self.minutes}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"--max-steps must be >= 0, got {self.max_steps}")
        if self.max_steps == 0 and not self.init_from:
            raise ValueError("--max-steps 0 (evaluate only) needs --init-from")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not 0 < self.target_share < 1:
            raise ValueError(f"--target-share must be in (0, 1), got {self.target_share}")
        if self.amp not in ("auto", "on", "off"):
            raise ValueError(f"--amp must be auto, on or off, got {self.amp!r}")
        unknown = {name for name, _ in self.mixture} - set(MIXTURE)
        weights = [w for _, w in self.mixture]
        if unknown or any(w < 0 for w in weights) or (weights and not sum(weights)):
            raise ValueError(f"--mixture: sources must be among {list(MIXTURE)} with weights >= 0, "
                             f"not all zero (unknown: {sorted(unknown)})")
        if not set(self.models) <= {"target", "draft"} or not self.models:
            raise ValueError(f"--models must name target and/or draft, got {self.models}")

    @property
    def sizes(self) -> Preset:
        return PRESETS[self.preset]

    @property
    def weights(self) -> dict[str, float]:
        """Share of training tokens per source (every MIXTURE source, zero where left out)."""
        if not self.mixture:
            return dict(MIXTURE)
        given = dict(self.mixture)
        total = sum(given.values())
        return {source: given.get(source, 0.0) / total for source in MIXTURE}


# ----------------------------------------------------------------------------------------------
# Documents: the raw local texts, split into train / held-out by a hash of their key


def is_heldout(key: str) -> bool:
    """Stable across runs and machines (no Python hash randomisation)."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


@dataclass(frozen=True)
class Document:
    key: str
    text: str


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_stdlib(root: Path, max_bytes: int = 200_000) -> list[Document]:
    """Library modules only: site-packages, test suites and huge generated files are skipped."""
    skip_dirs = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip_dirs & set(rel.parts[:-1]) or path.stat().st_size > max_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(f"stdlib/{rel.as_posix()}", text))
    return docs


_DOC_NAME = re.compile(
    r"^(copyright|readme.*|news.*|todo.*|authors.*|thanks.*|changelog.*|.*\.(txt|md|rst))(\.gz)?$",
    re.IGNORECASE,
)


def read_docs(root: Path, max_bytes: int = 300_000) -> list[Document]:
    """Plain-text documentation; identical texts (shared licence files) are kept once."""
    docs, seen = [], set()
    if not root.is_dir():
        return docs
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.is_symlink() or not _DOC_NAME.match(path.name):
            continue
        try:
            raw = path.read_bytes()
            if path.suffix == ".gz":
                raw = gzip.decompress(raw)
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        digest = hashlib.sha1(raw).digest()
        if len(raw) > max_bytes or "\x00" in text or digest in seen or len(text) < 200:
            continue
        seen.add(digest)
        docs.append(Document(f"doc/{path.relative_to(root).as_posix()}", text))
    return docs


_DOCSTRING = re.compile(r'"""(.*?)"""', re.DOTALL)


def docstrings(code_docs: list[Document], min_chars: int = 300) -> list[Document]:
    """Long prose docstrings of the stdlib, dedented, as documents keyed by their file."""
    out = []
    for doc in code_docs:
        for i, match in enumerate(_DOCSTRING.finditer(doc.text)):
            text = inspect.cleandoc(match.group(1))
            letters = sum(c.isalpha() or c == " " for c in text)
            if len(text) >= min_chars and letters > 0.8 * len(text):
                out.append(Document(f"{doc.key}#doc{i}", text))
    return out


# ----------------------------------------------------------------------------------------------
# Examples: a source name, a prompt (may be empty for raw text) and the text to predict after it


@dataclass(frozen=True)
class Example:
    source: str
    prompt: str
    response: str


def instruction_prompt(instruction: str) -> str:
    """The prompt format of every instruction example (= the chat template's user turn)."""
    return f"{INSTRUCTION_HEADER}{instruction}\n\n{RESPONSE_HEADER}"


def paragraphs_window(text: str, rng: random.Random, min_chars: int, max_chars: int) -> str | None:
    """Consecutive paragraphs from a random start, between min_chars and max_chars long."""
    paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paras:
        return None
    start = rng.randrange(len(paras))
    out = ""
    for para in paras[start:]:
        candidate = f"{out}\n\n{para}" if out else para
        if len(candidate) > max_chars:
            break
        out = candidate
        if len(out) >= min_chars and rng.random() < 0.3:
            break
    return out if len(out) >= min_chars else None


def line_window(text: str, rng: random.Random, min_lines: int, max_lines: int, max_chars: int) -> str | None:
    """A chunk of lines, preferably starting at a def/class, cut to max_chars at a line end."""
    lines = text.splitlines()
    if len(lines) < min_lines:
        return None
    starts = [i for i, line in enumerate(lines) if re.match(r"\s*(def|class|@)\s*", line)]
    start = rng.choice(starts) if starts and rng.random() < 0.8 else rng.randrange(len(lines))
    chunk = lines[start:start + rng.randint(min_lines, max_lines)]
    while chunk and len("\n".join(chunk)) > max_chars:
        chunk.pop()
    while chunk and not chunk[-1].strip():
        chunk.pop()
    if len(chunk) < min_lines // 2 or not any(line.strip() for line in chunk):
        return None
    return "\n".join(chunk) + "\n"


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\[])")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of sentences; end excludes the whitespace that follows."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text.rstrip())))
    return spans


# -- code edits: each returns (instruction phrase, edited code) or None when it does not apply --

_KEYWORDS = set(
    "False None True and as assert async await break class continue def del elif else except "
    "finally for from global if import in is lambda nonlocal not or pass raise return try while "
    "with yield self cls print len str int list dict set tuple object type super range isinstance".split()
)
_NEW_NAME_PARTS = ["new", "old", "tmp", "local", "my", "cur", "next", "base", "raw", "saved"]
_DOC_VERBS = ["Return", "Compute", "Build", "Handle", "Check", "Update", "Parse", "Create"]
_COMMENT_TEXTS = [
    "keep this in sync with the caller", "TODO: handle errors here", "NOTE: order matters",
    "fast path", "this is checked above", "see the module docstring", "FIXME: slow for large inputs",
]


def _identifiers(code: str) -> list[str]:
    names = re.findall(r"\bdef ([A-Za-z_]\w+)|^\s*([A-Za-z_]\w+) = ", code, re.MULTILINE)
    flat = sorted({a or b for a, b in names} - _KEYWORDS)
    return [n for n in flat if len(n) >= 3 and len(re.findall(rf"\b{n}\b", code)) >= 2]


def edit_rename(code: str, rng: random.Random) -> tuple[str, str] | None:
    names = _identifiers(code)
    if not names:
        return None
    old = rng.choice(names)
    part = rng.choice(_NEW_NAME_PARTS)
    new = f"{part}_{old.lstrip('_')}" if rng.random() < 0.5 else f"{old}_{part}"
    if re.search(rf"\b{new}\b", code):
        return None
    return f"rename `{old}` to `{new}` everywhere", re.sub(rf"\b{old}\b", new, code)


def edit_add_docstring(code: str, rng: random.Random) -> tuple[str, str] | None:
    lines = code.splitlines(keepends=True)
    candidates = [
        i for i, line in enumerate(lines[:-1])
        if re.match(r"\s*def \w+\(.*\).*:\s*$", line) and '"""' not in lines[i + 1]
    ]
    if not candidates:
        return None
    i = rng.choice(candidates)
    name = re.match(r"\s*def (\w+)", lines[i]).group(1)
    words = name.strip("_").replace("_", " ") or name
    doc = f"{rng.choice(_DOC_VERBS)} the {words}."
    indent = re.match(r"\s*", lines[i]).group(0) + "    "
    lines.insert(i + 1, f'{indent}"""{doc}"""\n')
    return f'add the docstring "{doc}" to `{name}`', "".join(lines)


def edit_change_constant(code: str, rng: random.Random) -> tuple[str, str] | None:
    lines = code.splitlines(keepends=True)
    candidates = [i for i, line in enumerate(lines) if re.search(r"(?<![\w.])\d+(?![\w.])", line)]
    if not candidates:
        return None
    i = rng.choice(candidates)
    match = re.search(r"(?<![\w.])\d+(?![\w.])", lines[i])
    old = match.group(0)
    new = str(int(old) + rng.choice([1, 2, 10, 100]) if rng.random() < 0.7 else rng.randint(0, 64))
    if new == old:
        return None
    changed = lines[i][:match.start()] + new + lines[i][match.end():]
    instruction = f"on the line `{lines[i].strip()}`, change {old} to {new}"
    lines[i] = changed
    return instruction, "".join(lines)


def edit_delete_function(code: str, rng: random.Random) -> tuple[str, str] | None:
    lines = code.splitlines(keepends=True)
    defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+", line)]
    if not defs:
        return None
    i = rng.choice(defs)
    indent = len(lines[i]) - len(lines[i].lstrip())
    start = i
    while start > 0 and lines[start - 1].strip().startswith("@"):
        start -= 1
    end = i + 1
    # the body: blank lines and lines indented deeper than the def
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    if end == len(lines) and end - i < 3:  # the chunk cut the function off: nothing sensible to delete
        return None
    while end > i + 1 and not lines[end - 1].strip() and end < len(lines):
        end -= 1  # keep the blank lines that separated it from the next block
    name = re.match(r"\s*def (\w+)", lines[i]).group(1)
    kind = "method" if indent else "function"
    return f"delete the {kind} `{name}`", "".join(lines[:start] + lines[end:])


def edit_add_comment(code: str, rng: random.Random) -> tuple[str, str] | None:
    lines = code.splitlines(keepends=True)
    candidates = [i for i, line in enumerate(lines) if len(line.strip()) > 8 and "`" not in line]
    if not candidates:
        return None
    i = rng.choice(candidates)
    text = rng.choice(_COMMENT_TEXTS)
    indent = re.match(r"\s*", lines[i]).group(0)
    instruction = f"add the comment `# {text}` above the line `{lines[i].strip()}`"
    lines.insert(i, f"{indent}# {text}\n")
    return instruction, "".join(lines)


def edit_replace_string(code: str, rng: random.Random) -> tuple[str, str] | None:
    literals = sorted(set(re.findall(r"'([A-Za-z_][\w ]{1,20})'|\"([A-Za-z_][\w ]{1,20})\"", code)))
    literals = [a or b for a, b in literals]
    if not literals:
        return None
    old = rng.choice(literals)
    new = rng.choice([old.upper(), old + "_" + rng.choice(_NEW_NAME_PARTS), rng.choice(_NEW_NAME_PARTS)])
    if new == old:
        return None
    edited = re.sub(rf"(['\"]){re.escape(old)}\1", lambda m: m.group(1) + new + m.group(1), code)
    return f"replace the string '{old}' with '{new}'", edited


CODE_EDITS: list[Callable[[str, random.Random], tuple[str, str] | None]] = [
    edit_rename, edit_add_docstring, edit_change_constant,
    edit_delete_function, edit_add_comment, edit_replace_string,
]
_EDIT_PHRASES = [
    "Rewrite this file with the following change: {change}.",
    "Rewrite this file so that you {change}.",
    "Edit the code below: {change}. Output the whole file.",
]


def make_code_edit(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    code = line_window(doc.text, rng, 20, 120, max_chars)
    if code is None:
        return None
    result = rng.choice(CODE_EDITS)(code, rng)
    if result is None or result[1] == code:
        return None
    change, edited = result
    instruction = rng.choice(_EDIT_PHRASES).format(change=change) + f"\n\n```python\n{code}```"
    return Example("code_edit", instruction_prompt(instruction), f"```python\n{edited}```")


_SUMMARY_PHRASES = [
    "Summarize the following document in {n} {sentences}.",
    "Write a {n}-sentence summary of this text.",
    "Give a short summary ({n} {sentences}) of the document below.",
]


def make_summary(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    text = paragraphs_window(doc.text, rng, 300, max_chars)
    if text is None:
        return None
    spans = sentence_spans(text)
    n = rng.randint(1, 3)
    if len(spans) < n + 2:
        return None
    summary = text[:spans[n - 1][1]]  # the lead sentences, character for character
    phrase = rng.choice(_SUMMARY_PHRASES).format(n=n, sentences="sentence" if n == 1 else "sentences")
    return Example("summarize", instruction_prompt(f"{phrase}\n\n{text}"), summary)


_STOPWORDS = set("the this that with from have will your their there which when what were been into "
                 "than then them they these those also such only some more most other about".split())
_QUESTION_PHRASES = [
    'Which sentence of the passage mentions "{p}"?',
    "What does the passage say about {p}?",
    'Quote the sentence that talks about "{p}".',
]


def make_quote_qa(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    if doc.key.startswith("stdlib/") and "#" not in doc.key:  # a code file, not one of its docstrings
        return _make_code_quote(doc, rng, max_chars)
    text = paragraphs_window(doc.text, rng, 300, max_chars)
    if text is None:
        return None
    sentences = [text[a:b] for a, b in sentence_spans(text) if 30 <= b - a <= 400]
    if len(sentences) < 2:
        return None
    sentence = rng.choice(sentences)
    words = re.findall(r"[A-Za-z][\w-]{3,}", sentence)
    words = [w for w in words if w.lower() not in _STOPWORDS]
    if not words:
        return None
    k = rng.randint(0, len(words) - 1)
    phrase = " ".join(words[k:k + rng.randint(1, 2)])
    if phrase not in sentence or text.count(phrase) != 1:
        return None
    question = rng.choice(_QUESTION_PHRASES).format(p=phrase)
    instruction = ("Answer the question by quoting the passage.\n\nPassage:\n"
                   f"{text}\n\nQuestion: {question}")
    return Example("quote_qa", instruction_prompt(instruction), sentence)


def _make_code_quote(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    code = line_window(doc.text, rng, 20, 80, max_chars)
    if code is None:
        return None
    defs = re.findall(r"^\s*(def|class) (\w+)(.*)$", code, re.MULTILINE)
    if not defs:
        return None
    kind, name, rest = rng.choice(defs)
    answer = f"{kind} {name}{rest}".strip()
    if code.count(f"{kind} {name}") != 1:
        return None
    instruction = ("Answer the question by quoting the code.\n\n"
                   f"```python\n{code}```\n\nQuestion: Which line defines `{name}`?")
    return Example("quote_qa", instruction_prompt(instruction), answer)


_REPEAT_PHRASES = ["Repeat the following text exactly.", "Copy the text below without changes."]


def make_repeat(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    """The plainest copy task: short, so that many copies fit a step while induction forms."""
    if doc.key.startswith("stdlib/") and "#" not in doc.key:
        code = line_window(doc.text, rng, 4, 30, max_chars // 2)
        text = None if code is None else f"```python\n{code}```"
    else:
        text = paragraphs_window(doc.text, rng, 80, max_chars // 2)
    if text is None:
        return None
    return Example("repeat", instruction_prompt(f"{rng.choice(_REPEAT_PHRASES)}\n\n{text}"), text)


def make_raw_code(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    code = line_window(doc.text, rng, 40, 300, max_chars)
    return None if code is None else Example("stdlib_code", "", code)


def make_raw_doc(doc: Document, rng: random.Random, max_chars: int) -> Example | None:
    text = paragraphs_window(doc.text, rng, 200, max_chars)
    return None if text is None else Example("debian_docs", "", text)


# ----------------------------------------------------------------------------------------------
# The mixture


@dataclass
class Corpora:
    """Documents per role, already restricted to one split."""

    code: list[Document]
    prose: list[Document]  # Debian docs, stdlib docstrings, role-play answers
    docs: list[Document]  # Debian docs only
    rows: dict[str, list[tuple[str, str]]]


def read_instruction_rows(data_dir: Path | None) -> dict[str, list[tuple[str, str]]]:
    """(instruction, response) pairs per instruction set (GSM8K `gsm8k_train.jsonl`, Code Alpaca
    `codealpaca.json`, GPTeacher `gpteacher_roleplay.json`, read as samctl's trainers read prompts; the
    Alpaca sets' responses stripped); missing files give empty lists."""
    rows: dict[str, list[tuple[str, str]]] = {}
    for name, (_, filename) in zip(("gsm8k", "codealpaca", "roleplay"), INSTRUCTION_SETS):
        path = data_dir / filename if data_dir is not None else None
        docs = iter_prompts([str(path)]) if path is not None and path.exists() else ()
        rows[name] = [(doc.turns[0], doc.answer if name == "gsm8k" else doc.answer.strip()) for doc in docs]
    return rows


def load_corpora(cfg: TrainConfig) -> dict[str, Corpora]:
    """{'train': ..., 'eval': ...}: every source split by document key."""
    code = read_stdlib(Path(cfg.stdlib_dir) if cfg.stdlib_dir else default_stdlib_dir())
    docs = read_docs(Path(cfg.docs_dir))
    rows = read_instruction_rows(Path(cfg.data_dir) if cfg.data_dir else None)
    roleplay_docs = [Document(f"roleplay/{i}", r) for i, (_, r) in enumerate(rows["roleplay"])]
    prose = docs + docstrings(code) + roleplay_docs
    split: dict[str, Corpora] = {}
    for name, heldout in (("train", False), ("eval", True)):
        split[name] = Corpora(
            code=_pick(code, heldout), prose=_pick(prose, heldout), docs=_pick(docs, heldout),
            rows={k: [r for i, r in enumerate(v) if is_heldout(f"{k}/{i}") == heldout] for k, v in rows.items()},
        )
    return split


def _pick(docs: list[Document], heldout: bool) -> list[Document]:
    return [d for d in docs if is_heldout(d.key) == heldout]


def generate_source(source: str, corpora: Corpora, rng: random.Random, char_budget: int,
                    max_chars: int) -> list[Example]:
    """Examples of one source until char_budget characters; empty when the source has no data."""
    makers = {
        "code_edit": (corpora.code, make_code_edit),
        "summarize": (corpora.prose, make_summary),
        "quote_qa": (corpora.prose + corpora.code, make_quote_qa),
        "repeat": (corpora.prose + corpora.code, make_repeat),
        "stdlib_code": (corpora.code, make_raw_code),
        "debian_docs": (corpora.docs, make_raw_doc),
    }
    out: list[Example] = []
    if source in makers:
        pool, make = makers[source]
        if not pool:
            return out
        chars, misses = 0, 0
        while chars < char_budget and misses < 2000:
            example = make(rng.choice(pool), rng, max_chars)
            if example is None:
                misses += 1
                continue
            misses = 0
            out.append(example)
            chars += len(example.prompt) + len(example.response)
        return out
    rows = list(corpora.rows[source])
    rng.shuffle(rows)
    chars = 0
    for i in range(len(rows) * 4 if rows else 0):  # cycle at most four times over a small set
        if chars >= char_budget:
            break
        instruction, response = rows[i % len(rows)]
        out.append(Example(source, instruction_prompt(instruction), response))
        chars += len(out[-1].prompt) + len(response)
    return out


def build_examples(cfg: TrainConfig, corpora: dict[str, Corpora]) -> dict[str, dict[str, list[Example]]]:
    """{'train'|'eval': {source: examples}}, deterministic given the seed."""
    sizes = cfg.sizes
    data_tokens = cfg.data_tokens or sizes.data_tokens
    max_chars = int(sizes.seq_len * CHARS_PER_TOKEN * 0.42)  # prompt + copied answer fit one row
    out: dict[str, dict[str, list[Example]]] = {"train": {}, "eval": {}}
    for source in (s for s in MIXTURE if s not in TOKEN_SOURCES):
        train_rng = random.Random(f"{cfg.seed}/train/{source}")
        eval_rng = random.Random(f"{cfg.seed}/eval/{source}")
        budget = int(cfg.weights[source] * data_tokens * CHARS_PER_TOKEN)
        eval_budget = int(sizes.eval_tokens * CHARS_PER_TOKEN * 1.3)
        out["train"][source] = generate_source(source, corpora["train"], train_rng, budget, max_chars)
        out["eval"][source] = generate_source(source, corpora["eval"], eval_rng, eval_budget, max_chars)
    return out


# ----------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """Byte-level BPE wrapped as a PreTrainedTokenizerFast with EOS (= BOS = pad) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN, model_max_length=TOKENIZER_MAX_LENGTH,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast



def tokenizer_sample(examples: dict[str, list[Example]], max_chars: int) -> Iterator[str]:
    """Round-robin over sources so that every source shapes the merges, up to max_chars."""
    sources = sorted(s for s in examples if examples[s])
    per_source = max_chars // max(1, len(sources))
    for source in sources:
        used = 0
        for ex in examples[source]:
            if used >= per_source:
                break
            text = ex.prompt + ex.response
            used += len(text)
            yield text


# ----------------------------------------------------------------------------------------------
# Packing: token rows of seq_len + 1 (inputs = row[:-1], targets = row[1:])


def random_repeats(seed: str, n_tokens: int, vocab_size: int, eos_id: int) -> list[np.ndarray]:
    """Sequences of 8 to 64 uniformly random non-EOS ids, repeated 2 to 4 times, then EOS.

    Only copying lowers the loss on the repeats (nothing else predicts random ids), so these push
    the models to form induction heads early instead of after a long plateau on n-gram statistics.
    """
    rng = np.random.default_rng(int.from_bytes(hashlib.sha1(seed.encode()).digest()[:8], "little"))
    out, total = [], 0
    while total < n_tokens:
        unit = rng.integers(0, vocab_size - 1, size=int(rng.integers(8, 65)), dtype=np.int32)
        unit[unit >= eos_id] += 1  # skip the EOS id
        seq = np.concatenate([np.tile(unit, int(rng.integers(2, 5))), np.asarray([eos_id], np.int32)])
        out.append(seq)
        total += len(seq)
    return out


def encode_examples(tokenizer, examples: list[Example], seq_len: int) -> tuple[list[np.ndarray], int]:
    """Token ids per example, EOS appended; instruction examples longer than a row are dropped
    (a cut answer would teach the model to stop copying mid-way), raw text is truncated."""
    texts = [ex.prompt + ex.response for ex in examples]
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    out, dropped = [], 0
    for ex, enc in zip(examples, encoded):
        ids = np.asarray(enc.ids + [eos], dtype=np.int32)
        if len(ids) > seq_len + 1:
            if ex.prompt:
                dropped += 1
                continue
            ids = ids[:seq_len + 1]
        out.append(ids)
    return out, dropped


def pack_rows(sequences: list[np.ndarray], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit packing of whole examples into rows: (rows int32 [n, seq_len+1], lengths int32 [n]).

    An example never straddles two rows, so every answer sits in the same row as its prompt;
    rows are padded with pad_id after `length` and the padding carries no loss.
    """
    width = seq_len + 1
    rows: list[list[np.ndarray]] = []
    free: list[int] = []
    open_rows: list[int] = []  # rows with room left, in creation order
    for seq in sequences:
        placed = False
        for j, r in enumerate(open_rows):
            if free[r] >= len(seq):
                rows[r].append(seq)
                free[r] -= len(seq)
                if free[r] < 16:
                    open_rows.pop(j)
                placed = True
                break
        if not placed:
            rows.append([seq])
            free.append(width - len(seq))
            open_rows.append(len(rows) - 1)
            if len(open_rows) > 64:  # bounds the scan; the oldest rows are nearly full anyway
                open_rows.pop(0)
    packed = np.full((len(rows), width), pad_id, dtype=np.int32)
    lengths = np.zeros(len(rows), dtype=np.int32)
    for r, parts in enumerate(rows):
        joined = np.concatenate(parts)
        packed[r, :len(joined)] = joined
        lengths[r] = len(joined)
    return packed, lengths


# ----------------------------------------------------------------------------------------------
# Models and training


def llama_config(shape: ModelShape, vocab_size: int, seq_len: int, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=seq_len,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )


def save_model(model, tokenizer, folder: Path, dtype) -> None:
    """Weights in `dtype` (bf16 on disk), tokenizer and generation config; written beside, then
    moved into place, so an interrupted save leaves the previous checkpoint intact."""
    from transformers import GenerationConfig

    tmp = folder.with_name(folder.name + ".tmp")
    half = copy.deepcopy(model).to("cpu", dtype=dtype)
    eos = tokenizer.eos_token_id
    half.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False)
    half.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        folder.rename(old)
        tmp.rename(folder)
        for path in sorted(old.iterdir()):
            path.unlink()
        old.rmdir()
    else:
        tmp.rename(folder)


def batch_loss(model, rows: np.ndarray, lengths: np.ndarray, device: str, amp: bool):
    """Mean next-token cross-entropy over real (unpadded) targets, as a 0-d tensor.

    rows: int32 [B, T+1] token rows; lengths: int32 [B], real tokens per row (the rest is padding).
    """
    import torch
    import torch.nn.functional as F

    ids = torch.as_tensor(rows, dtype=torch.long, device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    positions = torch.arange(targets.shape[1], device=device)[None, :]
    targets[positions >= torch.as_tensor(lengths, device=device)[:, None] - 1] = -100
    with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def evaluate(model, eval_rows: dict[str, tuple[np.ndarray, np.ndarray]], device: str, amp: bool,
             batch_size: int) -> dict[str, float]:
    """Held-out loss (nats/token) per source, token-weighted over that source's rows."""
    import torch

    model.eval()
    losses = {}
    with torch.no_grad():
        for source, (rows, lengths) in eval_rows.items():
            total, count = 0.0, 0
            for start in range(0, len(rows), batch_size):
                r, n = rows[start:start + batch_size], lengths[start:start + batch_size]
                tokens = int((n - 1).sum())
                total += float(batch_loss(model, r, n, device, amp)) * tokens
                count += tokens
            if count:
                losses[source] = round(total / count, 4)
    model.train()
    return losses


@dataclass(frozen=True)
class RunBudget:
    """When one model's training stops: a step count, a deadline, or the first of both."""

    max_steps: int | None
    seconds: float | None

    def progress(self, step: int, elapsed: float) -> float:
        parts = []
        if self.max_steps == 0:  # evaluate only
            return 1.0
        if self.max_steps is not None:
            parts.append(step / self.max_steps)
        if self.seconds is not None:
            parts.append(elapsed / self.seconds)
        return max(parts)


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak at progress 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_model(name: str, shape: ModelShape, lr: float, cfg: TrainConfig, tokenizer,
                train: tuple[np.ndarray, np.ndarray], eval_rows: dict[str, tuple[np.ndarray, np.ndarray]],
                budget: RunBudget, amp: bool, log: Callable[[str], None]) -> dict:
    """Train one model from scratch, checkpointing into cfg.out/name; returns its report entry."""
    import torch
    from transformers import LlamaForCausalLM

    sizes = cfg.sizes
    torch.manual_seed(cfg.seed)
    init = Path(cfg.init_from) / name if cfg.init_from else None
    if init is not None and init.is_dir():
        # Continued training: same weights and shape as the saved model, float32 master copy.
        model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32)
        model = model.to(cfg.device)
        shape = ModelShape(model.config.hidden_size, model.config.num_hidden_layers,
                           model.config.intermediate_size, model.config.num_attention_heads,
                           model.config.num_key_value_heads)
    else:
        config = llama_config(shape, len(tokenizer), sizes.seq_len, tokenizer.eos_token_id)
        model = LlamaForCausalLM(config).to(cfg.device)
    params = sum(p.numel() for p in model.parameters())
    log(f"[{name}] {params / 1e6:.2f}M parameters, shape {dataclasses.asdict(shape)}, "
        f"{'continued from ' + str(init) if init is not None and init.is_dir() else 'from scratch'}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    rows, lengths = train
    order = np.random.default_rng(cfg.seed).permutation(len(rows))
    folder = Path(cfg.out) / name
    save_dtype = torch.bfloat16
    start = time.time()
    last_ckpt, step, cursor, tokens, losses = start, 0, 0, 0, []
    while True:
        elapsed = time.time() - start
        progress = budget.progress(step, elapsed)
        if progress >= 1.0:
            break
        # 1) batch: the next rows of a seeded permutation, reshuffled each epoch
        if cursor + sizes.batch_size > len(order):
            order = np.random.default_rng(cfg.seed + step).permutation(len(rows))
            cursor = 0
        idx = np.sort(order[cursor:cursor + sizes.batch_size])
        cursor += sizes.batch_size
        # 2) step
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress, step, lr, cfg.warmup_steps)
        loss = batch_loss(model, rows[idx], lengths[idx], cfg.device, amp)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += int(lengths[idx].sum())
        step += 1
        # 3) report and checkpoint
        if step % 50 == 0 or step == 1:
            rate = tokens / max(time.time() - start, 1e-9)
            log(f"[{name}] step {step} loss {np.mean(losses[-50:]):.4f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} {rate:,.0f} tok/s")
        if time.time() - last_ckpt > cfg.checkpoint_minutes * 60:
            save_model(model, tokenizer, folder, save_dtype)
            last_ckpt = time.time()
            log(f"[{name}] checkpoint at step {step}")
    train_seconds = time.time() - start
    save_model(model, tokenizer, folder, save_dtype)
    heldout = evaluate(model, eval_rows, cfg.device, amp, sizes.batch_size)
    log(f"[{name}] done: {step} steps, {tokens:,} tokens in {train_seconds:.0f} s; held-out {heldout}")
    size = sum(p.stat().st_size for p in folder.iterdir())
    return {
        "params": params, "shape": dataclasses.asdict(shape), "lr": lr, "steps": step,
        "train_tokens": tokens, "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens / max(train_seconds, 1e-9), 1),
        "final_train_loss": round(float(np.mean(losses[-50:])), 4) if losses else None,
        "first_train_loss": round(losses[0], 4) if losses else None,
        "heldout_loss": heldout, "folder_bytes": size,
    }


# ----------------------------------------------------------------------------------------------
# Driver


def use_amp(cfg: TrainConfig) -> bool:
    import torch

    if cfg.amp != "auto":
        return cfg.amp == "on"
    if cfg.device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return bool(getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")() in ("AVX512", "AMX"))


def run(cfg: TrainConfig, command: str, log: Callable[[str], None] = print) -> dict:
    """The whole pipeline; returns (and writes) the report."""
    import torch

    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.threads))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = cfg.sizes
    log(f"command: {command}")
    t0 = time.time()
    # 1) documents and examples
    examples = build_examples(cfg, load_corpora(cfg))
    # 2) tokenizer, trained on the training split only
    if cfg.init_from:  # the vocabulary must stay the one the weights were trained with
        from transformers import AutoTokenizer

        saved = [Path(cfg.init_from) / n for n in ("target", "draft") if (Path(cfg.init_from) / n).is_dir()]
        if not saved:
            raise SystemExit(f"--init-from {cfg.init_from}: no target/ or draft/ folder there")
        tokenizer = AutoTokenizer.from_pretrained(saved[0])
    else:
        tokenizer = train_tokenizer(tokenizer_sample(examples["train"], 12_000_000), sizes.vocab_size)
    # 3) token rows
    eos = tokenizer.eos_token_id
    train_seqs, mixture = [], {}
    eval_rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    data_tokens = cfg.data_tokens or sizes.data_tokens
    for source in MIXTURE:
        if source in TOKEN_SOURCES:
            seqs, dropped = random_repeats(f"{cfg.seed}/train/{source}", int(cfg.weights[source] * data_tokens),
                                           len(tokenizer), eos), 0
            eval_seqs = random_repeats(f"{cfg.seed}/eval/{source}", sizes.eval_tokens, len(tokenizer), eos)
        else:
            seqs, dropped = encode_examples(tokenizer, examples["train"][source], sizes.seq_len)
            eval_seqs, _ = encode_examples(tokenizer, examples["eval"][source], sizes.seq_len)
        train_seqs += seqs
        mixture[source] = {
            "train_examples": len(seqs), "train_tokens": int(sum(len(s) for s in seqs)),
            "dropped_too_long": dropped, "eval_examples": len(eval_seqs),
            "eval_tokens": int(sum(len(s) for s in eval_seqs)),
        }
        if eval_seqs:
            eval_rows[source] = pack_rows(eval_seqs, sizes.seq_len, eos)
    if not train_seqs:
        raise SystemExit("no training examples: check --stdlib-dir, --docs-dir and --data-dir")
    random.Random(cfg.seed).shuffle(train_seqs)
    train = pack_rows(train_seqs, sizes.seq_len, eos)
    total = sum(m["train_tokens"] for m in mixture.values())
    for source, m in mixture.items():
        m["train_share"] = round(m["train_tokens"] / max(total, 1), 3)
    data_seconds = time.time() - t0
    log(f"data: {total:,} training tokens in {len(train[0])} rows, prepared in {data_seconds:.0f} s")
    log(json.dumps(mixture, indent=1))
    _write_heldout_samples(out, examples["eval"])
    # 4) models: target first (the one everyone needs), then the draft
    amp = use_amp(cfg)
    report = {
        "command": command, "config": dataclasses.asdict(cfg), "preset": dataclasses.asdict(sizes),
        "mixture_weights": cfg.weights, "mixture": mixture, "data_seconds": round(data_seconds, 1),
        "vocab_size": len(tokenizer), "amp_bf16": amp, "torch": torch.__version__, "models": {},
    }
    shares = {"target": cfg.target_share, "draft": 1 - cfg.target_share}
    if len(cfg.models) == 1:
        shares[cfg.models[0]] = 1.0
    for name in cfg.models:
        shape = sizes.target if name == "target" else sizes.draft
        lr = cfg.lr or (sizes.target_lr if name == "target" else sizes.draft_lr)
        seconds = cfg.minutes * 60 * shares[name] if cfg.minutes else None
        budget = RunBudget(cfg.max_steps, seconds)
        report["models"][name] = train_model(name, shape, lr, cfg, tokenizer, train, eval_rows,
                                             budget, amp, log)
        (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"total wall time {time.time() - t0:.0f} s; report in {out / 'train_report.json'}")
    return report


def _write_heldout_samples(out: Path, eval_examples: dict[str, list[Example]], per_source: int = 5) -> None:
    """A few held-out prompts with their reference answers, to pick bundled demo prompts from."""
    with open(out / "heldout_samples.jsonl", "w", encoding="utf-8") as fh:
        for source, examples in eval_examples.items():
            for ex in [e for e in examples if e.prompt][:per_source]:
                fh.write(json.dumps(dataclasses.asdict(ex)) + "\n")


def parse_args(argv: list[str] | None) -> TrainConfig:
    repo = Path(__file__).resolve().parent.parent
    shared = repo.parent / "shared" / "data"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder that receives target/, draft/ and the report")
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    p.add_argument("--minutes", type=float, help="training budget for both models together")
    p.add_argument("--max-steps", type=int, help="optimizer steps per model (exact reproduction); "
                   "0 with --init-from: only measure the held-out losses")
    p.add_argument("--target-share", type=float, default=0.7, help="share of --minutes for the target")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--amp", default="auto", choices=["auto", "on", "off"], help="bf16 autocast")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--data-dir", default=str(shared) if shared.is_dir() else None,
                   help="folder with gsm8k_train.jsonl, codealpaca.json, gpteacher_roleplay.json")
    p.add_argument("--stdlib-dir", default=None, help="Python sources (default: this Python's stdlib)")
    p.add_argument("--docs-dir", default="/usr/share/doc", help="plain-text documentation tree")
    p.add_argument("--data-tokens", type=int, help="training tokens to generate (default: preset's)")
    p.add_argument("--models", default="target,draft", help="which models to train, comma-separated")
    p.add_argument("--mixture", default="", help="override the data mixture, e.g. "
                   "'random_repeat=0.6,repeat=0.2,code_edit=0.2' (other sources get no training tokens)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's, per model)")
    p.add_argument("--init-from", help="continue training the models (and keep the tokenizer) saved in "
                   "this folder's target/ and draft/ instead of starting from scratch")
    a = p.parse_args(argv)
    return TrainConfig(
        out=a.out, preset=a.preset, seed=a.seed, device=a.device, minutes=a.minutes,
        max_steps=a.max_steps, target_share=a.target_share, threads=a.threads, amp=a.amp,
        checkpoint_minutes=a.checkpoint_minutes, warmup_steps=a.warmup_steps, data_dir=a.data_dir,
        stdlib_dir=a.stdlib_dir, docs_dir=a.docs_dir, data_tokens=a.data_tokens,
        models=tuple(m.strip() for m in a.models.split(",") if m.strip()), init_from=a.init_from,
        lr=a.lr, mixture=_parse_mixture(a.mixture),
    )


def _parse_mixture(text: str) -> tuple[tuple[str, float], ...]:
    """'a=0.5,b=0.5' -> (('a', 0.5), ('b', 0.5))."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, weight = item.partition("=")
        if not sep:
            raise SystemExit(f"--mixture: expected source=weight, got {item!r}")
        pairs.append((name.strip(), float(weight)))
    return tuple(pairs)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    command = "python tools/train_reference.py " + shlex.join(argv)
    return run(cfg, command)


if __name__ == "__main__":
    main()
