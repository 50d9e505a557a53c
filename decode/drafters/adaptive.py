"""`adaptive`, samctl's default drafter: every retrieval source, scored, sized by the verify cost.

Sources, each matched on t0 without mutation: the dynamic automaton (this request's prediction,
prompt and output), the static datastore (--sam: automaton, suffix array, sharded store or n-gram
table), the memory (an automaton over earlier requests' outputs, FIFO by request) and Token
Recycle's successor table (engine only: it learns from the target's logits). Each proposes a
best-first tree, the automata also from shorter suffixes of their match, priced by calibrated
edge estimates (candidates.py); the trees merge into one trie cut to the nodes that maximise
expected tokens per unit of verify time. `observe` updates the calibration, the cursors, the
dynamic automaton and the table; `finish` adds the output to the memory.

Knows token ids and a relative cost curve, not models or files; the memory's persistence is
`memory_documents` / `load_memory`, written to disk by the caller.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from samctl.decode.budget import path_probs
from samctl.decode.engine.cost import VerifyCost
from samctl.decode.drafters.candidates import (N_CELLS, SOURCES, learn, ngram_candidates, prediction_positions,
                                               prior_means, propose_tree, sa_candidates)
from samctl.decode.metrics import PredictionUsage
from samctl.decode.drafters.base import Drafter
from samctl.decode.drafters.lookahead import DeferredPool
from samctl.decode.drafters.recycle import learn_rows
from samctl.decode.tree import DraftTree, kept_parents, tree_depths
from samctl.index.automaton import SuffixAutomaton
from samctl.index.cursor import AutomatonCursor, NgramCursor, ShardedSuffixArrayCursor, SuffixArrayCursor, cursor
from samctl.decode.configs import AdaptiveConfig

if TYPE_CHECKING:
    from samctl.index.cursor import Structure


class Calibration:
    """Per-cell acceptance evidence: mean = (hits + w * prior) / (trials + w)."""

    def __init__(self, config: AdaptiveConfig) -> None:
        self.prior = prior_means()
        self.weight = config.prior_weight
        self.max_trials = config.max_trials
        self.hits = np.zeros(N_CELLS, dtype=np.float64)
        self.trials = np.zeros(N_CELLS, dtype=np.float64)
        self.means = self.prior.copy()

    def update(self, tokens: np.ndarray, parents: np.ndarray, cells: np.ndarray, accepted: np.ndarray) -> None:
        learn(tokens, parents, cells, accepted, self.hits, self.trials, self.prior, self.means, self.weight,
              self.max_trials)

    def table(self) -> dict[str, dict[str, float]]:
        """Observed acceptance per source (trials and rate), for reports."""
        per = len(self.trials) // len(SOURCES)
        out = {}
        for i, name in enumerate(SOURCES):
            t, h = self.trials[i * per:(i + 1) * per].sum(), self.hits[i * per:(i + 1) * per].sum()
            out[name] = {"trials": round(float(t), 1), "rate": round(float(h / t), 4) if t else 0.0}
        return out


class Memory:
    """Outputs of earlier requests in one automaton, FIFO by request. An automaton cannot forget,
    so it is rebuilt from the newest requests once it holds a quarter more than the limits."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.documents: deque[np.ndarray] = deque()
        self.tokens = 0
        self.automaton = SuffixAutomaton.empty(1024)
        self.held = 0  # documents in the automaton, evicted ones included
        self.version = 0  # changes so far: a cursor made before the last one must match again

    def add(self, document: np.ndarray) -> None:
        if self.max_requests == 0 or len(document) == 0:
            return
        document = np.asarray(document, dtype=np.int32)
        self.documents.append(document)
        self.tokens += len(document)
        self.automaton.extend(document)
        self.automaton.end_document()
        self.held += 1
        self.version += 1
        while len(self.documents) > self.max_requests or self.tokens > self.max_tokens:
            self.tokens -= len(self.documents.popleft())
        if self.held > 1.25 * self.max_requests or self.automaton.num_tokens > 1.25 * self.max_tokens + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        self.automaton = SuffixAutomaton.empty(max(1024, self.tokens + len(self.documents)))
        for doc in self.documents:
            self.automaton.extend(doc)
            self.automaton.end_document()
        self.held = len(self.documents)

    def __len__(self) -> int:
        return len(self.documents)


class _Recycle:
    """Token Recycle's successor table on the host ([V, k] int32, -1 = unknown). On a GPU the
    verified logits' top-k reach it one step late (`DeferredPool`), so learning adds no host sync."""

    def __init__(self, vocab_size: int, k: int, device: torch.device) -> None:
        k = min(k, vocab_size)
        self.table = np.full((vocab_size, k), -1, dtype=np.int32)
        self.vocab_size, self.k, self.device = vocab_size, k, torch.device(device)
        self.deferred = DeferredPool(self.device)

    def learn(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        # ids: [q] int64 (placeholders < 0), logits: [q, V] on the model's device
        if self.device.type == "cpu":
            learn_rows(self.table, ids.numpy(), logits)
            return
        self.deferred.put(self, ids, torch.topk(logits[:, : self.vocab_size], self.k, dim=-1).indices)

    def insert(self, ids: np.ndarray, successors: np.ndarray) -> None:
        # what `deferred` delivers, one step late: ids [q] and their successors [q, k]
        ok = (ids >= 0) & (ids < self.vocab_size)
        self.table[ids[ok]] = successors[ok]


class PredictionCount:
    """Which positions of one request's prediction were drafted and which accepted
    (decode.metrics.PredictionUsage defines the counts)."""

    def __init__(self, n: int) -> None:
        self.drafted = np.zeros(n, dtype=bool)
        self.accepted = np.zeros(n, dtype=bool)

    def add(self, positions: np.ndarray, tokens: np.ndarray, parents: np.ndarray, accepted: np.ndarray) -> None:
        # positions: [m] int32 per draft node (-1: not from the prediction); accepted: the draft
        # tokens the step committed, in order along one path of the tree
        self.drafted[positions[positions >= 0]] = True
        node = -1
        for token in accepted:
            children = np.flatnonzero((parents == node) & (tokens == token))
            if not len(children):
                return
            node = int(children[0])
            if positions[node] >= 0:
                self.accepted[positions[node]] = True

    def usage(self) -> PredictionUsage:
        accepted = int(self.accepted.sum())
        return PredictionUsage(len(self.accepted), accepted, int((self.drafted & ~self.accepted).sum()))


class AdaptiveDrafter(Drafter):
    name = "adaptive"
    prefill_logits = "last"  # Token Recycle learns from decode steps only, never the prompt
    keeps_memory = True

    def __init__(self, config: AdaptiveConfig = AdaptiveConfig(), static: "Structure | None" = None,
                 cost: VerifyCost | np.ndarray | None = None, vocab_size: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.cost = VerifyCost.fixed(cost)  # priced at the row's context: prompt + output so far
        self.calibration = Calibration(config)
        self.static = cursor(static) if static is not None else None
        # An automaton's candidates come from the one compiled step (propose_tree); an n-gram
        # table's and a suffix array's from their own kernel, into the buffer first.
        self._static_buffered = _BUFFERED.get(type(self.static))
        self._static_automaton = self.static is not None and self._static_buffered is None
        self.memory = Memory(config.memory, config.memory_tokens)
        self.memory_pointer, self._memory_seen = AutomatonCursor(self.memory.automaton), -1  # Memory.version
        self.recycle = _Recycle(vocab_size, config.recycle_k, device) if config.recycle and vocab_size > 0 else None
        self.dynamic = SuffixAutomaton.empty(1024)
        self.dyn_state, self.dyn_length = 0, 0
        self.output: list[np.ndarray] = []
        self.prediction: np.ndarray | None = None
        self.prediction_count: PredictionCount | None = None  # the current request's, when it has a prediction
        self._observed = 0  # output tokens the steps so far committed (the last step's are seen by `finish`)
        self._prompt_length = 0
        self._uncounted = False  # the last proposed tree is not in prediction_count yet
        self.last = (np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32))
        # Each source proposes its best nodes up to this many; `select` keeps the best of all.
        self._budget = max(1, min(config.max_nodes, 48))
        capacity = 4 * (config.max_nodes + 8)
        # the candidate buffer: tok, par (int32), prob (float64), cell (int32); see candidates.py
        self._buffer = (np.empty(capacity, dtype=np.int32), np.empty(capacity, dtype=np.int32),
                        np.empty(capacity, dtype=np.float64), np.empty(capacity, dtype=np.int32))
        self._settings = np.array([config.levels, config.width, self._budget, config.min_prob, config.max_nodes,
                                   config.static_min_length, config.static_levels, min(self._budget, 16)],
                                  dtype=np.float64)
        self._no_table = np.full((1, 1), -1, dtype=np.int32)
        self._flat_cost = np.ones(config.max_nodes + 1, dtype=np.float64)  # keeps every node (batched engine)
        self._warm_up()

    # -- requests ----------------------------------------------------------------------------

    def expect(self, prediction: np.ndarray | list[int] | None) -> None:
        self.prediction = None if prediction is None else np.asarray(prediction, dtype=np.int32)

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        self.output = []
        prompt = np.asarray(prompt, dtype=np.int32)
        size = len(prompt) + (0 if self.prediction is None else len(self.prediction))
        self.dynamic = SuffixAutomaton.empty(max(1024, 2 * size))
        self.prediction_count = None
        if self.prediction is not None and len(self.prediction):
            self.dynamic.extend(self.prediction)
            self.dynamic.end_document()
            self.prediction_count = PredictionCount(len(self.prediction))
        self.prediction = None
        self._observed, self._uncounted, self._prompt_length = 0, False, len(prompt)
        self.dyn_state, self.dyn_length = self.dynamic.extend_tracking(prompt, 0, 0)
        if self.static is not None:
            self.static.reset(prompt[-256:])
        self._memory_seen = -1  # the first proposal matches the prompt
        self.last = (np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32))

    def finish(self, output: np.ndarray) -> None:
        output = np.asarray(output, dtype=np.int32)
        if self._uncounted and self._observed < len(output):  # the last step, which had no `observe`
            self._count_prediction(int(output[self._observed]), output[self._observed + 1:])
        if self.remember:
            self.memory.add(output)
        self.output = []

    def prediction_usage(self) -> PredictionUsage | None:
        return None if self.prediction_count is None else self.prediction_count.usage()

    # -- steps -------------------------------------------------------------------------------

    def propose(self, t0: int) -> DraftTree:
        return self._propose(t0, self.cost.at(self._prompt_length + self._observed))

    def propose_scored(self, t0: int) -> tuple[DraftTree, np.ndarray]:
        # every node above min_prob (at most max_nodes), uncut by this drafter's cost curve: the
        # batched engine sizes drafts across rows itself
        tree = self._propose(t0, self._flat_cost)
        _, parents, cells = self.last
        return tree, path_probs(parents, self.calibration.means[cells])

    def keep_first(self, k: int) -> None:
        tokens, parents, cells = self.last
        self.last = (tokens[:k], parents[:k], cells[:k])

    def keep_depth(self, max_depth: int) -> None:
        # a node never verified was not rejected, and a deeper node must not take the step's
        # bonus token for an accepted draft
        tokens, parents, cells = self.last
        keep = np.flatnonzero(tree_depths(parents) <= max_depth)
        if len(keep) == len(parents):
            return
        self.last = (tokens[keep], kept_parents(parents, keep), cells[keep])  # a kept node's parent is shallower

    def _propose(self, t0: int, cost: np.ndarray) -> DraftTree:
        # One kernel call for the automata, Token Recycle and the selection (an n-gram store's
        # candidates go into the buffer first).
        n = self._first_candidates(t0)
        dyn = self.dynamic.kernel_arrays
        static = self.static.before(t0) if self._static_automaton else (dyn.states, dyn.edges, dyn.slots, 0, 0)
        memory = self._memory_before(t0) if len(self.memory) else (dyn.states, dyn.edges, dyn.slots, 0, 0)
        table = self.recycle.table if self.recycle is not None else self._no_table
        tokens, parents, cells, is_chain = propose_tree(
            dyn.states, dyn.edges, dyn.slots, self.dyn_state, self.dyn_length,
            *static, self._static_automaton, *memory, len(self.memory) > 0, table, self.recycle is not None, t0, self.calibration.means, cost,
            self._settings, *self._buffer, n)
        self.last = (tokens, parents, cells)
        self._uncounted = self.prediction_count is not None
        return DraftTree(tokens=tokens, parents=parents, is_chain=is_chain)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        committed = np.asarray(committed, dtype=np.int32)
        tokens, parents, cells = self.last
        if len(tokens):
            self.calibration.update(tokens, parents, cells, committed[1:])
        if self._uncounted:
            self._count_prediction(int(committed[0]), committed[1:])
        self._observed += len(committed)
        self.output.append(committed)
        self.dyn_state, self.dyn_length = self.dynamic.extend_tracking(committed, self.dyn_state, self.dyn_length)
        if self.static is not None:
            self.static.advance(committed)
        if len(self.memory):
            self.memory_pointer.advance(committed)
        if self.recycle is not None and logits is not None:
            self.recycle.learn(input_ids, logits)

    # -- memory persistence ------------------------------------------------------------------

    def memory_documents(self) -> list[np.ndarray]:
        """The remembered outputs, oldest first, the current request's included."""
        docs = list(self.memory.documents)
        if self.output:
            docs.append(np.concatenate(self.output))
        return docs

    def load_memory(self, documents: list[np.ndarray]) -> None:
        for doc in documents:
            self.memory.add(doc)

    def share_memory(self, other: Drafter) -> bool:
        if not isinstance(other, AdaptiveDrafter):
            return False
        self.memory, self._memory_seen = other.memory, -1
        return True

    def report(self) -> dict:
        return {"calibration": self.calibration.table(), "memory_requests": len(self.memory)}

    # -- helpers -----------------------------------------------------------------------------

    def _memory_before(self, t0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        # A shared memory may have grown since the pointer matched (another row ended), moving the match
        # to another state (a split clones it): match the text again (the dynamic automaton's tail).
        if self._memory_seen != self.memory.version:
            self.memory_pointer = AutomatonCursor(self.memory.automaton)
            self.memory_pointer.reset(self.dynamic.tokens[-256:])
            self._memory_seen = self.memory.version
        return self.memory_pointer.before(t0)

    def _count_prediction(self, t0: int, accepted: np.ndarray) -> None:
        # Before the dynamic automaton grows over this step: its match is still the one the
        # tree was proposed from.
        tokens, parents, _ = self.last
        self._uncounted = False
        if len(tokens):
            dyn = self.dynamic.kernel_arrays
            positions = prediction_positions(dyn.states, dyn.edges, dyn.slots, self.dyn_state, self.dyn_length, t0,
                                             tokens, parents, len(self.prediction_count.accepted))
            self.prediction_count.add(positions, tokens, parents, accepted)

    def _first_candidates(self, t0: int) -> int:
        # Rows the buffer holds before the automata's: an n-gram store's (a subclass may add its
        # own, e.g. adaptive+eagle's head tree). -> the row count.
        return self._static_buffered(self, t0) if self._static_buffered is not None else 0

    def _ngram_candidates(self, t0: int) -> int:
        cfg = self.config
        return ngram_candidates(self.static.arrays, self.static.context(t0), self.calibration.means, 1, self._budget,
                                cfg.width, cfg.min_prob, *self._buffer, 0)

    def _sa_candidates(self, t0: int) -> int:
        cfg = self.config
        handle = self.static.peek(t0)[1]  # the step over t0 is not searched again by observe
        return sa_candidates(*self.static.at(handle), self.calibration.means, cfg.static_min_length,
                             self._budget, cfg.width, cfg.min_prob, *self._buffer, 0)

    def _warm_up(self) -> None:
        # Compile (or load the numba cache) now, not inside the first timed step.
        self.expect(np.array([2, 1], dtype=np.int32))  # the prediction's counting kernel too
        self.start(np.array([1, 2, 1], dtype=np.int64), None)
        self.observe(np.array([2], dtype=np.int64), None, None)
        self.propose(1)
        self.observe(np.array([1], dtype=np.int64), None, None)
        self.start(np.array([1], dtype=np.int64), None)
        self.output = []
        self.memory = Memory(self.config.memory, self.config.memory_tokens)
        self.calibration = Calibration(self.config)


# stores whose candidates enter the buffer through their own kernel, by cursor type
_BUFFERED = {NgramCursor: AdaptiveDrafter._ngram_candidates, SuffixArrayCursor: AdaptiveDrafter._sa_candidates,
             ShardedSuffixArrayCursor: AdaptiveDrafter._sa_candidates}
