"""No SpecDec++ head ships for the embedded pair (the one that did was trained on other weights):
specdec++ without --acc-head says in one line how to train one (issue 24, item 6)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from samctl.tokenizer import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]


def test_no_mismatched_head_ships():
    from samctl.plan import DEFAULT_GREEDY_HEAD_DIR, DEFAULT_HEAD_DIR

    assert not DEFAULT_HEAD_DIR.exists() and not DEFAULT_GREEDY_HEAD_DIR.exists()


@pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="embedded default model not installed")
def test_specdec_without_a_head_says_how_to_train_one():
    proc = subprocess.run([sys.executable, "-m", "samctl", "generate", "--method", "specdec++", "--prompt", "x",
                           "--max-new-tokens", "4"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 + proc.stderr.count("samctl: using"), proc.stderr
    err = proc.stderr.splitlines()[-1]
    assert "trained on other weights" not in proc.stderr
    assert "samctl train acc-head --target " in err and "--label-mode greedy" in err
    assert "then pass --acc-head acc_head" in err
