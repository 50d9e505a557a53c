"""index/ and decode/ install as samctl.index and samctl.decode: a user's own index.py or
decode.py in the working directory must not shadow them."""
from __future__ import annotations

import subprocess
import sys


def test_user_modules_named_index_and_decode_do_not_shadow_samctl(tmp_path):
    for name in ("index", "decode"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('the user module was imported')\n")
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    # `python -m` puts the working directory first on sys.path, where the user's modules are.
    run = subprocess.run([sys.executable, "-m", "samctl", "build", "a.txt", "-o", "a.sam", "--tokenizer", "bytes", "-q"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    probe = "import samctl.decode.loop, samctl.index.store, samctl.decode.engine.target; print('ok')"
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "ok", run.stderr


def test_the_package_never_refers_to_the_repositorys_developer_scripts():
    # tools/ is not installed: a message or docstring that sends a user there points at nothing;
    # nor is a METHODS.md (there is none). (Recorded commands in shipped heads' JSON are history
    # and are left as they ran.)
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    mentions = [f"{path.relative_to(root)}:{n}" for folder in ("samctl", "decode", "index")
                for path in sorted((root / folder).rglob("*")) if path.suffix in (".py", ".md", ".txt")
                and "sample_corpus" not in path.parts
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "tools/" in line or "METHODS.md" in line]
    assert mentions == []
