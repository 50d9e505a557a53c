"""`sdsat`: the target drafts for itself at semantic adaptive tokens (Liu & Zhu 2024).

The model was fine-tuned (`samctl train sdsat`) so that, after the committed text, the input
`[t0, SAT x k]` yields at t0 the next token t1 and at SAT j a guess d_{j+1}. Each step peeks that
input on the engine's own cache without committing (the verify that follows overwrites the SAT
K/V), then verifies the chain [t1, d_2..d_{k+1}] like any draft: the paper's greedy two-step
iteration, with the drafts kept on the device. Lossless by the loop's rule; the paper's nucleus
variant, which is not, is `sdsat-nucleus-reference` (sdsat_nucleus.py), for comparison only.
"""
from __future__ import annotations


import numpy as np
import torch

from samctl.decode.sdsat import SatSettings
from samctl.decode.engine.target import TargetModel
from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.index.errors import ConfigError
from samctl.decode.configs import SdsatConfig


class SatPeek:
    """The draft forward of both SDSAT methods: `[t0, SAT x k]` on the target's cache, not committed."""

    def __init__(self, target: TargetModel, settings: SatSettings, config: SdsatConfig) -> None:
        self.k = config.sat_count or settings.sat_count
        if self.k > settings.sat_count:
            raise ConfigError("{sat_count} {k} is more than the {slots} SAT slots the model was trained with: "
                              "use at most {slots}", k=self.k, slots=settings.sat_count)
        self.target = target
        # [1 + k] int64 device: t0 then k SAT ids; only slot 0 changes from step to step
        self._input = torch.full((1 + self.k,), settings.sat_token_id, dtype=torch.int64, device=target.device)

    def __call__(self, t0: int) -> torch.Tensor:
        # -> logits [1 + k, V] at t0 and the k SATs
        self._input[:1].fill_(t0)  # a fill kernel; `[0] = t0` would copy a host scalar, a sync on a GPU
        return self.target.peek(self._input)


class SdsatDrafter(Drafter):
    name = "sdsat"

    def __init__(self, target: TargetModel, settings: SatSettings, config: SdsatConfig = SdsatConfig()) -> None:
        self.peek = SatPeek(target, settings, config)

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        pass

    def propose(self, t0: int) -> DraftTree:
        return DraftTree.chain(self.peek(t0).argmax(-1))  # [t1, d_2..d_{k+1}] on the device

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass
