"""CUDA graphs for the verify forward at (rows, width, key length) buckets (`BatchVerifyGraphs`);
one target serves batch 1 and batches alike (decode/engine/batched.py). Key buckets keep a long
capacity from slowing short contexts: a verify reads O(past) keys, not O(capacity).

Every graph is captured at once (`prepare`), largest first, into one memory pool, after the cache
has its final size: never inside a timed run. A graph holds the cache storage's address, so a new
storage (a longer request than reserved, a shrink after an out-of-memory) recaptures everything
once. A capture that fails (a forward that reads a device value on the host, such as dynamic RoPE)
drops graphs for good with one warning: the verify runs eagerly. Graph outputs (logits, hidden) are
graph memory, overwritten by the next replay of the same graph: callers use them within the step.
The device is reached through a `CaptureBackend`, so a CPU test can drive it with a stand-in.
"""
from __future__ import annotations

import gc
import warnings
from typing import Callable, Protocol

import numpy as np
import torch

from samctl.decode.engine.target import room
from samctl.decode.engine.transfer import to_device

# Widths up to 128: every method's default GPU draft fits (recycle 81 inputs, lookahead about 86,
# adaptive and rest 65); tests/test_graphs_cpu.py checks each registry default against them.
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
MIN_BUCKET = 256  # smallest key-length bucket; buckets double up to the capacity
DEFAULT_RESERVE = 4096  # cache entries reserved (and captured for) when the caller names none


def key_buckets(capacity: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Key lengths graphs are captured at: smallest, 2*smallest, ... below capacity, then capacity."""
    out, b = [], smallest
    while b < capacity:
        out.append(b)
        b *= 2
    return tuple(out) + (capacity,)


class CaptureBackend(Protocol):
    def new_pool(self) -> object: ...

    def capture(self, forward: Callable[[], None], pool: object) -> Callable[[], None]:
        """Warm `forward` up, capture it into `pool` and return the function that replays it."""
        ...


class CudaBackend:
    """torch.cuda graphs on the target's own device (cuda:N too), warmed up on a side stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def new_pool(self) -> object:
        with torch.cuda.device(self.device):
            return torch.cuda.graph_pool_handle()

    def capture(self, forward: Callable[[], None], pool: object) -> Callable[[], None]:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                forward()
        return graph.replay


class _Graph:
    def __init__(self, width: int, keys: int) -> None:
        self.width, self.keys = width, keys
        self.replay: Callable[[], None] | None = None
        self.logits: torch.Tensor | None = None  # [w, V] graph memory
        self.hidden: torch.Tensor | None = None  # [w, H] graph memory: the final norm's output


def enable_cuda_graphs(target, enabled: bool = True, reserve: int | None = None,
                       backend: CaptureBackend | None = None) -> None:
    """Capture a TargetModel's verify forwards at every width up to the largest default draft, now,
    for a cache of `reserve` entries (default: min(4096, the model's context)); give the longest
    prompt + max new tokens when known, so that no capture lands in a timed run. A no-op off CUDA
    unless a `backend` is given (a test's stand-in)."""
    enable_row_graphs(target.rows, enabled, reserve, backend)


def enable_row_graphs(rows, enabled: bool = True, reserve: int | None = None,
                      backend: CaptureBackend | None = None) -> None:
    """`enable_cuda_graphs` for a BatchedTarget itself: a target's rows, or a draft model's batch
    (decode.draft_model; a longer prefill than the widest graph runs eagerly)."""
    if enabled and (backend is not None or rows.device.type == "cuda"):
        rows.reserve(room(reserve if reserve is not None else min(DEFAULT_RESERVE, rows.max_positions)))
    enable_batch_graphs(rows, WIDTHS[-1] - 1, enabled, backend)


ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def buckets_upto(sizes: tuple[int, ...], most: int) -> tuple[int, ...]:
    """The sizes below `most`, then `most` itself: every count 1..most has a bucket >= it."""
    return tuple(s for s in sizes if s < most) + (most,)


class _BatchInputs:
    """Static inputs of one (rows, width) bucket, shared by its graphs at every key-length bucket;
    positions, write positions and the mask are computed from them inside the graph."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.rel = torch.zeros(rows, width, dtype=torch.int64, device=device)  # depth of each input in its tree
        self.visible = torch.eye(width, dtype=torch.bool, device=device).expand(rows, width, width).clone()
        self.past = torch.zeros(rows, dtype=torch.int64, device=device)  # committed entries per row
        self.arange = torch.arange(width, device=device)


class BatchVerifyGraphs:
    """A step of A rows whose widest block has q inputs replays the graph of the smallest row bucket
    R >= A, width bucket W >= q and key bucket K >= max L_b + W: rows are padded to W inputs
    (padding sees itself only and writes K/V behind its row's committed entries), rows A..R-1
    are empty slots of the cache that write garbage into their own free rows. Positions, write
    positions and the [R, 1, W, K] mask are computed inside the graph from four static inputs
    (ids, depths, ancestry, committed lengths), so a replay copies those and nothing else."""

    def __init__(self, target, max_width: int, backend: CaptureBackend | None = None) -> None:
        if backend is None:
            assert target.device.type == "cuda", target.device
            backend = CudaBackend(target.device)
        self.target, self.backend = target, backend
        self.widths = buckets_upto(BATCH_WIDTHS, max_width + 1)
        self.rows: tuple[int, ...] = ()
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.buckets: tuple[int, ...] = ()
        self.generation: int | None = None
        self.captures = self.prepares = self.replays = 0
        self.failed: str | None = None
        self.hidden: torch.Tensor | None = None  # [R * W, H] of the last replay, when the target wants it
        self._inputs: dict[tuple[int, int], _BatchInputs] = {}

    def covers(self, rows: int, q: int) -> bool:
        return self.failed is None and q <= self.widths[-1] and rows <= self.target.rows

    @torch.inference_mode()
    def prepare(self) -> None:
        """Capture every graph now, for the cache as it is (its storage allocated here if need be)."""
        target = self.target
        if target.cache.storage is None:  # the storage takes its shapes from a first forward
            target.prefill([0], [np.zeros(1, dtype=np.int64)], [False])
            target.lengths[0] = 0
        target.reserve(int(target.lengths.max()) + self.widths[-1])
        self._capture_all()

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, rel: np.ndarray, visible: np.ndarray, past: np.ndarray) -> tuple[torch.Tensor, int] | None:
        # ids: [A, q] int64 device (placeholders 0); rel: [A, q] host depths; visible: [A, q, q]
        # host ancestry; past: [A] host committed lengths -> (logits [R * W, V] graph memory, W),
        # row b's input i at b * W + i; None when graphs are off (the caller runs eagerly)
        target, cache = self.target, self.target.cache
        rows, q = ids.shape
        # room for every width behind every row: a recapture writes them all there
        target.reserve(int(target.lengths.max()) + self.widths[-1])
        if cache.generation != self.generation:
            self._capture_all()
            if self.failed is not None:
                return None
        r = next(b for b in self.rows if b >= rows)
        w = next(b for b in self.widths if b >= q)
        # padding rows write behind their own committed entries: a draft model's batch verifies
        # rows 0..max(row) of its forks, so a row past those may hold a live fork's cache
        past = np.concatenate((past, target.lengths[rows:r]))
        keys = next(b for b in self.buckets if b >= int(past.max()) + w)
        inputs = self._inputs[(r, w)]
        inputs.ids.zero_()
        inputs.ids[:rows, :q] = ids
        vis_pad = np.broadcast_to(np.eye(w, dtype=np.bool_), (r, w, w)).copy()  # padding sees itself only
        vis_pad[:rows, :q, :q] = visible
        inputs.rel.copy_(to_device(np.pad(rel, ((0, r - rows), (0, w - q))), target.device))
        inputs.visible.copy_(to_device(vis_pad, target.device))
        inputs.past.copy_(to_device(past, target.device))
        g = self.graphs[(r, w, keys)]
        g.replay()
        self.replays += 1
        self.hidden = g.hidden if target.wants_hidden else None
        return g.logits, w

    def _capture_all(self) -> None:
        # largest first, so that the later graphs fit in the pool it grew
        target, cache = self.target, self.target.cache
        self.graphs.clear()
        self.generation = cache.generation
        self.rows = buckets_upto(ROW_BUCKETS, target.rows)
        self.buckets = key_buckets(cache.capacity)
        self._inputs = {(r, w): _BatchInputs(r, w, target.device) for r in self.rows for w in self.widths}
        order = sorted(((r, w, k) for r in self.rows for w in self.widths for k in self.buckets if w <= k),
                       key=lambda rwk: (-rwk[0] * rwk[1] * rwk[2], -rwk[0] * rwk[1]))
        pool = self.backend.new_pool()
        # Python's cyclic collector must not run mid-capture: freeing an unreachable old graph there
        # (a dropped target's, a cycle with it) is an operation a capturing stream refuses, and the
        # capture fails. Collect once now, then hold the collector until every graph is captured.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for key in order:
                self.graphs[key] = self._capture(*key, pool)
                self.captures += 1
        except Exception as err:  # noqa: BLE001 - any capture failure means: run eagerly
            self.graphs.clear()
            self.failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
            warnings.warn(f"samctl: CUDA graph capture failed ({self.failed}); the batched verify runs eagerly",
                          RuntimeWarning, stacklevel=3)
            self.generation = None
        finally:
            if collecting:
                gc.enable()
        self.prepares += 1

    def _capture(self, rows: int, width: int, keys: int, pool: object) -> _Graph:
        # Warm-up and capture write each row's K/V behind its committed entries (rows in flight
        # keep theirs), as every replay does.
        target, cache = self.target, self.target.cache
        g, inputs = _Graph(width, keys), self._inputs[(rows, width)]
        inputs.past.copy_(to_device(target.lengths[:rows].astype(np.int64), target.device))

        def forward() -> None:
            positions = inputs.past[:, None] + inputs.rel
            cache.write_positions = inputs.past[:, None] + inputs.arange
            cache.kv_length = keys
            wants = target.wants_hidden
            target.wants_hidden = target.gives_hidden  # every graph keeps them: switching needs no recapture
            try:
                g.logits = target.forward(inputs.ids, positions, target.verify_mask(inputs.past, inputs.visible, keys),
                                          None, upto=keys)
                g.hidden = target.forward_hidden
            finally:
                cache.write_positions = None
                target.wants_hidden = wants

        g.replay = self.backend.capture(forward, pool)
        return g


def enable_batch_graphs(target, max_width: int, enabled: bool = True, backend: CaptureBackend | None = None) -> None:
    """Capture the batched target's verify forwards as graphs, all now; a no-op off CUDA unless a
    `backend` is given (a test's stand-in)."""
    target.graphs = None
    if enabled and (backend is not None or target.device.type == "cuda"):
        graphs = BatchVerifyGraphs(target, max_width, backend)
        graphs.prepare()
        target.graphs = graphs
