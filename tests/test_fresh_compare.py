"""`--compare` times both sides on one torch thread unless --threads says otherwise, and says how
many it used, so its ratio holds when other processes want the cores (issue 24, item 5)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import save_tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare24") / "model"
    save_tiny_model_with_tokenizer(path)
    return path


def _compare(model, *extra: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "samctl", "generate", "--model", str(model), "--prompt", "def add(a, b):",
                           "--max-new-tokens", "8", "--compare", "--compare-runs", "1", "--json", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["compare"], proc.stderr


def test_compare_defaults_to_one_thread_and_says_so(model):
    compare, err = _compare(model)
    assert compare["torch_threads"] == 1
    assert "1 torch thread, after a warm-up" in err
    # on a CPU the ratio is of CPU time, which other processes do not inflate; the wall clock's beside it
    assert compare["speedup_clock"] == "cpu" and compare["speedup"] > 0 and compare["speedup_wall"] > 0
    assert "in CPU time (" in err and "by the wall clock)" in err
    compare, err = _compare(model, "--threads", "2")
    assert compare["torch_threads"] == 2 and "2 torch threads" in err
