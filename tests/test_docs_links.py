"""The documents' links resolve: every relative link in the READMEs and the benchmark pages names a
file of the checkout (and a heading of it, after `#`), and every section a text cites as
BENCHMARKS.md and a title in quotes after it is listed on the summary page."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
CITED = re.compile(r'BENCHMARKS\.md,? \(?"([^"]+)"')


def documents() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    return pages + sorted(p for p in (ROOT / "tools").rglob("README.md"))


def anchor(heading: str) -> str:
    """GitHub's id of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_relative_links_in_the_documents_resolve():
    broken = []
    for page in documents():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, fragment = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or fragment and path.is_file() and fragment not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert len(documents()) > 20  # the dated result files are among them


def test_sections_cited_by_title_are_on_the_summary_page():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    titles = [line[3:] for line in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
              if line.startswith("## ")]
    cited = {(name, title) for name in files
             for title in CITED.findall(" ".join((ROOT / name).read_text(encoding="utf-8").split()))}
    assert cited, "no citation found: the pattern is wrong"
    missing = [f"{name}: {title}" for name, title in sorted(cited)
               if not any(t.replace("`", "").startswith(title.replace("`", "")) for t in titles)]
    assert not missing, missing
