"""Reading the text files users hand samctl so that a byte that is not UTF-8 becomes a one-line error
naming where it is, never a traceback. Files are decoded with `surrogateescape`: a bad byte b reads
as the lone surrogate U+DC00 + b, so that a batch reads on past it and only the record holding it
is refused (`check_utf8`). The files samctl writes are checked before any work (`check_output_path`).
"""
from __future__ import annotations

import os
import re

import click

from samctl.index.errors import UserError

ERRORS = "surrogateescape"
_ESCAPED = re.compile("[\udc80-\udcff]")
# A click file option whose reading never raises UnicodeDecodeError ('-' reads stdin the same way).
TEXT_FILE = click.File("r", encoding="utf-8", errors=ERRORS)


def check_utf8(text: str, where: str) -> str:
    """`text` unchanged when it held only UTF-8; else a UserError naming the first bad byte."""
    bad = _ESCAPED.search(text)
    if bad is None:
        return text
    index = bad.start()
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    at = f"line {line}, column {column}" if "\n" in text.rstrip("\n") else f"column {column}"
    raise UserError(f"{where} is not UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} at {at}): re-encode it "
                    "as UTF-8, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8")


def check_output_path(flag: str, path: str, reads: tuple[tuple[str, str | None], ...] = (), store: bool = False) -> None:
    """Refuse, before any work, an output the run could not write or should not replace: its folder
    missing, what one of `reads` ((flag, path) pairs) names, or (`store`) a file that is not a store."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: folder {folder} does not exist: create it or choose another path")
    for name, source in reads:
        if source and _same_file(path, source):
            raise UserError(f"{flag} {path} is what {name} reads: writing it would erase it, choose another path")
    if store and os.path.lexists(path):
        from samctl.index.store import is_store_file

        if not is_store_file(path):
            raise UserError(f"{flag} {path} exists and is not a samctl store: choose another path")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (or is stdin's "<stdin>")
        return False
