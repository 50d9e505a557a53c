"""Progress of long work on stderr: a tqdm bar on a terminal; elsewhere (pipes, logs, CI) a plain
line every LINE_PERIOD_S seconds, with the count, rate and time left, and a last line when it ends.
Work that ends within the first period prints nothing. Commands pass `quiet`.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from tqdm import tqdm

LINE_PERIOD_S = 5.0


def progress_enabled(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


class Progress:
    """Counts `unit`s done (and optionally tokens generated) for a bar or periodic lines."""

    def __init__(self, description: str, unit: str, quiet: bool, total: int | None = None) -> None:
        self.description, self.unit, self.quiet, self.total = description, unit, quiet, total
        self.done = self.tokens = 0
        self.start = self.last_line = time.perf_counter()
        self.lines = 0
        self.lock = threading.Lock()  # update() and a heartbeat thread share the counters
        self.bar = (tqdm(total=total, desc=description, unit=unit, unit_scale=True, dynamic_ncols=True,
                         file=sys.stderr, leave=False) if progress_enabled(quiet) else None)

    def update(self, n: int = 1, tokens: int = 0) -> None:
        with self.lock:
            self.done += n
            self.tokens += tokens
            if self.bar is not None:
                self.bar.update(n)
                if self.tokens:
                    self.bar.set_postfix_str(f"{self.tokens:,} tokens, {self.tokens / self._elapsed():.1f} tok/s",
                                             refresh=False)
            elif not self.quiet and time.perf_counter() - self.last_line >= LINE_PERIOD_S:
                self._line()

    @contextmanager
    def heartbeat(self, poll: Callable[[], int] | None = None) -> Iterator["Progress"]:
        """For the block's duration, a thread brings `done` up to `poll()` (when given) and prints
        the periodic line when it is due even if nothing else updates."""
        if self.quiet:
            yield self
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(0.5 if self.bar is not None else min(LINE_PERIOD_S, 1.0)):
                reached = poll() if poll is not None else self.done
                self.update(max(0, reached - self.done))
                if self.bar is not None:
                    self.bar.refresh()

        thread = threading.Thread(target=beat, name="samctl-progress", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def close(self, stopped: bool = False) -> None:
        """The last line: `done in` when the work ended, `stopped after` when an error or Ctrl-C cut it."""
        if self.bar is not None:
            self.bar.close()
        elif self.lines:
            self._line(final=True, stopped=stopped)

    def _elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def _line(self, final: bool = False, stopped: bool = False) -> None:
        elapsed = self._elapsed()
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        parts = [f"{count} {self.unit}s"]
        if not final and not self.done and not self.tokens:  # a step that cannot count (a sort in a subprocess)
            parts = [f"working, {_duration(elapsed)} so far"]
        elif self.tokens:
            parts.append(f"{self.tokens:,} tokens, {self.tokens / elapsed:.1f} tok/s")
        elif not final:
            parts.append(f"{self.done / elapsed:.2f} {self.unit}s/s")
        if final:
            parts.append(f"{'stopped after' if stopped else 'done in'} {_duration(elapsed)}")
        elif self.total is not None and self.done:
            parts.append(f"ETA {_duration(elapsed * (self.total - self.done) / self.done)}")
        print(f"samctl: {self.description}: {', '.join(parts)}", file=sys.stderr, flush=True)
        self.last_line = time.perf_counter()
        self.lines += 1


def human_bytes(size: float) -> str:
    """1234567 -> "1.2 MB" (decimal units), for status lines and reports."""
    for unit in ("B", "kB", "MB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


@contextmanager
def progress_bar(description: str, unit: str, quiet: bool, total: int | None = None) -> Iterator[Progress]:
    progress = Progress(description, unit, quiet, total)
    try:
        yield progress
    except BaseException:  # Ctrl-C or an error: the work did not finish, never say "done"
        progress.close(stopped=True)
        raise
    progress.close()


def status(message: str, quiet: bool) -> None:
    """One line on stderr about a long step without a bar, shown under the same rule as bars."""
    if progress_enabled(quiet):
        print(f"samctl: {message}", file=sys.stderr, flush=True)
