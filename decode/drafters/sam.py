"""SAM-Decoding (Hu et al. 2024): retrieval drafts from suffix automata, with a fallback drafter.

Two match pointers, each the longest suffix of the committed text found in a structure: dynamic,
an automaton grown over prompt + output (its pointer moves on a token *before* the token is
inserted, so the match is an earlier occurrence, which has a continuation); static, a prebuilt
datastore's cursor (index/cursor.py). Each step (t0 = the pending token):
    m_dyn, m_st = matches after a non-mutating step on t0
    if m_dyn >= dyn_threshold or m_st >= dyn_threshold + static_bias:
        chain of min(max_draft, alpha * m) tokens after the occurrence, from the dynamic automaton
        when m_dyn >= m_st - static_bias (where the continuation runs into the end of the text,
        the draft goes on with t0 and itself: repeated text), else from the static store
    else: the fallback drafter's tree (Token Recycle, a draft model) or no draft.
The fallback observes every step, so it keeps learning (an EAGLE head's features stay current).
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.index.automaton import SuffixAutomaton
from samctl.index.cursor import Structure, cursor
from samctl.decode.configs import SamConfig


class SamDrafter(Drafter):
    def __init__(self, config: SamConfig = SamConfig(), static: Structure | None = None,
                 fallback: Drafter | None = None) -> None:
        self.config = config
        self.static = cursor(static) if static is not None else None
        # An n-gram table matches at most max_n tokens: a static threshold above that would never
        # trigger, so it is capped at the cursor's max_match (the bias may turn negative).
        self._static_bias = config.static_bias
        if self.static is not None and self.static.max_match is not None:
            self._static_bias = min(config.dyn_threshold + config.static_bias, self.static.max_match) - config.dyn_threshold
        self.fallback = fallback
        self.name = "sam" if fallback is None else f"sam+{fallback.name}"
        self.dynamic = SuffixAutomaton.empty(1024, occurrence=config.occurrence)
        self.dyn_state, self.dyn_length = 0, 0
        self.sources = {"dynamic": 0, "static": 0, "fallback": 0, "none": 0}  # steps by draft source
        self._retrieved: tuple[int, tuple[np.ndarray, str]] | None = None  # (t0, retrieval) of model_drafter
        if fallback is not None:
            self.prefill_logits, self.needs_hidden = fallback.prefill_logits, fallback.needs_hidden

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor, **hidden: torch.Tensor) -> None:
        # hidden: `hidden=` [n, H] when the fallback needs the target's features, else nothing
        self.dynamic = SuffixAutomaton.empty(max(1024, 2 * len(prompt)), occurrence=self.config.occurrence)
        self.dyn_state, self.dyn_length = 0, 0
        self._retrieved = None
        self._insert(prompt)
        if self.static is not None:
            self.static.reset(prompt)
        if self.fallback is not None:
            self.fallback.start(prompt, prompt_logits, **hidden)

    def model_drafter(self, t0: int) -> Drafter | None:
        if self.fallback is None:
            return None
        self._retrieved = (t0, self._retrieve(t0))  # the step's propose reads it
        return self.fallback.model_drafter(t0) if len(self._retrieved[1][0]) == 0 else None

    def propose(self, t0: int) -> DraftTree:
        retrieved, self._retrieved = self._retrieved, None
        draft, source = retrieved[1] if retrieved is not None and retrieved[0] == t0 else self._retrieve(t0)
        if len(draft) == 0 and self.fallback is not None:
            self.sources["fallback"] += 1
            return self.fallback.propose(t0)
        self.sources[source if len(draft) else "none"] += 1
        return DraftTree.chain(draft.astype(np.int64))

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor,
                **hidden: torch.Tensor) -> None:
        self._insert(committed)
        if self.static is not None:
            self.static.advance(committed)
        if self.fallback is not None:
            self.fallback.observe(committed, input_ids, logits, **hidden)

    def _retrieve(self, t0: int) -> tuple[np.ndarray, str]:
        cfg = self.config
        dyn_state, m_dyn = self.dynamic.step(self.dyn_state, self.dyn_length, t0)
        m_st, handle = self.static.peek(t0) if self.static is not None else (0, None)
        m_st_biased = m_st - self._static_bias
        if max(m_dyn, m_st_biased) < cfg.dyn_threshold:
            return np.zeros(0, dtype=np.int32), "none"
        if m_dyn >= m_st_biased:
            return self._dynamic_draft(dyn_state, t0, self._length(m_dyn)), "dynamic"
        return self.static.draft(handle, self._length(m_st)), "static"

    def _dynamic_draft(self, state: int, t0: int, n: int) -> np.ndarray:
        head = self.dynamic.continuation(state, n)
        if len(head) == n or self.dynamic.end_position(state) + 1 + len(head) < len(self.dynamic.tokens):
            return head
        # the occurrence's continuation runs into the text's end, which t0 and then the draft
        # itself follow: the text repeats with period len(head) + 1
        return np.resize(np.append(head, np.int32(t0)), n)

    def _length(self, match: int) -> int:
        return min(self.config.max_draft, int(self.config.alpha * match))

    def _insert(self, tokens: np.ndarray) -> None:
        # Pointer first, then the token: the match stays an earlier occurrence.
        self.dyn_state, self.dyn_length = self.dynamic.extend_tracking(tokens, self.dyn_state, self.dyn_length)
