"""The one error type the command line turns into a one-line message (exit status 2): anything
the user can fix, with a message that says what to do. Everything else is a bug and keeps its
traceback. A wrong setting is a `ConfigError`, which names the setting's field, never a flag.
"""
from __future__ import annotations

from string import Formatter
from typing import Callable


class UserError(Exception):
    """An error caused by input, with a message that says how to fix it."""


class ConfigError(UserError):
    """A setting that is wrong or missing. The message is a template whose `{placeholders}` are
    values given as keywords or configuration fields (`max_nodes`, `shards`). `str()` words the
    fields as the Python API's arguments (`eagle_head=`); the command line words them as its flags
    (`--eagle-head`) with `render`.

        raise ConfigError("method {method} needs an EAGLE head: pass {eagle_head}", method=name)
    """

    def __init__(self, template: str, **values: object) -> None:
        self.template, self.values = template, values
        self.fields = tuple(name for _, name, _, _ in Formatter().parse(template) if name and name not in values)
        super().__init__(self.render(lambda name: f"{name}="))

    def render(self, word: Callable[[str], str]) -> str:
        return self.template.format(**self.values, **{name: word(name) for name in self.fields})

    def __reduce__(self):  # pickles (Ray workers) as template and values, not the worded message
        return _config_error, (self.template, self.values)


def _config_error(template: str, values: dict) -> ConfigError:
    return ConfigError(template, **values)
