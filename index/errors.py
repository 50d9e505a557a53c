"""The one error type the command line turns into a one-line message (exit status 2).

Raise it for anything the user can fix: bad input, a corrupt or mismatched store, a missing
file. The message says what to do. Everything else is a bug and keeps its traceback. A wrong
setting is a `ConfigError`, which names the setting's field, never a command-line flag.
"""
from __future__ import annotations

from string import Formatter
from typing import Callable


class UserError(Exception):
    """An error caused by input, with a message that says how to fix it."""


class ConfigError(UserError):
    """A setting that is wrong or missing, named by its configuration field, not by a flag.

    The message is a template whose `{placeholders}` are either values given as keywords or
    configuration fields (`SessionConfig`'s, a drafter setting's Python name such as `max_nodes`,
    a command's own setting such as `shards`). `str()` words the fields as the Python API's
    arguments (`eagle_head=`); the command line words them as its flags (`--eagle-head`) at its one
    error boundary (samctl/cli.py), with `render`.

        raise ConfigError("method {method} needs an EAGLE head: pass {eagle_head}", method=name)
    """

    def __init__(self, template: str, **values: object) -> None:
        self.template, self.values = template, values
        self.fields = tuple(name for _, name, _, _ in Formatter().parse(template) if name and name not in values)
        super().__init__(self.render(lambda name: f"{name}="))

    def render(self, word: Callable[[str], str]) -> str:
        """The message with each field worded by `word` (field name -> text)."""
        return self.template.format(**self.values, **{name: word(name) for name in self.fields})

    def __reduce__(self):  # pickles (Ray workers) as template and values, not the worded message
        return _config_error, (self.template, self.values)


def _config_error(template: str, values: dict) -> ConfigError:
    return ConfigError(template, **values)
