"""Datastores over token ids: suffix automaton, n-gram table, the `.sam` store file, corpus readers.

Knows numpy and numba only: no torch, no transformers, no click. Text enters as already
tokenized int32 id arrays; corpora are read here as strings and tokenized by the caller.
"""
from samctl.index.errors import UserError

__all__ = ["UserError"]
