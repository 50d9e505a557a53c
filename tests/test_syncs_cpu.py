"""No host synchronization hidden in the hot path (GPU.md B7), checked on the CPU: every call that
would move a device value to the host is counted with torch's methods patched, CUDA graphs run
through the stand-in backend, and no code path may call torch.multinomial (some torch builds check
its input with two .item() on the host) or copy a host array to the device pageable."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import make_drafter
from samctl.decode.sampling import SamplingConfig, draw
from tests.test_decode_greedy import prompts
from tests.test_engine import SyncCounter, device_path_recycle, tiny
from tests.test_graphs_cpu import StandIn, graphs_on

DECODE = Path(__file__).resolve().parents[1] / "decode"


class CountingSyncs(SyncCounter):
    """SyncCounter plus torch.cuda.synchronize; torch.multinomial refused outright."""

    def __init__(self, monkeypatch) -> None:
        super().__init__(monkeypatch)
        monkeypatch.setattr(torch.cuda, "synchronize", self._counting(lambda *a, **k: None))

        def refuse(*args, **kwargs):
            raise AssertionError("torch.multinomial on the hot path: use decode.sampling.draw")

        monkeypatch.setattr(torch, "multinomial", refuse)


@pytest.mark.parametrize("method", ["ar", "pld", "recycle-device", "adaptive", "lookahead"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graphs_add_no_sync_per_step(method, temperature, monkeypatch):
    model = tiny()
    prompt = prompts(96)[0]
    sampling = SamplingConfig(temperature, seed=0)
    config = GenerationConfig(max_new_tokens=30, sampling=sampling)
    outputs = []
    for graphs in (False, True):
        target = TargetModel(model)
        if graphs:
            graphs_on(target, StandIn())
        drafter = device_path_recycle() if method == "recycle-device" else make_drafter(method, vocab_size=96, device="cpu")
        counter = CountingSyncs(monkeypatch)
        result = generate(target, drafter, prompt, config)
        monkeypatch.undo()
        outputs.append(result.tokens)
        # one per step (the accept read) + the prefill's
        assert counter.count == result.metrics.steps + 1, (method, graphs, counter.count, result.metrics.steps)
        assert result.metrics.eager_verifies == 0
    assert outputs[0] == outputs[1]


def test_draw_is_multinomials_own_algorithm():
    # the same generator state draws the same tokens as torch.multinomial(p, 1), and leaves the
    # generator in the same state
    rng = np.random.default_rng(0)
    for shape in ((5, 40), (1, 7), (40,)):
        p = torch.softmax(torch.from_numpy(rng.normal(size=shape) * 3), -1).float()
        a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        expected = torch.multinomial(p, 1, generator=a).squeeze(-1)
        assert torch.equal(draw(p, b), expected)
        assert torch.equal(a.get_state(), b.get_state())


def _pageable_copies(path: Path) -> list[str]:
    # `torch.from_numpy(x).to(device)` / `torch.tensor(...).to(device)`: a pageable host->device copy
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Attribute)
                and node.func.value.func.attr == "from_numpy"):
            found.append(f"{path.relative_to(DECODE.parent)}:{node.lineno}")
    return found


# Built once per drafter or request (constructors, per-request seeding), never per step.
ONCE = {"decode/drafters/recycle.py": 2, "decode/drafters/sdsat_nucleus.py": 1}


def test_no_pageable_host_to_device_copy_per_step():
    counts: dict[str, int] = {}
    for path in sorted(DECODE.rglob("*.py")):
        if path.name == "simulate.py":  # replays without a model: host only
            continue
        for where in _pageable_copies(path):
            file = where.rsplit(":", 1)[0]
            counts[file] = counts.get(file, 0) + 1
    assert counts == ONCE, f"use decode.engine.transfer.to_device instead: {counts}"


def test_pinned_buffers_wait_on_their_event_only_when_it_is_pending():
    # B10: the copies' event is waited on before the pinned buffers are read, without a
    # synchronizing call when it is done (the usual case: a step's sync came between)
    from samctl.decode.engine.transfer import wait_for

    class Event:
        def __init__(self, done: bool) -> None:
            self.done, self.waited = done, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.waited = True

    done, pending = Event(True), Event(False)
    wait_for(done)
    wait_for(pending)
    assert not done.waited and pending.waited
