"""Progress display on stderr: a tqdm bar when stderr is a terminal, nothing otherwise.

Commands pass `quiet`; pipes, logs and tests get no bar and no carriage returns.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from tqdm import tqdm


def progress_enabled(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


@contextmanager
def progress_bar(description: str, unit: str, quiet: bool, total: int | None = None) -> Iterator[tqdm]:
    """A bar counting `unit`s (with a rate); disabled when `progress_enabled` is false."""
    bar = tqdm(total=total, desc=description, unit=unit, unit_scale=True, dynamic_ncols=True,
               disable=not progress_enabled(quiet), file=sys.stderr, leave=False)
    try:
        yield bar
    finally:
        bar.close()


def status(message: str, quiet: bool) -> None:
    """One line on stderr about a long step without a bar, shown under the same rule as bars."""
    if progress_enabled(quiet):
        print(f"samctl: {message}", file=sys.stderr, flush=True)
