"""Ray on one machine (issue 24, item 9): true document counts while tokenizing, no error-level
or authentication noise on a normal run, and no Ray process left once samctl has exited."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("ray")  # pytest -n: one worker runs every Ray test


def test_tokenizing_reports_documents_as_well_as_tokens():
    from samctl.cluster import tokenize_on_ray

    calls = []
    texts = ["def add(a, b):\n", "return a + b\n", "x = 1\n"]
    tokens, offsets = tokenize_on_ray("local", iter(texts), "bytes", True, lambda docs, count: calls.append((docs, count)))
    assert calls == [(3, len(tokens))] and len(offsets) == 4  # one small chunk: no Ray instance needed
    assert tokens.dtype == np.int32 and offsets[-1] == len(tokens)


def _samctl_marked(args: list[str], mark: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SAMCTL_TEST_MARK": mark}
    return subprocess.run([sys.executable, "-m", "samctl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=env)


def _left_behind(psutil, mark: str) -> list[list[str]]:
    """Live processes that inherited the run's marker (Ray's GCS, raylet and workers do)."""
    left = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get("SAMCTL_TEST_MARK") == mark:
                left.append(p.cmdline())
        except (psutil.Error, OSError):
            continue
    return left


def _noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " E " in line or "Token authentication" in line
            or "core_worker" in line or "Traceback" in line or "Warning" in line]


@pytest.mark.slow
def test_ray_build_is_quiet_counts_documents_and_leaves_no_process(tmp_path):
    pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "def", "return", "(a, b)", "+", "\n"])
    for i in range(5):  # over 1 MB in all: more than one chunk, so Ray Data tokenizes
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(words, 60_000)))
    mark = f"build-{os.getpid()}-{time.time()}"
    proc = _samctl_marked(["build", str(corpus), "-o", str(tmp_path / "s.samd"), "--shards", "2", "--ray",
                           "--tokenizer", "bytes"], mark)
    assert proc.returncode == 0, proc.stderr
    assert ": 2 shards, 5 documents," in proc.stdout
    assert not _noise(proc.stderr), proc.stderr
    assert not _left_behind(psutil, mark)


@pytest.mark.slow
def test_ray_generate_leaves_no_worker_behind(tmp_path):
    from samctl.tokenizer import DEFAULT_MODEL_DIR

    pytest.importorskip("ray")
    psutil = pytest.importorskip("psutil")
    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("embedded default model not installed")
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"id": 1, "prompt": "def add(a, b):"}\n{"id": 2, "prompt": "def sub(a, b):"}\n')
    mark = f"generate-{os.getpid()}-{time.time()}"
    proc = _samctl_marked(["generate", "--input", str(batch), "--output", str(tmp_path / "out.jsonl"), "--ray",
                           "--max-new-tokens", "8", "--quiet"], mark)
    assert proc.returncode == 0, proc.stderr
    assert not _noise(proc.stderr), proc.stderr
    assert not _left_behind(psutil, mark)  # the model-holding actors too, right at exit
