"""`samctl serve`'s start-up (issue 42, item 8): the verify-cost measurements take few forwards,
/health says "starting" (503) until the engine can serve, and SIGTERM stops the server at any
point of its start-up, a measurement in progress included. Measurements are counted in forwards
and tokens, never timed; the slow model of the subprocess tests is a real one whose forwards
sleep, so that SIGTERM lands inside the measurement."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.cost import Stopped, measure_batch_cost, measure_verify_cost
from samctl.decode.engine.target import TargetModel
from samctl.tokenizer import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
needs_serve = pytest.mark.skipif(not all(find_spec(m) for m in ("fastapi", "uvicorn", "httpx")),
                                 reason="needs the serve extra")
if find_spec("httpx"):
    import httpx


class _Fed:
    """Counts the forwards a model runs and the input tokens they take (at its embedding)."""

    def __init__(self, model) -> None:
        self.forwards = self.tokens = 0
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.forwards += 1
        self.tokens += int(args[0].numel())


def test_the_verify_cost_curves_take_few_forwards(tiny_llama):
    """One measurement for both (decode.engine.cost.measure_cost). Batch 1: 7 widths (1..64,
    doubling) x 3 rounds after a one-token prefill, the row then taken to hold the context: 382
    tokens in all (was 12 widths x 5 rounds after a 256-token prefill, 1356 tokens). 16 rows:
    7 shapes x 3 rounds and one token per row where 16 x 256 context tokens were prefilled (6637
    tokens, now 1519)."""
    fed = _Fed(tiny_llama)
    try:
        t_ms = measure_verify_cost(TargetModel(tiny_llama), 64, context=256)
        assert len(t_ms) == 64 and all(b >= a for a, b in zip(t_ms, t_ms[1:]))
        assert (fed.forwards, fed.tokens) == (1 + 3 * 7, 1 + 3 * (1 + 2 + 4 + 8 + 16 + 32 + 64))
        fed.forwards = fed.tokens = 0
        t_ms = measure_batch_cost(tiny_llama, 16, 16, context=256)
        assert len(t_ms) == 16 * 16
        shapes = [(1, 1), (4, 1), (16, 1), (16, 2), (16, 4), (16, 8), (16, 16)]
        assert (fed.forwards, fed.tokens) == (1 + 3 * len(shapes), 16 + 3 * sum(b * w for b, w in shapes))
    finally:
        fed.handle.remove()


def test_a_measurement_stops_at_its_next_forward(tiny_llama):
    fed = _Fed(tiny_llama)
    try:
        with pytest.raises(Stopped):
            measure_batch_cost(tiny_llama, 4, 8, stop=lambda: fed.forwards >= 3)
        assert fed.forwards == 3
        with pytest.raises(Stopped):
            measure_verify_cost(TargetModel(tiny_llama), 64, stop=lambda: fed.forwards >= 5)
        assert fed.forwards == 5
    finally:
        fed.handle.remove()


def _slow_verifies(monkeypatch, seconds: float, gate: threading.Event | None = None) -> list[int]:
    # every batched verify waits for the gate, if any, and sleeps; -> the list that grows by one per verify
    calls: list[int] = []
    verify = BatchedTarget.verify

    def slow(self, inputs, trees):
        calls.append(1)
        if gate is not None:
            gate.wait(60)
        time.sleep(seconds)
        return verify(self, inputs, trees)

    monkeypatch.setattr(BatchedTarget, "verify", slow)
    return calls


@needs_serve
def test_health_is_starting_until_the_engine_can_serve(model_dir, tmp_path, monkeypatch):
    """A cold cache: /health is 503 "starting" while the batched verify cost is measured; a request
    sent meanwhile waits and is then served; /health is 200 after."""
    from samctl.server import create_app
    from samctl.session import Session, SessionConfig
    from tests.test_server import _serve

    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=4, threads=1, quiet=True))
    monkeypatch.setenv("SAMCTL_CACHE", str(tmp_path))  # the batched curve is measured, not read
    gate = threading.Event()  # the measurement waits for it: /health is asked before it can end
    calls = _slow_verifies(monkeypatch, 0.05, gate)
    server, url = _serve(create_app(session, batch_size=3), ready=False)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            health = client.get("/health")
            assert health.status_code == 503 and health.text.startswith("starting: ")
            threading.Timer(0.2, gate.set).start()  # once the request below is (very likely) waiting
            answer = client.post("/v1/completions", json={"model": session.engine.name, "prompt": "The"})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
            assert len(calls) > 3 * 5  # the measurement's verifies (3 rounds of 6 shapes), then the request's
            assert client.get("/health").text == "ok"
    finally:
        server.should_exit = True
        server.thread.join(60)


@needs_serve
def test_stop_starting_refuses_the_waiting_requests_and_measures_no_more(model_dir, tmp_path, monkeypatch):
    from samctl.server import create_app, stop_starting
    from samctl.session import Session, SessionConfig
    from tests.test_server import _serve

    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=4, threads=1, quiet=True))
    monkeypatch.setenv("SAMCTL_CACHE", str(tmp_path))
    calls = _slow_verifies(monkeypatch, 0.5)  # the measurement would take 10 s
    app = create_app(session, batch_size=4)
    server, url = _serve(app, ready=False)
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{url}/v1/completions", json={"model": session.engine.name, "prompt": "The"}, timeout=120)))
    try:
        client.start()
        while not calls:
            time.sleep(0.05)
        stop_starting(app)  # what SIGTERM calls
        at_stop = len(calls)
        client.join(60)
        assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]
        assert len(calls) <= at_stop + 1  # the forward in progress, no other
        assert httpx.get(f"{url}/health").status_code == 503
    finally:
        server.should_exit = True
        server.thread.join(60)
    assert not server.thread.is_alive()


# -- the real signal, on `samctl serve` in a subprocess ------------------------------------------

SLOW_SERVE = """
import sys, time
from samctl.decode.engine.batched import BatchedTarget
from samctl.cli import main

one_row = sys.argv[1] == "batch-1"  # the batch-1 curve is measured on a target of one row
verify = BatchedTarget.verify
def slow(self, *args):
    if (self.rows == 1) == one_row:
        sys.stderr.write("VERIFY\\n"); sys.stderr.flush()
        time.sleep(1.0)
    return verify(self, *args)
BatchedTarget.verify = slow
main(sys.argv[2:])
"""


def _get(url: str) -> httpx.Response:
    # the port listens before the model loads; uvicorn answers once its worker began to measure
    for _ in range(100):
        try:
            return httpx.get(url, timeout=30)
        except httpx.ConnectError:
            time.sleep(0.1)
    return httpx.get(url, timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_serve
@pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="embedded default model not installed")
@pytest.mark.parametrize("phase", ["batch-1", "batched"])
def test_sigterm_stops_serve_during_its_start_up_measurement(phase, tmp_path):
    """SIGTERM while the batch-1 curve is measured (before uvicorn serves) or while the 16-row
    batched curve is (the server listening, /health 503, a request waiting): the process ends at
    once, measuring no more. Each slowed forward takes a second, so a measurement left to run
    would take 20 s or more; the process must be gone in 15."""
    port = _free_port()
    env = {**os.environ, "SAMCTL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVE, phase, "serve", "--batch-size", "16", "--threads", "1",
                             "--port", str(port), "--served-model-name", "m"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stderr), daemon=True)
    reader.start()
    answers: list = []
    try:
        deadline = time.monotonic() + 240
        while "VERIFY" not in lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "VERIFY" in lines, "\n".join(lines)
        if phase == "batched":
            health = _get(f"http://127.0.0.1:{port}/health")
            assert health.status_code == 503 and health.text.startswith("starting: "), health.text
            asking = threading.Thread(target=lambda: answers.append(httpx.post(
                f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                json={"model": "m", "prompt": "Hi", "max_tokens": 2})), daemon=True)
            asking.start()
            time.sleep(0.5)
        at_signal = lines.count("VERIFY")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert lines.count("VERIFY") <= at_signal + 1, "\n".join(lines)
    if phase == "batched":
        assert proc.returncode in (0, -signal.SIGTERM), "\n".join(lines)  # uvicorn re-raises the signal it handled
        asking.join(30)
        assert answers and answers[0].status_code == 503, answers


@needs_serve
@pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="embedded default model not installed")
def test_a_taken_port_is_refused_in_one_line_before_the_model_loads(monkeypatch, capsys):
    import samctl.session
    from samctl.cli import main

    monkeypatch.setattr(samctl.session, "Session", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as done:
            main(["serve", "--port", str(port), "--threads", "1"])
    assert done.value.code == 2
    assert capsys.readouterr().err == f"samctl: error: port {port} is in use: pick another with --port\n"
