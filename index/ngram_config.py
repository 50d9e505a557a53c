"""The n-gram table's build settings, apart from its numba kernels (index/ngram.py) so that reading
a store's header (`samctl info`) does not load numba."""
from __future__ import annotations

from dataclasses import dataclass

from samctl.index.errors import ConfigError

MAX_N = 16  # longest context the table's keys hold


@dataclass(frozen=True)
class NgramConfig:
    max_n: int = 4  # longest context
    min_count: int = 2  # entries seen fewer times are pruned
    top_k: int = 8  # next tokens kept per context

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_N:
            raise ConfigError("n-gram {max_n} must be in 1..{high}, got {value}", high=MAX_N, value=self.max_n)
        if self.min_count < 1:
            raise ConfigError("n-gram {min_count} must be >= 1, got {value}", value=self.min_count)
        if self.top_k < 1:
            raise ConfigError("n-gram {top_k} must be >= 1, got {value}", value=self.top_k)
