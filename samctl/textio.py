"""Reading the text files users hand samctl so that a byte that is not UTF-8 becomes a one-line error
naming where it is, never a traceback. Files are decoded with `surrogateescape`: a bad byte b reads
as the lone surrogate U+DC00 + b, so that a batch reads on past it and only the record holding it
is refused (`check_utf8`).
"""
from __future__ import annotations

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
