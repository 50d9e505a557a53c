"""Draft-model drafters: classic speculative decoding (`sd`) and SpecDec++ (`specdec++`).

Each step the draft model extends the committed text by a chain y_1..y_k in the drafter's own row
of the draft model's batch (decode/draft_model.py; rows of one draft model draft together in
`draft_chains`). Greedy drafts take the argmax; sampling drafts draw y_i ~ q_i, the draft's
distribution warped like the target's, and the chain carries q for the loop's p/q rule. Stop rules:
- `FixedLength(gamma)`: k = gamma (Leviathan et al. 2023; Chen et al. 2023);
- `AdaptiveLength` (SpecDec++): with P_j the head's P(accept y_j) (P_0 = 1 for t0), stop when
  1 - prod_{j<k} P_j > threshold, never while k < min, always at k = max, and at EOS.

Cache invariant: the draft cache holds K/V for history[:c] (history = prompt + committed) plus,
during a step, the speculative tail [t0, y_1..y_{k-1}] (y_k is never fed). `observe` crops it to
the committed prefix it really holds; `propose` feeds only history[c:] + t0. A drafter that did
not propose this step (SAM retrieved instead) catches up in one forward next time. Knows nothing
of the target or text.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from samctl.decode.acceptance_head import AcceptanceHead
from samctl.decode.draft_model import DraftModel, extend
from samctl.decode.sampling import SamplingConfig, draw, warp_probs
from samctl.decode.drafters.base import DraftsTogether
from samctl.decode.tree import DraftTree
from samctl.decode.configs import SpecDecConfig
from samctl.index.errors import UserError


class StopRule(Protocol):
    needs_hidden: bool  # whether `done` reads the draft's hidden state
    syncs: bool  # whether `done` reads tokens on the host (then drafting stops at EOS too)
    max_len: int

    def begin(self) -> None: ...

    def done(self, k: int, hidden: torch.Tensor | None) -> bool:
        # k: tokens drafted so far (>= 1); hidden: [H] draft state at the input before y_k
        ...


class FixedLength:
    needs_hidden = False
    syncs = False

    def __init__(self, gamma: int) -> None:
        self.max_len = gamma

    def begin(self) -> None:
        pass

    def done(self, k: int, hidden: torch.Tensor | None) -> bool:
        return k >= self.max_len


class AdaptiveLength:
    """SpecDec++'s stop rule over the head's acceptance predictions."""

    needs_hidden = True
    syncs = True

    def __init__(self, head: AcceptanceHead, config: SpecDecConfig) -> None:
        self.head, self.config = head, config
        self.max_len = config.max_draft
        self.all_accepted = 1.0  # predicted P(every token drafted so far is accepted)

    def begin(self) -> None:
        self.all_accepted = 1.0

    def done(self, k: int, hidden: torch.Tensor | None) -> bool:
        # The state before y_1 is at t0, which the target already chose: P = 1 there.
        if k > 1:
            self.all_accepted *= float(self.head.accept_prob(hidden))
        if k >= self.config.max_draft:
            return True
        if k < self.config.min_draft:
            return False
        return 1.0 - self.all_accepted > self.config.stop_threshold


class DraftModelDrafter(DraftsTogether):
    def __init__(self, draft: DraftModel, stop: StopRule, sampling: SamplingConfig = SamplingConfig(),
                 eos_token_ids: tuple[int, ...] = (), name: str = "sd") -> None:
        if stop.needs_hidden and not draft.gives_hidden:
            raise UserError(f"method {name} reads the draft model's hidden states, which this draft model does not "
                            f"give ({getattr(draft.model.config, 'model_type', 'its family')}: no final norm found): "
                            "use another draft model or method")
        self.draft, self.stop, self.sampling = draft, stop, sampling
        self.eos = frozenset(eos_token_ids)
        self.name = name
        self.generator: torch.Generator | None = None
        if not sampling.greedy:
            self.generator = torch.Generator(device=draft.device)
            self.generator.seed()
        self.history = np.zeros(0, dtype=np.int64)
        self.speculative = 0  # drafted tokens fed to the cache after t0 in the last propose

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        self.draft.reset()
        self.history = np.asarray(prompt, dtype=np.int64).copy()
        self.speculative = 0
        self.ready = None
        if self.generator is not None and self.sampling.seed is not None:
            # Its own stream, reproducible from the run's seed, independent of the target's draws.
            self.generator.manual_seed((self.sampling.seed * 0x9E3779B1 + 0x5DEECE66D) % (1 << 63))

    @staticmethod
    def draft_together(drafters: Sequence["DraftModelDrafter"], t0s: Sequence[int]) -> list[DraftTree]:
        return draft_chains(drafters, t0s)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        # The cache holds history[:c] and, if this drafter proposed, [t0, y_1..y_s]; committed
        # is [t0, y_1..y_a] (a prefix of the chain) when it proposed, else someone else's tokens.
        before = len(self.history)
        self.history = np.concatenate((self.history, np.asarray(committed, dtype=np.int64)))
        if self.draft.cached > before:
            self.draft.keep(before + 1 + min(len(committed) - 1, self.speculative))
        self.speculative = 0

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # logits: [V'] at the last fed token of a sampling drafter -> (token [1] int64 on device, q [1, V'])
        q = warp_probs(logits[None], self.sampling)
        return draw(q, self.generator), q


def draft_chains(drafters: Sequence[DraftModelDrafter], t0s: Sequence[int]) -> list[DraftTree]:
    """Each row's chain after its pending token: every round is one forward of the draft model over
    the rows still drafting, each choosing and stopping by its own rule."""
    draft = [d.draft for d in drafters]
    feeds = [np.append(d.history[m.cached:], t0) for d, m, t0 in zip(drafters, draft, t0s)]
    # y_k is never fed, so k tokens need k - 1 positions after the fed ones.
    limits = [min(d.stop.max_len, m.max_positions - m.cached - len(f) + 1) for d, m, f in zip(drafters, draft, feeds)]
    live = [i for i, limit in enumerate(limits) if limit >= 1]
    chains: list[list[torch.Tensor]] = [[] for _ in drafters]
    qs: list[list[torch.Tensor]] = [[] for _ in drafters]
    for i in live:
        drafters[i].stop.begin()
    hidden = any(drafters[i].stop.needs_hidden for i in live)
    k = 0
    while live:
        logits, states = extend([draft[i] for i in live], [feeds[i] for i in live], hidden)
        k += 1
        going = []
        greedy = any(drafters[i].sampling.greedy for i in live)
        argmax = logits.argmax(dim=-1, keepdim=True) if greedy else None  # [rows, 1]: the greedy rows' tokens
        for j, i in enumerate(live):
            d = drafters[i]
            token, q = (argmax[j], None) if d.sampling.greedy else d._choose(logits[j])
            chains[i].append(token)
            qs[i].append(q)
            state = states[j] if d.stop.needs_hidden else None
            if not (k >= limits[i] or d.stop.done(k, state) or (d.stop.syncs and int(token) in d.eos)):
                going.append(i)
                feeds[i] = token
        live = going
    for d, chain in zip(drafters, chains):
        d.speculative = max(len(chain) - 1, 0)
    return [DraftTree.chain(torch.cat(chain), q=None if d.sampling.greedy else torch.cat(q)) if chain
            else DraftTree.empty() for d, chain, q in zip(drafters, chains, qs)]
