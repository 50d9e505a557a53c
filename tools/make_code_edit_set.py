"""Build a code-editing benchmark set from local Python sources, in Spec-Bench format.

How it is made:
1. Sources: the `.py` files under --sources (default: this Python's standard library), skipping
   tests, site-packages and files over 200 kB. With --heldout-only (the default) only the files
   that tools/train_reference.py holds out of the reference models' training (its `is_heldout` on
   the key `stdlib/<relative path>`) are used, so the reference models never saw the code.
2. Excerpts: every top-level function or class (decorators included) of 8 to 60 lines and at
   most --max-chars characters that parses on its own. A short excerpt stands in for "the file",
   so that instruction, code and edited code fit a small model's context.
3. Edits: one mechanical, fully determined edit per item, computed with `tokenize`/`ast`, so the
   reference is exactly right:
   - rename      an identifier defined in the excerpt (the def/class name, a parameter or a local
                 assigned there) and used at least twice gets a new name, e.g. `buf` -> `buf_value`
   - comments    every `#` comment is removed (comment-only lines disappear, trailing ones are cut)
   - docstrings  every docstring of the excerpt's functions and classes is deleted
   - quotes      every single-quoted string literal without a double quote inside gets double quotes
   Kinds rotate over excerpts; an excerpt that does not allow its kind is skipped in that round,
   and later rounds give excerpts their other kinds, until --n items.
4. Excerpts are shuffled with --seed and interleaved one per file per round, to spread items
   over files.

Each JSONL row: {"question_id", "category": "code_edit", "edit", "source" (file:line),
"turns": [instruction + the excerpt in a ```python block], "reference": [the edited excerpt in a
```python block]}. `samctl bench --questions` reads it like Spec-Bench; `samctl simulate --traces`
replays drafters against the references. Keep the output out of the repository:

    python tools/make_code_edit_set.py --out ../runs/data/code_edit.jsonl --n 80
"""
from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import keyword
import random
import sys
import sysconfig
import tokenize
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_reference import is_heldout  # noqa: E402  (the reference models' train/held-out split)

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
MIN_LINES, MAX_LINES = 8, 60
SUFFIXES = ("value", "item", "obj", "data", "arg")
INSTRUCTIONS = {
    "rename": "Rename `{old}` to `{new}` everywhere in this code. Output the whole code.",
    "comments": "Remove every comment from this code. Output the whole code.",
    "docstrings": "Delete all docstrings from this code. Output the whole code.",
    "quotes": "Use double quotes instead of single quotes for the string literals in this code. Output the whole code.",
}


def source_files(root: Path, heldout_only: bool) -> Iterator[tuple[str, str]]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or path.stat().st_size > 200_000:
            continue
        if heldout_only and not is_heldout(f"stdlib/{rel.as_posix()}"):
            continue
        try:
            yield rel.as_posix(), path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def excerpts(text: str, max_chars: int) -> Iterator[tuple[int, str]]:
    """(first line, code) of each top-level def/class that fits the bounds."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        code = "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
        n_lines = node.end_lineno - first + 1
        if MIN_LINES <= n_lines <= MAX_LINES and len(code) <= max_chars and _parses(code):
            yield first, code


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except SyntaxError:
        return False


def _tokens(code: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(code).readline))


def _replace_spans(code: str, spans: list[tuple[tuple[int, int], tuple[int, int], str]]) -> str:
    """Replace (start (row, col), end (row, col), text) spans, rows 1-based, right to left."""
    lines = code.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    out = code
    for (sr, sc), (er, ec), text in sorted(spans, reverse=True):
        out = out[: offsets[sr - 1] + sc] + text + out[offsets[er - 1] + ec :]
    return out


def edit_rename(code: str, rng: random.Random) -> tuple[str, str] | None:
    tree = ast.parse(code)
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg) and node.arg not in ("self", "cls"):
            defined.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    names = [t for t in _tokens(code) if t.type == tokenize.NAME]
    counts: dict[str, int] = {}
    for t in names:
        counts[t.string] = counts.get(t.string, 0) + 1
    # Attribute names (x.name), keyword arguments (f(name=...)) and builtins spell the same token
    # but may be other symbols: leave such names alone.
    ambiguous = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    ambiguous |= {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg}
    ambiguous |= set(dir(builtins))
    candidates = sorted(n for n in defined if counts.get(n, 0) >= 2 and n not in ambiguous
                        and not keyword.iskeyword(n) and not n.startswith("__"))
    if not candidates:
        return None
    old = rng.choice(candidates)
    new = f"{old}_{rng.choice(SUFFIXES)}"
    if new in counts:
        return None
    spans = [(t.start, t.end, new) for t in names if t.string == old]
    return INSTRUCTIONS["rename"].format(old=old, new=new), _replace_spans(code, spans)


def edit_comments(code: str, rng: random.Random) -> tuple[str, str] | None:
    comments = [t for t in _tokens(code) if t.type == tokenize.COMMENT]
    if len(comments) < 2:
        return None
    lines = code.splitlines(keepends=True)
    drop_rows = {t.start[0] for t in comments if not lines[t.start[0] - 1][: t.start[1]].strip()}
    cut = {t.start[0]: t.start[1] for t in comments if t.start[0] not in drop_rows}
    out = []
    for row, line in enumerate(lines, start=1):
        if row in drop_rows:
            continue
        out.append(line[: cut[row]].rstrip() + "\n" if row in cut else line)
    return INSTRUCTIONS["comments"], "".join(out)


def edit_docstrings(code: str, rng: random.Random) -> tuple[str, str] | None:
    tree = ast.parse(code)
    rows: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and len(node.body) > 1:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                rows.update(range(first.lineno, first.end_lineno + 1))
    if not rows:
        return None
    lines = code.splitlines(keepends=True)
    return INSTRUCTIONS["docstrings"], "".join(l for row, l in enumerate(lines, start=1) if row not in rows)


def edit_quotes(code: str, rng: random.Random) -> tuple[str, str] | None:
    spans = []
    for t in _tokens(code):
        if t.type != tokenize.STRING:
            continue
        prefix_len = len(t.string) - len(t.string.lstrip("rbuRBUfF"))
        prefix, body = t.string[:prefix_len], t.string[prefix_len:]
        if body.startswith("'") and not body.startswith("'''") and '"' not in body and "\\" not in body:
            spans.append((t.start, t.end, f'{prefix}"{body[1:-1]}"'))
    if len(spans) < 2:
        return None
    return INSTRUCTIONS["quotes"], _replace_spans(code, spans)


EDITS: dict[str, Callable[[str, random.Random], tuple[str, str] | None]] = {
    "rename": edit_rename, "comments": edit_comments, "docstrings": edit_docstrings, "quotes": edit_quotes,
}


def build(root: Path, n: int, seed: int, max_chars: int, heldout_only: bool) -> list[dict]:
    rng = random.Random(seed)
    pool = [(rel, line, code) for rel, text in source_files(root, heldout_only) for line, code in excerpts(text, max_chars)]
    if not pool:
        raise SystemExit(f"no usable excerpts under {root}: pass --sources with Python files"
                         + (" or --all-files" if heldout_only else ""))
    rng.shuffle(pool)
    # Spread over files: one excerpt per file per round.
    by_file: dict[str, list[tuple[str, int, str]]] = {}
    for item in pool:
        by_file.setdefault(item[0], []).append(item)
    order = [item for rnd in range(max(len(v) for v in by_file.values()))
             for items in by_file.values() if rnd < len(items) for item in [items[rnd]]]
    # Round r gives each excerpt its ((i + r) mod 4)-th kind, so kinds rotate and an excerpt
    # serves other edits only once every excerpt had one.
    kinds = list(EDITS)
    rows: list[dict] = []
    for rnd in range(len(kinds)):
        for i, (rel, line, code) in enumerate(order):
            if len(rows) == n:
                return rows
            kind = kinds[(i + rnd) % len(kinds)]
            result = EDITS[kind](code, rng)
            if result is None or result[1] == code or not _parses(result[1]):
                continue
            instruction, edited = result
            rows.append({
                "question_id": 10_000 + len(rows), "category": "code_edit", "edit": kind,
                "source": f"{rel}:{line}",
                "turns": [f"{instruction}\n\n```python\n{code}```"],
                "reference": [f"```python\n{edited}```"],
            })
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSONL file to write (keep it outside the repository)")
    p.add_argument("--sources", default=sysconfig.get_paths()["stdlib"], help="folder of Python files (default: the stdlib)")
    p.add_argument("--n", type=int, default=80, help="items")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-chars", type=int, default=1400, help="longest excerpt (1400 fits a 1024-token model)")
    p.add_argument("--all-files", action="store_true", help="use every file, not only those held out of reference-model training")
    a = p.parse_args(argv)
    rows = build(Path(a.sources), a.n, a.seed, a.max_chars, heldout_only=not a.all_files)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    kinds = {k: sum(r["edit"] == k for r in rows) for k in EDITS}
    files = len({r["source"].rsplit(":", 1)[0] for r in rows})
    print(f"wrote {len(rows)} items from {files} files to {out}: {kinds}", file=sys.stderr)


if __name__ == "__main__":
    main()
