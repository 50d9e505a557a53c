"""The one error type the command line turns into a one-line message (exit status 2): anything
the user can fix, with a message that says what to do. Everything else is a bug and keeps its
traceback. A wrong setting is a `ConfigError`, which names the setting's field, never a flag; a
`Note` for the log names settings the same way.
"""
from __future__ import annotations

from string import Formatter
from typing import Callable


class UserError(Exception):
    """An error caused by input, with a message that says how to fix it."""


class Worded:
    """A message template whose `{placeholders}` are values given as keywords or configuration
    fields (`max_nodes`, `shards`). `str()` words the fields as the Python API's arguments
    (`eagle_head=`); the command line words them as its flags (`--eagle-head`) with `render`."""

    def __init__(self, template: str, **values: object) -> None:
        self.template, self.values = template, values
        self.fields = tuple(name for _, name, _, _ in Formatter().parse(template) if name and name not in values)

    def render(self, word: Callable[[str], str]) -> str:
        return self.template.format(**self.values, **{name: word(name) for name in self.fields})

    def __str__(self) -> str:
        return self.render(lambda name: f"{name}=")


class Note(Worded):
    """A note for the `samctl` log that names settings: `log.info(Note("... pass {model}"))`."""


class ConfigError(UserError, Worded):
    """A setting that is wrong or missing, worded as `Worded` says.

        raise ConfigError("method {method} needs an EAGLE head: pass {eagle_head}", method=name)
    """

    def __init__(self, template: str, **values: object) -> None:
        Worded.__init__(self, template, **values)
        UserError.__init__(self, Worded.__str__(self))

    __str__ = UserError.__str__

    def __reduce__(self):  # pickles (Ray workers) as template and values, not the worded message
        return _config_error, (self.template, self.values)


def _config_error(template: str, values: dict) -> ConfigError:
    return ConfigError(template, **values)
