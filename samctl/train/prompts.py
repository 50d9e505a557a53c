"""Prompts the trainers have a target model answer: any corpus `samctl build` reads, or a mixture.

`mixture` interleaves its kinds so that any prefix holds each in equal shares: math, code and
role-play from the instruction sets in `data_dir` (GSM8K, Code Alpaca, GPTeacher), two-turn chat
(a role-play prompt, then a follow-up about the model's first answer), translation and
summarization of local prose (the standard library's docstrings and Debian's documentation).
Nothing is downloaded. A prompt is a `Prompt(kind, turns)`, its user turns answered in order.
"""
from __future__ import annotations

import gzip
import hashlib
import inspect
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from samctl.index.corpus import iter_prompts

INSTRUCTION_SETS = (("math", "gsm8k_train.jsonl"), ("code", "codealpaca.json"), ("roleplay", "gpteacher_roleplay.json"))
LANGUAGES = ("German", "French", "Spanish")
# Second turns of the two-turn chats: requests about the model's own first answer, as MT-bench's are
# (none of them is an MT-bench turn; --exclude drops any that were).
FOLLOW_UPS = (
    "Rewrite your previous answer in a more formal tone.",
    "Summarize your answer in two sentences.",
    "Explain your answer again as if I were ten years old.",
    "Now continue the story from where you stopped.",
    "Give three more examples in the same style.",
    "Rewrite your answer as a short poem.",
    "What would you do differently if you had to do it again? Answer in character.",
    "Turn your previous response into a list of bullet points.",
    "Make your previous answer shorter and keep only the most important points.",
    "Write a title for your previous answer and explain why you chose it.",
)


@dataclass(frozen=True)
class Prompt:
    kind: str  # where it came from: an input's kind ("math", "translation", ...) or "corpus"
    turns: tuple[str, ...]  # user turns, in order
    answer: str = ""  # the input's own answer to the first turn, when its record holds one


def read_prompts(inputs: Iterable[str], fields: Iterable[str] = ()) -> list[Prompt]:
    """The user turns (and own answer, if any) of every record of `inputs` (any `samctl build` input)."""
    return [Prompt("corpus", doc.turns, doc.answer) for doc in iter_prompts(list(inputs), fields=tuple(fields))]


def mixture(data_dir: Path | None, seed: int = 0) -> list[Prompt]:
    """The built-in mixture (module docstring), interleaved kind by kind."""
    rng = random.Random(seed)
    kinds: dict[str, list[Prompt]] = {}
    for kind, name in INSTRUCTION_SETS:
        path = Path(data_dir) / name if data_dir is not None else None
        if path is not None and path.exists():
            kinds[kind] = [Prompt(kind, doc.turns) for doc in iter_prompts([str(path)])]
    if "roleplay" in kinds:  # half of the role-play prompts get a second turn
        roleplay = kinds.pop("roleplay")
        rng.shuffle(roleplay)
        half = len(roleplay) // 2
        kinds["roleplay"] = roleplay[:half]
        kinds["chat2"] = [Prompt("chat2", p.turns + (rng.choice(FOLLOW_UPS),)) for p in roleplay[half:]]
    sentences, texts = local_texts()
    kinds["translation"] = [Prompt("translation", (f"Translate English to {rng.choice(LANGUAGES)}: {s}",))
                            for s in sentences]
    kinds["summarization"] = [Prompt("summarization", (f"Summarize: {t}",)) for t in texts]
    for prompts in kinds.values():
        rng.shuffle(prompts)
    order = sorted(kinds)
    out: list[Prompt] = []
    for i in range(max(map(len, kinds.values()))):
        out += [kinds[k][i] for k in order if i < len(kinds[k])]
    return out


def drop_excluded(prompts: list[Prompt], exclude: Iterable[str]) -> tuple[list[Prompt], int]:
    """Prompts none of whose turns is (whitespace and case aside) a turn of the `exclude` inputs;
    -> (prompts, number dropped)."""
    exclude = list(exclude)
    if not exclude:
        return prompts, 0
    turns = {_normal(turn) for doc in iter_prompts(exclude) for turn in doc.turns}
    kept = [p for p in prompts if not any(_normal(t) in turns for t in p.turns)]
    return kept, len(prompts) - len(kept)


def _normal(text: str) -> str:
    return " ".join(text.split()).lower()


# -- local text: sentences to translate, texts to summarize -----------------------------------

_DOC_NAME = re.compile(r"^(readme.*|news.*|faq.*|.*\.(txt|md|rst))(\.gz)?$", re.IGNORECASE)
_DOCSTRING = re.compile(r'"""(.*?)"""', re.DOTALL)
_SENTENCE_END = re.compile(r"(?<=[a-z][.!?])\s+(?=[A-Z])")
_CODE_MARKS = re.compile(r"[_{}\[\]<>|=*#`@\\/]|\(\)|::|>>>|\.\.\.|--|https?:")


def local_texts() -> tuple[list[str], list[str]]:
    """(sentences of 8..40 words, texts of 80..300 words) of prose found locally: the
    standard library's docstrings and Debian's plain-text documentation, each kept once, in a
    fixed order. Lines that look like code, lists or tables are left out."""
    sentences: dict[str, None] = {}
    texts: dict[str, None] = {}
    for document in _local_documents(Path(sysconfig.get_paths()["stdlib"]), Path("/usr/share/doc")):
        text = ""
        for paragraph in _prose_paragraphs(document):
            for sentence in _SENTENCE_END.split(paragraph):
                if 8 <= len(sentence.split()) <= 40 and sentence[-1] in ".!?":
                    sentences.setdefault(sentence)
            text = f"{text}\n\n{paragraph}".strip() if len((text + paragraph).split()) <= 300 else paragraph
            if len(text.split()) >= 80:
                texts.setdefault(text)
                text = ""
    return list(sentences), list(texts)


def _prose_paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.strip().splitlines()]
        if not lines or any(not line or line[0] in "-*+#|>0123456789" or _CODE_MARKS.search(line) for line in lines):
            continue
        paragraph = " ".join(lines)
        letters = sum(c.isalpha() or c == " " for c in paragraph)
        if len(paragraph.split()) >= 20 and letters > 0.9 * len(paragraph) and paragraph[-1] in ".!?":
            yield paragraph


def _local_documents(stdlib: Path, docs: Path) -> Iterator[str]:
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    seen: set[bytes] = set()
    for path in sorted(stdlib.rglob("*.py")) if stdlib.is_dir() else ():
        if skip & set(path.relative_to(stdlib).parts[:-1]):
            continue
        try:
            code = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for match in _DOCSTRING.finditer(code):
            yield inspect.cleandoc(match.group(1))
    for path in sorted(docs.rglob("*")) if docs.is_dir() else ():
        if not _DOC_NAME.match(path.name) or path.is_symlink() or not path.is_file():
            continue
        try:
            raw = path.read_bytes()
            raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        digest = hashlib.sha1(raw).digest()
        if digest not in seen:  # shared licence and readme files are read once
            seen.add(digest)
            yield text

