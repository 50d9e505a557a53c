"""The drafter interface shared by every method, and the trivial `ar` drafter.

Contract, per sequence: `start` once with the prompt and the prefill logits; then each step
`propose(t0)` returns a draft tree rooted at the pending token t0, and `observe` reports the
tokens that step committed (t0 first, then the accepted drafts; the new pending token is the next
t0) together with every verified input and its logits, rejected nodes included.
A drafter may keep state across sequences (Token Recycle's table warms up that way). Optional:
`finish(output)` after the last step, with every new token of the sequence (the last step has no
`observe`), for drafters that remember whole outputs across requests.

The logits (and hidden states) `observe` gets may be views of CUDA-graph memory that the next
verify overwrites: use them within the step, or copy what must outlive it.

Optional attribute `prefill_logits`: "last" (the default when absent) gives `start` the logits of
the last prompt position only, [1, V]; "all" gives every position, [n, V], which costs a large
block for long prompts and is for drafters that learn from the prompt's logits.

Optional attribute `needs_hidden` (EAGLE heads): when true, `start` and `observe` also get
`hidden=`, the target's last hidden state (post-final-norm, the lm_head input) on the device at
every prompt position ([n, H]) and at every committed position of the step ([1+a, H]), from the
same forward that produced the logits.

Optional method `accept(logits, tree, input_ids, sampling, generator) -> (path, bonus, host
input_ids)`: the drafter's own acceptance rule in place of the loop's. Only a reference
reproduction of a rule that is not lossless has one (`sdsat-nucleus-reference`); every other
method leaves acceptance to the loop, which is what makes it lossless.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from samctl.decode.tree import DraftTree


class Drafter(Protocol):
    name: str

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        # prompt: [n] int64 host ids; prompt_logits: [n, V] on the model's device with
        # prefill_logits == "all", else [1, V] (the last position)
        ...

    def propose(self, t0: int) -> DraftTree: ...

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        # committed: [1+a] int64 host ids; input_ids: [q] device ids of the verify input
        # (placeholders as -1); logits: [q, V] the target's logits at those inputs
        ...


class NoDraft:
    """`ar`: plain decoding through the same loop, the baseline every method is compared to."""

    name = "ar"

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        pass

    def propose(self, t0: int) -> DraftTree:
        return DraftTree.empty()

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass
