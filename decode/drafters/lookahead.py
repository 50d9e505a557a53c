"""`lookahead` (Fu et al. 2024): a Jacobi window and an n-gram pool, verified in one forward.

Each step, with lst = the pending token t0 at position p:
    1) guess   the pool's newest tuples for key lst (at most G of N-1 tokens) as a trie below lst:
               the only nodes acceptance may walk into
    2) window  N-1 levels of context rows after the guesses (`DraftTree.accept_limit`): row 0 is
               [lst, w_1..w_{M-1}] at positions p..p+M-1, row l at p+l..p+l+M-1 hangs column by
               column below row l-1 (`window_parents`): the paper's lookahead-branch mask
    3) verify  one target forward; the engine walks the guess trie, never the window
    4) update  new[i] = argmax at the top row's column i (even when sampling). Full window: the
               pool takes key row0[i] -> (row1[i], .., row_{N-2}[i], new[i]) and rows shift down
               one level; warm-up (N-2 steps): new[1:] becomes a new level. One column per step.

The pool holds at most G tuples per key, least recently inserted out first, and lives as long as
the drafter. With `pool_text` (lade fills it from the window only) it also takes every n-gram of
the prompt and the output, which is what `simulate` replays without a model (no prefill logits:
the window is off). The window stays on the model's device, so a step keeps the engine's one host
sync; its n-grams reach the pool one step late on a GPU.
"""
from __future__ import annotations

from collections import deque

import numba
import numpy as np
import torch

from samctl.decode.engine.transfer import record_event, to_device, wait_for
from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.decode.configs import LookaheadConfig


# -- the n-gram pool --------------------------------------------------------------------------


@numba.njit(cache=True)
def pool_insert(slot: np.ndarray, grams: np.ndarray, stamp: np.ndarray, fill: np.ndarray, clock: np.ndarray,
                rows: int, keys: np.ndarray, tuples: np.ndarray) -> int:
    # slot: [V] int32 key -> row (-1 none); grams: [R, G, n] int32; stamp: [R, G] int64 insertion
    # clock of each tuple; fill: [R] int32 tuples per row; clock: [1] int64; rows: rows in use;
    # keys: [k] int32, tuples: [k, n] int32 (R >= rows + k). -> rows in use afterwards.
    # Invariant: row r holds fill[r] distinct tuples; re-inserting one refreshes its stamp, and a
    # full row replaces its smallest stamp (least recently inserted).
    g_max = grams.shape[1]
    for k in range(len(keys)):
        if g_max == 0:
            break
        r = slot[keys[k]]
        if r < 0:
            r = rows
            rows += 1
            slot[keys[k]] = r
            fill[r] = 0
        clock[0] += 1
        found = -1
        for j in range(fill[r]):
            same = True
            for t in range(tuples.shape[1]):
                if grams[r, j, t] != tuples[k, t]:
                    same = False
                    break
            if same:
                found = j
                break
        if found < 0:
            if fill[r] < g_max:
                found = fill[r]
                fill[r] += 1
            else:
                found = 0
                for j in range(1, g_max):
                    if stamp[r, j] < stamp[r, found]:
                        found = j
            grams[r, found] = tuples[k]
        stamp[r, found] = clock[0]
    return rows


@numba.njit(cache=True)
def text_ngrams(text: np.ndarray, first_end: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    # text: [t] int32 -> (keys [k] int32, tuples [k, n] int32): key text[e-n], tuple text[e-n+1..e]
    # for every end e >= first_end (e >= n), oldest first.
    start = max(first_end, n)
    k = max(0, len(text) - start)
    keys = np.empty(k, dtype=np.int32)
    tuples = np.empty((k, n), dtype=np.int32)
    for i in range(k):
        e = start + i
        keys[i] = text[e - n]
        tuples[i] = text[e - n + 1 : e + 1]
    return keys, tuples


@numba.njit(cache=True)
def trie_of(tuples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # tuples: [k, n] int32 -> (tokens [m] int64, parents [m] int32): the tuples merged into a trie
    # below the root (-1), shared prefixes once, so a walk finds the longest matching tuple.
    tokens = np.empty(tuples.shape[0] * tuples.shape[1], dtype=np.int64)
    parents = np.empty(len(tokens), dtype=np.int32)
    m = 0
    for k in range(tuples.shape[0]):
        current = -1
        for t in range(tuples.shape[1]):
            nxt = -1
            for i in range(m):
                if parents[i] == current and tokens[i] == tuples[k, t]:
                    nxt = i
                    break
            if nxt < 0:
                nxt = m
                tokens[m] = tuples[k, t]
                parents[m] = current
                m += 1
            current = nxt
    return tokens[:m], parents[:m]


class NgramPool:
    """Key token -> at most G tuples of n tokens, least recently inserted out first (flat arrays)."""

    def __init__(self, n: int, capacity: int, vocab_size: int = 0) -> None:
        self.n, self.capacity = n, capacity
        self.slot = np.full(max(vocab_size, 1), -1, dtype=np.int32)
        self.grams = np.zeros((64, capacity, n), dtype=np.int32)
        self.stamp = np.zeros((64, capacity), dtype=np.int64)
        self.fill = np.zeros(64, dtype=np.int32)
        self.clock = np.zeros(1, dtype=np.int64)
        self.rows = 0

    def insert(self, keys: np.ndarray, tuples: np.ndarray) -> None:
        # keys: [k] ints >= 0, tuples: [k, n] ints
        keys = np.asarray(keys, dtype=np.int32)
        if len(keys) == 0 or self.capacity == 0:
            return
        top = int(keys.max())
        if top >= len(self.slot):
            self.slot = np.concatenate((self.slot, np.full(top + 1 - len(self.slot), -1, dtype=np.int32)))
        if self.rows + len(keys) > len(self.fill):
            self._grow(self.rows + len(keys))
        self.rows = pool_insert(self.slot, self.grams, self.stamp, self.fill, self.clock, self.rows, keys,
                                np.ascontiguousarray(tuples, dtype=np.int32))

    def learn_text(self, text: np.ndarray, first_end: int = 0) -> None:
        """Every n+1-gram of `text` ending at index >= first_end: key its first token."""
        self.insert(*text_ngrams(np.ascontiguousarray(text, dtype=np.int32), first_end, self.n))

    def newest(self, key: int, k: int) -> np.ndarray:
        """-> [<= k, n] int32, the key's newest tuples first."""
        if key < 0 or key >= len(self.slot) or self.slot[key] < 0 or k <= 0:
            return np.zeros((0, self.n), dtype=np.int32)
        r = self.slot[key]
        order = np.argsort(-self.stamp[r, : self.fill[r]], kind="stable")[:k]
        return self.grams[r, order]

    def __len__(self) -> int:
        return int(self.fill[: self.rows].sum())

    def snapshot(self) -> tuple:
        return (self.slot.copy(), self.grams[: self.rows].copy(), self.stamp[: self.rows].copy(),
                self.fill[: self.rows].copy(), self.clock.copy(), self.rows)

    def restore(self, state: tuple) -> None:
        slot, grams, stamp, fill, clock, rows = state
        self.slot = slot.copy()
        self.grams[:rows], self.stamp[:rows], self.fill[:rows] = grams, stamp, fill
        self.fill[rows:] = 0
        self.clock[:] = clock
        self.rows = rows

    def _grow(self, need: int) -> None:
        # the rows in use kept, zero rows after them up to max(need, twice as many)
        pad = max(need, 2 * len(self.fill)) - self.rows
        self.grams, self.stamp, self.fill = (np.pad(a[: self.rows], [(0, pad)] + [(0, 0)] * (a.ndim - 1))
                                             for a in (self.grams, self.stamp, self.fill))


def guess_trie(pool: NgramPool, key: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The key's newest k tuples as a trie: (tokens [m] int64, parents [m] int32 below the root)."""
    return trie_of(np.ascontiguousarray(pool.newest(key, k)))


# -- the Jacobi window ------------------------------------------------------------------------


class JacobiWindow:
    """N-1 levels of W columns on the model's device: grid[l, i] is row l's column i, row 0's
    column 0 the lst of each `layout`. During warm-up (fill < N-2 upper levels) rows are
    M = W + N-2-fill wide; afterwards M = W."""

    def __init__(self, ngram: int, width: int, device: torch.device) -> None:
        self.levels, self.width, self.device = ngram - 1, width, torch.device(device)
        self.grid = torch.zeros((self.levels, width + ngram - 2), dtype=torch.int64, device=self.device)
        self.fill = 0
        self.active = False
        self._parents: dict[int, np.ndarray] = {}

    @property
    def columns(self) -> int:
        return self.width + self.levels - 1 - self.fill

    @property
    def size(self) -> int:
        """Context rows this window adds to a verify: (M-1) + fill * M."""
        return (self.columns - 1) + self.fill * self.columns if self.active else 0

    def seed(self, prompt: np.ndarray, rng: np.random.Generator) -> None:
        """Row 0 from random prompt tokens, the upper levels empty (warm-up follows)."""
        self.fill = 0
        self.active = len(prompt) > 0 and self.width > 0
        if self.active:
            picks = rng.choice(np.asarray(prompt, dtype=np.int64), size=self.grid.shape[1])
            self.grid[0] = to_device(picks, self.device)

    def layout(self, lst: int, anchor: int, base: int) -> tuple[torch.Tensor, np.ndarray]:
        # lst: the token at row 0 column 0, already an input at node index `anchor` (-1: the root);
        # base: node index of the window's first row.
        # -> (tokens [size] int64 on device, parents [size] int32 node indices)
        m, f = self.columns, self.fill
        self.grid[0, :1].fill_(lst)  # a fill kernel (an indexed write of a host int copies, a sync on a GPU)
        tokens = torch.cat((self.grid[0, 1:m], self.grid[1 : f + 1, :m].reshape(-1)))
        rel = self._parents.get(f)
        if rel is None:
            rel = self._parents[f] = window_parents(m, f)
        return tokens, np.where(rel < 0, anchor, rel + base).astype(np.int32)

    def top_rows(self, anchor_input: int, base_input: int) -> np.ndarray:
        """Input indices of the top level's M tokens (row 0 starts with lst's own input)."""
        m, f = self.columns, self.fill
        if f == 0:
            return np.concatenate(([anchor_input], base_input + np.arange(m - 1))).astype(np.int64)
        return (base_input + (m - 1) + (f - 1) * m + np.arange(m)).astype(np.int64)

    def update(self, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        # new: [M] int64 on device, the argmax at the top level's columns.
        # -> (keys [W], tuples [W, N-1]) for the pool once the window is full, else None.
        m, f = self.columns, self.fill
        grid = self.grid
        if f < self.levels - 1:  # warm-up: one column out, one level in
            grid[0, 1 : m - 1] = grid[0, 2:m].clone()
            grid[1 : f + 1, : m - 1] = grid[1 : f + 1, 1:m].clone()
            grid[f + 1, : m - 1] = new[1:m]
            self.fill += 1
            return None
        keys = grid[0, :m].clone()
        tuples = torch.cat((grid[1:, :m].T, new[:, None]), dim=1)
        if self.levels > 1:
            grid[: self.levels - 1, :m] = grid[1:, :m].clone()
        grid[self.levels - 1, :m] = new
        return keys, tuples


def window_parents(m: int, fill: int) -> np.ndarray:
    # -> [(m-1) + fill*m] int32, parents of the window rows relative to the window's first node
    # (-1 = the anchor lst): row 0 is a chain below lst; row l column i hangs below row l-1 column i
    # (row 0's column 0 being lst).
    parents = np.empty((m - 1) + fill * m, dtype=np.int32)
    parents[: m - 1] = np.arange(-1, m - 2)
    for level in range(1, fill + 1):
        start = (m - 1) + (level - 1) * m
        parents[start : start + m] = np.arange(-1, m - 1) if level == 1 else np.arange(start - m, start)
    return parents


class DeferredPool:
    """Pool n-grams computed on the device reach the host one step late on a GPU (a pinned copy,
    and an event after it that `flush` waits on), at once on a CPU. The pool is anything with
    `insert(keys, tuples)` of host arrays (adaptive's Token Recycle table too)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.copied: torch.cuda.Event | None = None

    def put(self, pool: NgramPool, keys: torch.Tensor, tuples: torch.Tensor) -> None:
        if self.device.type == "cpu":
            pool.insert(keys.numpy(), tuples.numpy())
            return
        self.flush(pool)
        pinned = (torch.empty(keys.shape, dtype=keys.dtype, pin_memory=True),
                  torch.empty(tuples.shape, dtype=tuples.dtype, pin_memory=True))
        pinned[0].copy_(keys, non_blocking=True)
        pinned[1].copy_(tuples, non_blocking=True)
        self.pending, self.copied = pinned, record_event(self.device)

    def flush(self, pool: NgramPool) -> None:
        if self.pending is not None:
            # Usually long done (a step's sync came between); the event makes it certain.
            wait_for(self.copied)
            pool.insert(self.pending[0].numpy(), self.pending[1].numpy())
            self.pending = None


class RemembersPool(Drafter):
    """The cross-request memory of a drafter with an n-gram pool (lookahead, ouroboros): the last
    outputs, for --memory-save, and with `remember = False` (benchmark repeats) the pool as it was
    at `start`, which `finish` restores."""

    pool: NgramPool
    deferred: DeferredPool
    documents: deque[np.ndarray]  # the last `memory` outputs
    keeps_memory = True
    _before: tuple | None = None  # the pool's snapshot at `start` when not remembering

    def _begin(self) -> None:
        # at `start`: what `finish` restores when not remembering
        self._before = None if self.remember else self.pool.snapshot()

    def finish(self, output: np.ndarray) -> None:
        self.deferred.flush(self.pool)
        if self._before is not None:
            self.pool.restore(self._before)
        elif len(output):
            self.documents.append(np.asarray(output, dtype=np.int32))
        self._before = None

    def memory_documents(self) -> list[np.ndarray]:
        return list(self.documents)

    def load_memory(self, documents: list[np.ndarray]) -> None:
        for doc in documents:
            doc = np.asarray(doc, dtype=np.int32)
            self.pool.learn_text(doc)
            self.documents.append(doc)


class LookaheadDrafter(RemembersPool):
    name = "lookahead"

    def __init__(self, config: LookaheadConfig = LookaheadConfig(), vocab_size: int = 0,
                 device: torch.device | str = "cpu", eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.pool = NgramPool(config.ngram - 1, config.guesses, vocab_size)
        self.documents = deque(maxlen=config.memory)
        self.window = JacobiWindow(config.ngram, config.window, self.device)
        self.rng = np.random.default_rng(config.seed)
        self.deferred = DeferredPool(self.device)
        self.text = np.zeros(0, dtype=np.int32)  # the last N-1 tokens, for the pool's text n-grams
        self.guesses = 0  # guess nodes in the last proposed tree
        self._warm_up()

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        prompt = np.asarray(prompt, dtype=np.int32)
        self._begin()
        self.deferred.flush(self.pool)
        if self.config.pool_text:
            self.pool.learn_text(prompt)
        self.text = prompt[-(self.config.ngram - 1):]
        # No logits (model-free replay): the window cannot be updated, so it is off.
        self.window.seed(prompt if prompt_logits is not None else prompt[:0], self.rng)

    def propose(self, t0: int) -> DraftTree:
        tokens, parents = guess_trie(self.pool, t0, self.config.guesses)
        self.guesses = len(tokens)
        if not self.window.active:
            return DraftTree(tokens=tokens, parents=parents)
        window_tokens, window_parents_ = self.window.layout(t0, -1, len(tokens))
        guess = to_device(tokens, self.device)
        return DraftTree(tokens=torch.cat((guess, window_tokens)), parents=np.concatenate((parents, window_parents_)),
                         accept_limit=len(tokens))

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        committed = np.asarray(committed, dtype=np.int32)
        if self.config.pool_text:
            text = np.concatenate((self.text, committed))
            self.pool.learn_text(text, len(self.text))
            self.text = text[-(self.config.ngram - 1):]
        if self.window.active and logits is not None:
            # A tree cut by the loop (the output's end is near) lacks window rows: skip the update.
            if logits.shape[0] == 1 + self.guesses + self.window.size:
                rows = to_device(self.window.top_rows(0, 1 + self.guesses), logits.device)
                new = logits[rows, : self.vocab_size or None].argmax(dim=-1)  # ids the target has (0: all)
                grams = self.window.update(new)
                if grams is not None:
                    self.deferred.put(self.pool, *grams)

    def report(self) -> dict:
        return {"pool_tuples": len(self.pool), "pool_keys": self.pool.rows}

    def _warm_up(self) -> None:
        # Compile (or load the numba cache) now, not inside the first timed step.
        scratch = NgramPool(self.pool.n, max(self.pool.capacity, 1), 8)
        scratch.learn_text(np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32))
        guess_trie(scratch, 1, 2)
