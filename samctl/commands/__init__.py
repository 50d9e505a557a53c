"""One module per command; COMMANDS lists what `samctl` offers."""
from __future__ import annotations

import importlib

import click

# module name -> click command attribute; a command module that fails to import is a bug, not optional.
_MODULES = [
    ("build", "build"),
    ("info", "info"),
    ("query", "query"),
    ("generate", "generate"),
]

COMMANDS: list[click.Command] = [
    getattr(importlib.import_module(f"samctl.commands.{name}"), attr) for name, attr in _MODULES
]
