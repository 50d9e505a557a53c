"""`samctl chat` driven through a pseudo-terminal with the embedded model: streaming turns with
their stats line, /method, /compare, /sources, /reset, and the drafter kept across turns."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Terminal:
    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
        self.proc = subprocess.Popen([sys.executable, "-m", "samctl", *args], stdin=slave, stdout=slave,
                                     stderr=slave, cwd=ROOT, env=env, close_fds=True)
        os.close(slave)
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.seen)
            if match:
                self.seen = self.seen[match.end():]
                return match
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen!r}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                assert data or re.search(pattern, self.seen), f"ended without {pattern!r}: {self.seen!r}"
                self.seen += data.decode("utf-8", "replace").replace("\r\n", "\n")

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            os.close(self.master)


@pytest.mark.slow
def test_chat_session():
    term = Terminal(["chat", "--threads", "1", "--max-new-tokens", "12", "--quiet"])
    try:
        term.expect(r"method adaptive, the chat template; /help")
        term.expect(r"you> ")
        term.send("Write a function that adds two numbers.")
        stats = term.expect(r"\[adaptive: (\d+) tokens, [\d.]+ tok/s, ([\d.]+) tokens/step\]")
        assert 1 <= int(stats.group(1)) <= 12
        term.expect(r"you> ")
        term.send("/compare")
        term.expect(r"comparison: on")
        term.send("/method pld")
        term.expect(r"method: pld")
        term.send("And one that multiplies them.")
        term.expect(r"\[pld: \d+ tokens, [\d.]+ tok/s, [\d.]+ tokens/step \| ar: [\d.]+ tok/s, "
                    r"speedup [\d.]+x, identical\]")
        term.send("/method adaptive")
        term.send("/compare")
        term.expect(r"comparison: off")
        term.send("Thanks.")
        term.expect(r"\[adaptive: \d+ tokens[^|\]]*\]")
        term.send("/sources")
        # the adaptive drafter was kept: it remembers both of the session's adaptive answers
        term.expect(r"memory: 2 earlier answer\(s\) this session")
        term.expect(r"dynamic +\d+ drafted")
        term.send("/reset")
        term.expect(r"new conversation")
        term.send("/nope")
        term.expect(r"unknown command /nope")
        term.send("/quit")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_a_method_that_needs_what_chat_was_not_given_is_refused_at_slash_method(model_dir, capsys):
    """/method sd (no --draft-model) or sdsat (a model without SAT tokens) says so at once, in one
    line that says to restart chat; the method stays what it was."""
    from samctl.commands.chat import Console
    from samctl.config import SessionConfig
    from samctl.session import Session

    console = Console(Session(SessionConfig(model=str(model_dir), method="pld", quiet=True, threads=1)), None, False)
    capsys.readouterr()
    assert console.command("/method sd")
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith("samctl: method sd needs a draft model: pass --draft-model ")
    assert said[0].endswith(": restart samctl chat with it (the method stays pld)") and console.method == "pld"
    assert console.command("/method sdsat")
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and f"{model_dir} has no semantic adaptive tokens" in said[0] and console.method == "pld"
    assert console.command("/method recycle")
    assert capsys.readouterr().out.startswith("method: recycle (") and console.method == "recycle"
