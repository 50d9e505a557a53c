"""CUDA graphs for the verify forward at fixed widths and key lengths (CUDA only; the CPU never
gets here except through a test's stand-in backend).

A verify of q tokens after `past` committed ones runs the graph of the smallest width w >= q and
the smallest key-length bucket b >= past + w: inputs are padded to w, the cache is in fixed mode
(K/V written at device positions past..past+w-1, attention over the first b entries only) and a
[w, b] view of one mask buffer shows each row the committed prefix plus its tree ancestors.
Padding rows write K/V behind the committed length, where nothing reads them before they are
overwritten. Buckets keep a long capacity from slowing short contexts: a verify reads
O(past) keys, not O(capacity).

Every graph is captured at once (`prepare`), largest first, into one memory pool, after the cache
has its final size: never inside a timed run. A graph holds the cache storage's address, so a
storage growth (a longer request than reserved) recaptures everything once and counts it. A
capture that fails (a forward that reads a device value on the host, such as dynamic RoPE)
drops graphs for good with one warning: the verify runs eagerly. Every capture keeps the final
norm's output (a hook alive only while capturing), so targets that want hidden states
(`capture_hidden`) can switch it on and off without recapturing.

Graph outputs (logits, hidden) are views of graph memory, overwritten by the next replay of the
same graph: callers use them within the step.

The bookkeeping talks to the device through a `CaptureBackend` (capture a forward, return its
replay), so a CPU test can drive it with a stand-in that replays eagerly.
"""
from __future__ import annotations

import warnings
from typing import Callable, Protocol

import numpy as np
import torch

from samctl.decode.engine.kv_cache import with_cache
from samctl.decode.engine.transfer import to_device
from samctl.decode.tree import DraftTree, ancestor_matrix

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


class _Inputs:
    """Static inputs of one width, shared by its graphs at every key-length bucket."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.ids = torch.zeros(1, width, dtype=torch.int64, device=device)
        self.positions = torch.zeros(1, width, dtype=torch.int64, device=device)
        self.write_positions = torch.arange(width, device=device)
        self.arange = torch.arange(width, device=device)


class _Graph:
    def __init__(self, width: int, keys: int) -> None:
        self.width, self.keys = width, keys
        self.replay: Callable[[], None] | None = None
        self.logits: torch.Tensor | None = None  # [w, V] graph memory
        self.hidden: torch.Tensor | None = None  # [w, H] graph memory: the final norm's output


class VerifyGraphs:
    def __init__(self, target, widths: tuple[int, ...] = WIDTHS, backend: CaptureBackend | None = None,
                 reserve: int | None = None) -> None:
        if backend is None:
            assert target.device.type == "cuda", target.device
            backend = CudaBackend(target.device)
        self.target, self.widths, self.backend = target, widths, backend
        self.reserve = reserve if reserve is not None else min(DEFAULT_RESERVE, target.max_positions)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.generation: int | None = None  # the cache storage generation the graphs hold
        self.buckets: tuple[int, ...] = ()
        self.captures = 0  # graphs captured so far (all widths x buckets per prepare)
        self.prepares = 0  # capture rounds: 1 unless the cache had to grow past `reserve`
        self.replays = 0
        self.failed: str | None = None  # why graphs are off for good, after a failed capture
        self._inputs = {w: _Inputs(w, target.device) for w in widths}
        self._mask: torch.Tensor | None = None  # [max width, capacity], shared by every graph
        self._blocked = torch.finfo(target.dtype).min

    def covers(self, q: int) -> bool:
        return self.failed is None and q <= self.widths[-1]

    @torch.inference_mode()
    def prepare(self, n: int | None = None) -> None:
        """Reserve room for n cache entries (default: `reserve`) and capture every graph now."""
        target, cache = self.target, self.target.cache
        self.reserve = max(self.reserve, n or 0)
        if cache.storage is None:  # the storage takes its shapes from a first forward
            target.prefill(torch.zeros(1, dtype=torch.int64, device=target.device), reserve=self.reserve)
            target.truncate(0)
        cache.reserve(self.reserve)
        self._capture_all()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tree: DraftTree, past: int) -> torch.Tensor | None:
        # input_ids: [q] int64 device (placeholders already 0); position_ids: [1, q]
        # -> logits [q, V], or None when graphs are off (the caller runs the forward eagerly)
        q = int(input_ids.shape[0])
        width = next(w for w in self.widths if w >= q)
        cache = self.target.cache
        cache.reserve(past + self.widths[-1])  # room for every width: a recapture writes them all here
        if cache.generation != self.generation:  # new storage: the graphs point at freed memory
            self._capture_all()
            if self.failed is not None:
                return None
        keys = next(b for b in self.buckets if b >= past + width)
        g = self.graphs[(width, keys)]
        inputs = self._inputs[width]
        inputs.ids.zero_()
        inputs.ids[0, :q] = input_ids
        inputs.positions.fill_(past)
        inputs.positions[:, :q] = position_ids
        torch.add(inputs.arange, past, out=inputs.write_positions)
        self._fill_mask(self._mask[:width, :keys], tree, past, q)
        g.replay()
        self.replays += 1
        cache.set_length(past + q)
        if self.target.wants_hidden:
            self.target.hidden = g.hidden[:q]
        return g.logits[:q]

    def _fill_mask(self, mask: torch.Tensor, tree: DraftTree, past: int, q: int) -> None:
        # mask: [w, b] view: every row sees the committed prefix; rows < q their tree ancestors
        mask.fill_(self._blocked)
        mask[:, :past] = 0.0
        block = np.where(ancestor_matrix(tree.parents), 0.0, self._blocked).astype(np.float32)
        mask[:q, past : past + q] = to_device(block, mask.device)

    # -- capture ------------------------------------------------------------------------------

    def _capture_all(self) -> None:
        cache = self.target.cache
        self.graphs.clear()
        self.generation = cache.generation
        self.buckets = key_buckets(cache.capacity)
        # capacity is a multiple of 64 (kv_cache.ALIGN): the mask rows' stride stays aligned
        self._mask = torch.zeros(self.widths[-1], cache.capacity, dtype=self.target.dtype, device=self.target.device)
        order = sorted(((w, b) for w in self.widths for b in self.buckets), key=lambda wb: (-wb[0] * wb[1], -wb[0]))
        capture_each(self, order, self._capture, "the verify forward")

    def _capture(self, width: int, keys: int, pool: object) -> _Graph:
        cache, model = self.target.cache, self.target.model
        g, inputs = _Graph(width, keys), self._inputs[width]
        mask = self._mask[:width, :keys][None, None]
        saved = cache.get_seq_length()
        # Warm-up and capture write K/V at [saved, saved + width): behind the committed length,
        # inside the storage (run() reserved past + width before a recapture).
        assert saved + width <= cache.capacity, ("a capture must fit the cache", saved, width, cache.capacity)
        torch.add(inputs.arange, saved, out=inputs.write_positions)
        inputs.positions.copy_(inputs.write_positions[None])
        mask.zero_()
        norm = final_norm_or_none(model)

        def keep_hidden(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            g.hidden = output[0]

        def forward() -> None:
            cache.write_positions, cache.key_length = inputs.write_positions, keys
            native = getattr(self.target, "native", None)
            hook = norm.register_forward_hook(keep_hidden) if norm is not None and native is None else None
            try:
                if native is not None:
                    g.logits, g.hidden = native(inputs.ids, inputs.positions, mask, cache, upto=keys)
                else:
                    g.logits = model(input_ids=inputs.ids, position_ids=inputs.positions, attention_mask=mask,
                                     **with_cache(model, cache), use_cache=True).logits[0]
            finally:
                cache.write_positions, cache.key_length = None, None
                if hook is not None:
                    hook.remove()

        g.replay = self.backend.capture(forward, pool)
        cache.set_length(saved)
        return g


def capture_each(owner, order: list[tuple], capture: Callable[..., _Graph], what: str) -> None:
    """One graph per key of `order` (a bucket tuple, the capture's arguments) into one new pool,
    largest first so that the later ones fit in the pool it grew. Any failure drops them all,
    warns once and leaves `owner.failed` set: `what` then runs eagerly."""
    pool = owner.backend.new_pool()
    try:
        for key in order:
            owner.graphs[key] = capture(*key, pool)
            owner.captures += 1
    except Exception as err:  # noqa: BLE001 - any capture failure means: run eagerly
        owner.graphs.clear()
        owner.failed = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
        warnings.warn(f"samctl: CUDA graph capture failed ({owner.failed}); {what} runs eagerly",
                      RuntimeWarning, stacklevel=4)
        owner.generation = None
    owner.prepares += 1


def final_norm_or_none(model: torch.nn.Module) -> torch.nn.Module | None:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


def enable_cuda_graphs(target, enabled: bool = True, reserve: int | None = None) -> None:
    """Capture verify forwards as CUDA graphs when the target is on CUDA (a no-op elsewhere), all
    of them now, for a cache of `reserve` entries (default: min(4096, the model's context)); give
    the longest prompt + max new tokens when known, so that no capture lands in a timed run."""
    target.graphs = None
    if enabled and target.device.type == "cuda":
        graphs = VerifyGraphs(target, reserve=reserve)
        graphs.prepare()
        target.graphs = graphs


# -- the batched target's verify (decode/engine/batched.py) ------------------------------------------
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
    """The batched verify forward as graphs at (rows, width, key length) buckets.

    A step of A rows whose widest block has q inputs replays the graph of the smallest row bucket
    R >= A, width bucket W >= q and key bucket K >= max L_b + W: rows are padded to W inputs
    (padding sees itself only and writes K/V behind its row's committed entries), rows A..R-1
    are empty slots of the cache that compute and write garbage into their own free rows. The
    positions, the cache's write positions and the [R, 1, W, K] mask are computed inside the
    graph from four static inputs (ids, depths, ancestry, committed lengths), so a replay copies
    those and nothing else. The logits of every padded input come out ([R * W, V], graph memory);
    the caller picks the real ones. Every graph is captured at once (`prepare`), largest first,
    into one pool; a new cache storage (growth, a shrink after an out-of-memory) recaptures all.
    """

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
        keys = next(b for b in self.buckets if b >= int(past.max()) + w)
        inputs = self._inputs[(r, w)]
        inputs.ids.zero_()
        inputs.ids[:rows, :q] = ids
        rel_pad = np.zeros((r, w), dtype=np.int64)
        rel_pad[:rows, :q] = rel
        vis_pad = np.broadcast_to(np.eye(w, dtype=np.bool_), (r, w, w)).copy()
        vis_pad[:rows, :q, :q] = visible
        past_pad = np.zeros(r, dtype=np.int64)
        past_pad[:rows] = past
        inputs.rel.copy_(to_device(rel_pad, target.device))
        inputs.visible.copy_(to_device(vis_pad, target.device))
        inputs.past.copy_(to_device(past_pad, target.device))
        g = self.graphs[(r, w, keys)]
        g.replay()
        self.replays += 1
        self.hidden = g.hidden if target.wants_hidden else None
        return g.logits, w

    def _capture_all(self) -> None:
        target, cache = self.target, self.target.cache
        self.graphs.clear()
        self.generation = cache.generation
        self.rows = buckets_upto(ROW_BUCKETS, target.rows)
        self.buckets = key_buckets(cache.capacity)
        self._inputs = {(r, w): _BatchInputs(r, w, target.device) for r in self.rows for w in self.widths}
        order = sorted(((r, w, k) for r in self.rows for w in self.widths for k in self.buckets if w <= k),
                       key=lambda rwk: (-rwk[0] * rwk[1] * rwk[2], -rwk[0] * rwk[1]))
        capture_each(self, order, self._capture, "the batched verify")

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


def enable_batch_graphs(target, max_width: int, enabled: bool = True) -> None:
    """Capture the batched target's verify forwards as CUDA graphs (a no-op off CUDA), all now."""
    target.graphs = None
    if enabled and target.device.type == "cuda":
        graphs = BatchVerifyGraphs(target, max_width)
        graphs.prepare()
        target.graphs = graphs
