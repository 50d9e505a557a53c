"""tools/make_code_edit_set.py: every edit is exact, and items come in Spec-Bench shape."""
from __future__ import annotations

import ast
import json
import random
import re

from tools.make_code_edit_set import build, edit_comments, edit_docstrings, edit_quotes, edit_rename, main

CODE = '''def scale(values, factor=2):
    """Multiply every value."""
    # the result list
    out = []
    for v in values:  # each one
        out.append(v * factor)
    print('done', "x")
    return out
'''


def test_edits_are_exact():
    renamed = set()
    for seed in range(40):
        instruction, edited = edit_rename(CODE, random.Random(seed))
        old, new = instruction.split("`")[1], instruction.split("`")[3]
        assert new.startswith(old + "_")
        # here no comment or string holds a defined name as a whole word
        assert edited == re.sub(rf"\b{old}\b", new, CODE), (old, edited)
        renamed.add(old)
    assert renamed == {"factor", "out", "v", "values"}  # used twice or more; `scale` only once
    _, no_comments = edit_comments(CODE, random.Random(0))
    assert "#" not in no_comments and "for v in values:\n" in no_comments
    assert len(no_comments.splitlines()) == len(CODE.splitlines()) - 1
    _, no_docs = edit_docstrings(CODE, random.Random(0))
    assert '"""' not in no_docs and no_docs.count("\n") == CODE.count("\n") - 1
    _, quoted = edit_quotes(CODE.replace("\"x\"", "'x'"), random.Random(0))
    assert "'" not in quoted and 'print("done", "x")' in quoted


def test_build_writes_spec_bench_rows(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text(CODE + "\n\n" + CODE.replace("scale", "shift"))
    rows = build(src, n=5, seed=0, max_chars=2000, heldout_only=False)
    assert rows and len(rows) <= 5
    for row in rows:
        assert row["category"] == "code_edit" and row["edit"] in ("rename", "comments", "docstrings", "quotes")
        code = row["turns"][0].split("```python\n", 1)[1][:-3]
        edited = row["reference"][0][len("```python\n"):-3]
        ast.parse(code), ast.parse(edited)
        assert code != edited
    out = tmp_path / "set.jsonl"
    main(["--out", str(out), "--sources", str(src), "--n", "3", "--all-files"])
    assert [json.loads(line)["question_id"] for line in out.read_text().splitlines()] == [10000, 10001, 10002]
