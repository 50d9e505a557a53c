"""`--help` and usage errors of the model commands load neither torch nor transformers, and a
store built with another tokenizer is refused before the model loads (issue 24, item 7)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from samctl.tokenizer import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "transformers"}
MODEL_COMMANDS = ("generate", "distill", "simulate", "bench", "calibrate", "chat", "serve")


def _run(args: list[str]) -> tuple[int, str, set[str]]:
    """(exit status, stderr, top-level modules loaded) of `samctl args` in a fresh process."""
    probe = ("import sys\nfrom samctl.cli import main\ncode = 0\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n    code = done.code or 0\n"
             "sys.stderr.write('MODULES ' + ' '.join(sorted({m.split('.')[0] for m in sys.modules})) + '\\n')\n"
             "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL)
    lines = proc.stderr.splitlines()
    modules = set(next(line for line in lines if line.startswith("MODULES ")).split()[1:])
    return proc.returncode, "\n".join(line for line in lines if not line.startswith("MODULES ")), modules


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_help_of_model_commands_loads_no_torch(command):
    code, err, modules = _run([command, "--help"])
    assert code == 0, err
    assert not modules & HEAVY


@pytest.mark.parametrize("args", [
    ["generate", "--prompt", "x", "--threads", "0"],
    ["generate", "--prompt", "x", "--temperature", "-1"],
    ["generate", "--prompt", "x", "--max-new-tokens", "0"],
    ["generate", "--prompt", "x", "--max-nodes", "-1"],
    ["generate", "--prompt", "x", "--max-nodes", "4000000000000"],  # numpy tried 14.6 TiB (issue 42, item 14)
    ["generate", "--input", "README.md", "--batch-size", "100000"],
    ["serve", "--port", "99999"],  # an OverflowError in the event loop, then a native thread's abort
    ["generate", "--prompt", "x", "--gamma", "0", "--method", "sd"],
    ["generate", "--prompt", "x", "--sam", "missing.sam"],
    ["distill", "--prompts", "README.md", "-o", "x.sam", "--threads", "0"],
    ["bench", "--questions", "README.md", "--out", "x", "--threads", "0"],
    ["calibrate", "--threads", "0"],
    ["chat", "--threads", "0"],
    ["serve", "--threads", "0"],
    ["serve", "--batch-size", "0"],
    ["serve", "--sam", "missing.sam"],
    ["generate", "--prompt", "x", "--method", "specdec++"],  # no acceptance head: refused by the plan, not after loading
    ["chat", "--method", "eagle", "--model", "README.md"],
    ["serve", "--method", "sd", "--model", "README.md"],
])
def test_usage_errors_come_before_torch(args):
    code, err, modules = _run(args)
    assert code == 2 and err.startswith("samctl: error: ") and err.count("\n") == 0, err
    assert not modules & HEAVY, args


@pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="embedded default model not installed")
def test_a_store_of_another_tokenizer_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "a.txt").write_text("def add(a, b):\n    return a + b\n")
    store = tmp_path / "bytes.sam"
    code, err, _ = _run(["build", str(tmp_path / "a.txt"), "-o", str(store), "--tokenizer", "bytes", "-q"])
    assert code == 0, err
    code, err, modules = _run(["generate", "--sam", str(store), "--prompt", "def add"])
    assert code == 2 and "was built with tokenizer bytes" in err and "--tokenizer default" in err, err
    assert not modules & HEAVY
