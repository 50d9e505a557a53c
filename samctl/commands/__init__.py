"""One module per command, imported only when its command runs (torch loads only for those that
decode). `_MODULES` lists (module, click command attribute); the command is named after the module."""
from __future__ import annotations

import importlib

import click

_MODULES = [
    ("build", "build"),
    ("info", "info"),
    ("query", "query"),
    ("generate", "generate"),
    ("simulate", "simulate"),
    ("bench", "bench"),
    ("calibrate", "calibrate"),
    ("distill", "distill"),
    ("chat", "chat"),
]


def command_names() -> list[str]:
    return [name for name, _ in _MODULES]


def load_command(name: str) -> click.Command | None:
    """The command called `name`, importing its module; None when there is no such command."""
    for module, attr in _MODULES:
        if module == name:
            return getattr(importlib.import_module(f"samctl.commands.{module}"), attr)
    return None
