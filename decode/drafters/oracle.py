"""`oracle`: drafts a known continuation, for measuring the engine, never for users.

Given the target's own greedy continuation c of the prompt, with pending t0 = c[i] it drafts
c[i+1 .. i+k]: every draft is accepted, so a run makes k + 1 tokens per step and its speed against
the verify cost t(k + 1) is the engine's overhead. Not registered as a method.
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.index.errors import UserError


class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, continuation: np.ndarray, depth: int) -> None:
        # continuation: [N] int64 greedy output after the prompt
        if depth < 0:
            raise UserError(f"oracle depth must be >= 0, got {depth}")
        self.continuation = np.asarray(continuation, dtype=np.int64)
        self.depth = depth
        self.position = 0  # index in `continuation` of the pending token t0

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        self.position = 0

    def propose(self, t0: int) -> DraftTree:
        i = self.position
        if i >= len(self.continuation) or self.continuation[i] != t0:
            return DraftTree.empty()  # off the known text (a drift at a near-tie): draft nothing
        return DraftTree.chain(self.continuation[i + 1 : i + 1 + self.depth])

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        self.position += len(committed)
