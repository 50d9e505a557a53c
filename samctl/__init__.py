"""samctl: lossless speculative decoding for outputs that overlap text the model can see.

`Session` and `SessionConfig` (samctl.session) are the Python API; they load on first use, so that
`import samctl` (and `samctl --help`) does not pull in torch.
"""

__version__ = "0.1.0"
__all__ = ["Session", "SessionConfig"]


def __getattr__(name: str):
    if name in __all__:
        from samctl import session

        return getattr(session, name)
    raise AttributeError(f"module 'samctl' has no attribute {name!r}")
