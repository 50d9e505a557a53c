"""samctl: lossless speculative decoding for outputs that overlap text the model can see.

`Session` (samctl.session) and `SessionConfig` (samctl.config) are the Python API; they load on
first use, so that `import samctl` (and `samctl --help`) does not pull in torch.
"""

import importlib
import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())  # notes are the application's to show
__version__ = "0.1.0"
__all__ = ["Session", "SessionConfig"]
_MODULES = {"Session": "samctl.session", "SessionConfig": "samctl.config"}  # where each loads from


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'samctl' has no attribute {name!r}")
