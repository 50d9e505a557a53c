"""CUDA graphs for the verify forward at a few fixed widths (CUDA only; the CPU never gets here).

A verify of q tokens runs the graph of the smallest width w >= q: inputs are padded to w, the
cache is in fixed mode (K/V written at device positions past..past+w-1, attention over the whole
capacity) and a [w, capacity] mask shows each row the committed prefix plus its tree ancestors.
Padding rows write K/V behind the committed length, where nothing reads them before they are
overwritten. A graph holds the cache storage's address, so growing the cache drops every graph.
Captured lazily, once per width and cache allocation.
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.engine.kv_cache import with_cache
from samctl.decode.tree import DraftTree, ancestor_matrix

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


class _Graph:
    def __init__(self, width: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.ids = torch.zeros(1, width, dtype=torch.int64, device=device)
        self.positions = torch.zeros(1, width, dtype=torch.int64, device=device)
        self.write_positions = torch.arange(width, device=device)
        self.mask = torch.zeros(1, 1, width, capacity, dtype=dtype, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # [w, H], captured when the target keeps hidden states


class VerifyGraphs:
    def __init__(self, target, widths: tuple[int, ...] = WIDTHS) -> None:
        assert target.device.type == "cuda", target.device
        self.target, self.widths = target, widths
        self.graphs: dict[int, _Graph] = {}
        self.storage_ptr = None
        self.blocked = torch.finfo(target.dtype).min

    def covers(self, q: int) -> bool:
        return q <= self.widths[-1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tree: DraftTree, past: int) -> torch.Tensor:
        # input_ids: [q] int64 device (placeholders already 0); position_ids: [1, q] -> logits [q, V]
        q = int(input_ids.shape[0])
        width = next(w for w in self.widths if w >= q)
        cache = self.target.cache
        cache.reserve(past + width)
        if cache.storage.data_ptr() != self.storage_ptr:  # new storage: old graphs point at freed memory
            self.graphs.clear()
            self.storage_ptr = cache.storage.data_ptr()
        g = self.graphs.get(width) or self._capture(width)
        g.ids.zero_()
        g.ids[0, :q] = input_ids
        g.positions.fill_(past)
        g.positions[:, :q] = position_ids
        torch.add(torch.arange(width, device=input_ids.device), past, out=g.write_positions)
        self._fill_mask(g.mask[0, 0], tree, past, q)
        g.graph.replay()
        cache.set_length(past + q)
        if g.hidden is not None and self.target._hidden_hook is not None:  # only while hidden states are wanted
            self.target.hidden = g.hidden[:q]
        return g.logits[:q]

    def _fill_mask(self, mask: torch.Tensor, tree: DraftTree, past: int, q: int) -> None:
        # mask: [w, capacity]: every row sees the committed prefix; rows < q their tree ancestors
        mask.fill_(self.blocked)
        mask[:, :past] = 0.0
        visible = ancestor_matrix(tree.parents)
        block = np.where(visible, 0.0, self.blocked).astype(np.float32)
        host = torch.from_numpy(block).pin_memory()
        mask[:q, past : past + q] = host.to(mask.device, non_blocking=True)

    def _capture(self, width: int) -> _Graph:
        cache, model = self.target.cache, self.target.model
        g = _Graph(width, cache.capacity, self.target.dtype, self.target.device)
        saved = cache.get_seq_length()

        def forward() -> torch.Tensor:
            cache.write_positions = g.write_positions
            try:
                out = model(input_ids=g.ids, position_ids=g.positions, attention_mask=g.mask,
                            **with_cache(model, cache), use_cache=True)
            finally:
                cache.write_positions = None
            return out.logits[0]

        # Warm-up on a side stream, as torch.cuda.graphs requires; it writes K/V only at
        # write_positions (behind the committed length), so the cache stays valid.
        g.write_positions.add_(saved)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g.graph):
            g.logits = forward()
            # the target's hidden hook (if any) ran inside the capture: its output is graph memory
            g.hidden = self.target.hidden if self.target._hidden_hook is not None else None
        cache.set_length(saved)
        self.graphs[width] = g
        return g


def enable_cuda_graphs(target, enabled: bool = True) -> None:
    """Capture verify forwards as CUDA graphs when the target is on CUDA; a no-op elsewhere."""
    target.graphs = VerifyGraphs(target) if enabled and target.device.type == "cuda" else None
