"""Progress on stderr: periodic plain lines when stderr is not a terminal, nothing when quiet."""
from __future__ import annotations

import threading

import pytest

from samctl import progress


@pytest.fixture
def every_update(monkeypatch):
    monkeypatch.setattr(progress, "LINE_PERIOD_S", 0.0)  # a line on every update


def test_lines_report_count_rate_and_eta_then_a_last_line(every_update, capsys):
    with progress.progress_bar("bench", "run", quiet=False, total=4) as bar:
        for _ in range(3):
            bar.update(1, tokens=10)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and "\r" not in "".join(lines)
    assert lines[0].startswith("samctl: bench: 1/4 runs, ") and "tok/s" in lines[0] and "ETA" in lines[0]
    assert lines[2].startswith("samctl: bench: 3/4 runs, ")
    assert lines[3].startswith("samctl: bench: 3/4 runs, ") and "done in" in lines[3]


def test_without_tokens_or_total_the_rate_is_in_units(every_update, capsys):
    with progress.progress_bar("generate", "record", quiet=False) as bar:
        bar.update(1)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("samctl: generate: 1 records, ") and "records/s" in first and "ETA" not in first


def test_quiet_and_short_runs_print_nothing(capsys, monkeypatch):
    with progress.progress_bar("bench", "run", quiet=False, total=2) as bar:
        bar.update(2, tokens=5)  # well within the first period
    monkeypatch.setattr(progress, "LINE_PERIOD_S", 0.0)
    with progress.progress_bar("bench", "run", quiet=True, total=2) as bar:
        bar.update(2, tokens=5)
    assert capsys.readouterr().err == ""


def _lines_printed(bar, n: int) -> threading.Event:
    """An event set once the bar has printed n periodic lines: the test waits on what it checks,
    not on a sleep that a busy machine can outlast."""
    printed, line = threading.Event(), bar._line
    count = [0]

    def counted(*args, **kwargs):
        line(*args, **kwargs)
        count[0] += 1
        if count[0] >= n:
            printed.set()

    bar._line = counted
    return printed


def test_heartbeat_prints_while_a_long_step_runs_without_updates(monkeypatch, capsys):
    import time

    monkeypatch.setattr(progress, "LINE_PERIOD_S", 0.05)
    reached = iter(range(100, 10_000, 100))
    with progress.progress_bar("building", "token", quiet=False, total=10_000) as bar:
        printed = _lines_printed(bar, 2)
        with bar.heartbeat(lambda: next(reached)):
            # a kernel that releases the GIL, as the automaton build does: only the heartbeat prints
            assert printed.wait(30), "the heartbeat printed no lines"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(line.startswith("samctl: building: ") for line in lines)
    counts = [int(line.split(": ")[2].split("/")[0]) for line in lines[:-1]]
    assert counts == sorted(counts) and counts[-1] > 0 and "done in" in lines[-1]
    with progress.progress_bar("building", "token", quiet=True) as bar, bar.heartbeat(lambda: 1):
        time.sleep(0.2)
    assert capsys.readouterr().err == ""


def test_a_step_that_cannot_count_says_it_is_working_not_zero(monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_PERIOD_S", 0.05)
    with progress.progress_bar("building the suffix array", "token", quiet=False, total=10_000) as bar:
        printed = _lines_printed(bar, 1)
        with bar.heartbeat():
            assert printed.wait(30), "the heartbeat printed no line"  # a subprocess sorting: nothing to count
        bar.update(10_000 - bar.done)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and all(": 0/" not in line and "0.00" not in line for line in lines), lines
    assert lines[0].startswith("samctl: building the suffix array: working, ") and lines[0].endswith("so far")
    assert lines[-1].startswith("samctl: building the suffix array: 10000/10000 tokens, ") and "done in" in lines[-1]
