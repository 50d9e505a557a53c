"""Lookup: what every store kind answers a query with (index.kinds' table, the kinds' modules and
the datastore all use it; it lives apart so that none of them imports another for it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lookup:
    """A query's answer: the longest suffix of the context that the store holds, and after it."""

    match_length: int  # tokens of the context's suffix found in the store (0: none)
    count: int  # sam: occurrences of that suffix; ngram: those followed by a kept next token
    continuation: np.ndarray  # [m] int32, sam: after the first occurrence; ngram: greedy chain
    next_tokens: np.ndarray  # [k] int32, most frequent next tokens, by count descending
    next_counts: np.ndarray  # [k] int32
