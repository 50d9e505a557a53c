"""The drafter interface shared by every method, and the trivial `ar` drafter.

Contract, per sequence: `start` once with the prompt and the prefill logits; then each step
`propose(t0)` returns a draft tree rooted at the pending token t0, and `observe` gets the tokens
the step committed (t0 first, then the accepted drafts) with every verified input and its logits,
rejected nodes included. A drafter may keep state across sequences (Token Recycle's table).
The logits (and hidden states) `observe` gets may be views of CUDA-graph memory that the next
verify overwrites: copy what must outlive the step.

Every optional hook is declared and documented on `Drafter` only, with its default; callers (the
loop, the batched engine, simulate, the session) use the attributes directly, never probe for them.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import numpy as np
import torch

from samctl.decode.tree import DraftTree


class Drafter:
    """`start`, `propose` and `observe` are required; the other hooks' defaults do nothing."""

    name: str = ""  # the method name, as in the registry

    # "last": `start` gets the logits of the last prompt position only, [1, V]; "all": of every
    # position, [n, V] (a large block for long prompts; for drafters that learn from the prompt).
    prefill_logits: str = "last"

    # True (EAGLE heads): `start` and `observe` also get `hidden=`, the target's last hidden state
    # (post-final-norm, the lm_head input) on the device at every prompt position ([n, H]) and at
    # every committed position of the step ([1+a, H]), from the forward that produced the logits.
    needs_hidden: bool = False

    # The drafter's own acceptance rule, `accept(logits, tree, input_ids, sampling, generator) ->
    # (path, bonus, host input_ids)`; None: the loop's, which is what makes a method lossless.
    # Only `sdsat-nucleus-reference`, a reference reproduction of a biased rule, has one.
    accept: ClassVar[Callable[..., Any] | None] = None

    # Cross-request memory: True when `memory_documents`/`load_memory` keep outputs across
    # requests (--memory-file, --memory-save). `remember = False` (benchmark repeats, replays of
    # independent traces) makes `finish` leave the memory as it was.
    keeps_memory: bool = False
    remember: bool = True

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        # prompt: [n] int64 host ids; prompt_logits: [n, V] on the model's device with
        # prefill_logits == "all", else [1, V] (the last position); None in a model-free replay
        raise NotImplementedError

    def propose(self, t0: int) -> DraftTree:
        raise NotImplementedError

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        # committed: [1+a] int64 host ids; input_ids: [q] device ids of the verify input
        # (placeholders as -1); logits: [q, V] the target's logits at those inputs (None in a replay)
        raise NotImplementedError

    def finish(self, output: np.ndarray) -> None:
        """After the last step, every new token of the sequence ([m] int64; the last step has no
        `observe`): for drafters that remember whole outputs across requests."""

    def expect(self, prediction: np.ndarray | list[int] | None) -> None:
        """The next request's expected output (`--prediction`, the server's Predicted Outputs), or
        None; applies to the next `start` only. Drafters without a prediction source ignore it."""

    def prediction_usage(self) -> Any:
        """The last request's accepted and rejected prediction tokens (a PredictionUsage), or None."""
        return None

    def propose_scored(self, t0: int) -> tuple[DraftTree, np.ndarray | None]:
        """`propose` with each node's path probability ([n] float64, prefix-closed order), which the
        batched engine spends its node budget by; None: the engine estimates them from the tree."""
        return self.propose(t0), None

    def model_drafter(self, t0: int) -> "Drafter | None":
        """The drafter (itself, or a fallback) that drafts this step's tree with a draft model, so
        that the batched engine drafts such rows together: the class's `draft_together(drafters,
        t0s)` fills each one's `ready` = (t0, tree) for its propose; None: no draft model."""
        return None

    def keep_first(self, k: int) -> None:
        """The batched engine verifies only the first k nodes of the last (scored) proposal."""

    def keep_depth(self, max_depth: int) -> None:
        """The loop verifies only the nodes of the last proposal up to `max_depth` (root children
        at 1): deeper drafts would pass the tokens still wanted or the context."""

    def memory_documents(self) -> list[np.ndarray]:
        """The remembered outputs, oldest first (with `keeps_memory`)."""
        return []

    def load_memory(self, documents: list[np.ndarray]) -> None:
        """Preload the cross-request memory (with `keeps_memory`)."""

    def share_memory(self, other: "Drafter") -> bool:
        """Read and grow `other`'s cross-request memory from now on, instead of a memory of its own
        (one memory for a session's drafters); False: this drafter cannot, its memory stays its own."""
        return False

    def report(self) -> dict:
        """What the drafter learned so far, for `chat`'s /sources (empty: nothing to say)."""
        return {}


class DraftsTogether(Drafter):
    """Drafts every step with a draft model (see `Drafter.model_drafter`): `propose` returns the
    tree kept in `ready`, else drafts its row alone through `draft_together`."""

    ready: tuple[int, DraftTree] | None = None  # (t0, tree) drafted beside other rows

    def model_drafter(self, t0: int) -> "Drafter":
        return self

    @staticmethod
    def draft_together(drafters: list, t0s: list[int]) -> list[DraftTree]:
        raise NotImplementedError

    def propose(self, t0: int) -> DraftTree:
        ready, self.ready = self.ready, None
        if ready is not None and ready[0] == t0:
            return ready[1]
        return self.draft_together([self], [t0])[0]


class NoDraft(Drafter):
    """`ar`: plain decoding through the same loop, the baseline every method is compared to."""

    name = "ar"

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        pass

    def propose(self, t0: int) -> DraftTree:
        return DraftTree.empty()

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        pass


class TokenHistory:
    """The committed tokens of a request (prompt first): ids[:n] int64, in a buffer that doubles."""

    def __init__(self) -> None:
        self.ids = np.zeros(1024, dtype=np.int64)
        self.n = 0

    def reset(self, prompt: np.ndarray) -> None:
        self.n = 0
        self.extend(prompt)

    def extend(self, tokens: np.ndarray) -> None:
        if self.n + len(tokens) > len(self.ids):
            self.ids = np.pad(self.ids[: self.n], (0, max(2 * len(self.ids), self.n + len(tokens)) - self.n))
        self.ids[self.n : self.n + len(tokens)] = tokens
        self.n += len(tokens)
