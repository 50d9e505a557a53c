"""One sequence on the one target: `TargetModel` is a one-row `BatchedTarget` with the calls of a
one-sequence forward (prefill, verify, keep, peek), for what drives one sequence by hand: the
verify-cost measurement, SDSAT's draft forward (`peek`), tests. The decode loop runs every sequence
as a row of a BatchedTarget. Knows nothing of drafters or acceptance rules.
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.engine.batched import BatchedTarget, verify_input
from samctl.decode.tree import DraftTree

VERIFY_SLACK = 256  # draft nodes a one-row verify may hold beyond prompt + output: cache room reserved for them


def room(tokens: int, width: int = VERIFY_SLACK) -> int:
    """Cache entries a row of `tokens` (prompt + output) reserves, its widest verify block included."""
    return tokens + width + 2


class TargetModel:
    """The model and a one-row cache: one sequence at a time. `rows` is the BatchedTarget the
    decode loop runs (decode.loop.generate); the rest are views of its row 0."""

    def __init__(self, model: torch.nn.Module, fold_groups: bool | None = None) -> None:
        self.rows = BatchedTarget(model, 1, 2, fold_groups)  # the cache allocates at the first forward
        self.hidden: torch.Tensor | None = None  # [q, H] of the last prefill or verify, with capture_hidden only

    model = property(lambda self: self.rows.model)
    device = property(lambda self: self.rows.device)
    dtype = property(lambda self: self.rows.dtype)
    max_positions = property(lambda self: self.rows.max_positions)
    context_note = property(lambda self: self.rows.context_note)
    vocab_size = property(lambda self: self.rows.vocab_size)
    native = property(lambda self: self.rows.native)
    cache = property(lambda self: self.rows.cache)
    eager_fallbacks = property(lambda self: self.rows.eager_fallbacks)
    wants_hidden = property(lambda self: self.rows.wants_hidden)
    graphs = property(lambda self: self.rows.graphs, lambda self, graphs: setattr(self.rows, "graphs", graphs))

    @property
    def cached(self) -> int:
        """Tokens whose K/V are in the cache and committed."""
        return int(self.rows.lengths[0])

    def capture_hidden(self, enabled: bool) -> None:
        """Keep the last hidden state of every prefill and verify position in `hidden`."""
        self.rows.wants_hidden = enabled
        if not enabled:
            self.hidden = None

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor | np.ndarray, all_logits: bool = False, reserve: int = 0) -> torch.Tensor:
        # prompt_ids: [n] int64 -> logits [n, V] of every prompt position if all_logits, else
        # [1, V] at the last one (a [n, V] float32 block is 150 MB for 769 tokens of a 49k vocab)
        prompt = prompt_ids.cpu().numpy() if isinstance(prompt_ids, torch.Tensor) else np.asarray(prompt_ids)
        self.rows.lengths[0] = 0
        self.rows.reserve(room(max(reserve, len(prompt))))
        logits = self.rows.prefill([0], [prompt.astype(np.int64)], [all_logits])[0]
        self.hidden = self.rows.prefill_hidden[0] if self.rows.wants_hidden else None
        return logits

    def verify_input(self, t0: int, tree: DraftTree) -> torch.Tensor:
        return verify_input(t0, tree, self.device)

    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, tree: DraftTree) -> torch.Tensor:
        # input_ids: [q] int64 = [t0, nodes...] on device (placeholders -1 are fed as 0)
        # -> logits [q, V]. Writes q entries behind the committed ones; `keep` commits a path.
        logits, _ = self.rows.verify([input_ids], [tree])
        self.hidden = self.rows.hidden
        return logits

    def peek(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [q] int64 on device, a chain after the committed tokens -> logits [q, V],
        # committing nothing: the next verify overwrites these entries (SDSAT's draft forward).
        return self.verify(input_ids, DraftTree.chain(np.zeros(int(input_ids.shape[0]) - 1, dtype=np.int64)))

    def keep(self, path: np.ndarray) -> None:
        # path: [a+1] input indices of the accepted path of the last verify, root (0) first
        self.rows.keep([np.asarray(path, dtype=np.int64)])
