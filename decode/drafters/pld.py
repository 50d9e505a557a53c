"""Prompt lookup decoding (Saxena 2023), as transformers' `PromptLookupCandidateGenerator` does it.

For n from max_ngram down to 1, find the leftmost earlier occurrence of the last n tokens of
prompt + output + t0 that has at least one following token; the draft is up to num_draft tokens
after it, cut before the first EOS. No state beyond the token history.
"""
from __future__ import annotations


import numba
import numpy as np
import torch

from samctl.decode.drafters.base import Drafter, TokenHistory
from samctl.decode.tree import DraftTree
from samctl.decode.configs import PldConfig


@numba.njit(cache=True)
def pld_match(history: np.ndarray, length: int, max_ngram: int, num_draft: int) -> tuple[int, int]:
    # history: [>= length] int64, the first `length` are prompt + output + t0.
    # -> (start, end) of the draft in history; start == end when nothing matched.
    for n in range(min(max_ngram, length - 1), 0, -1):
        for idx in range(0, length - n + 1):
            same = True
            for j in range(n):
                if history[idx + j] != history[length - n + j]:
                    same = False
                    break
            if same:
                start = idx + n
                end = min(start + num_draft, length)
                if start < end:
                    return start, end
    return 0, 0


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, config: PldConfig = PldConfig(), eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.eos = np.asarray(eos_token_ids, dtype=np.int64)
        self.history = TokenHistory()
        pld_match(self.history.ids, 1, 1, 1)  # compile (or load the cache) now, not in the first step

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        self.history.reset(prompt)

    def propose(self, t0: int) -> DraftTree:
        history = self.history
        history.extend(np.asarray([t0], dtype=np.int64))
        start, end = pld_match(history.ids, history.n, self.config.max_ngram, self.config.num_draft)
        history.n -= 1  # t0 is not committed yet; observe appends it with the accepted drafts
        draft = history.ids[start:end].copy()
        if len(self.eos):
            hits = np.flatnonzero(np.isin(draft, self.eos))
            if len(hits):
                draft = draft[: hits[0]]
        return DraftTree.chain(draft)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        self.history.extend(committed)
