"""Batched lossless speculative decoding with continuous refill.

Up to `batch_size` records are in flight, each with its own drafter instance, in the slots of one
`BatchedTarget`. Each step:

    1) propose  every row's drafter proposes a tree for its pending token, with per-node path
                acceptance estimates (`propose_scored`, else `TreeCalibration`)
    2) budget   one width for the step (decode/budget.py): each row keeps a prefix of its tree
    3) verify   one target forward over every row's block, padded to the widest
    4) accept   the target's choice at every real input (argmax or one draw each), moved to the
                host in the step's only synchronization; each row walks its own tree
    5) commit   the accepted paths are kept with one gather; tokens emitted per row
    6) observe  each drafter sees its committed tokens and its own inputs' logits
    7) refill   finished rows leave (results go out at once); the queue's next records are
                prefilled together in one forward into the free slots, the rest packed down

Every record's output is what `decode.loop.generate` gives it alone: greedy equals plain greedy
decoding token for token (up to floating-point summation order, which a batch of other rows
changes as a wider verify does), and with sampling each row keeps the loop's one-draw-per-node
rule, so it follows the model's distribution. In half precision (float16, bfloat16) a row's logits
differ from its batch-1 logits by rounding that depends on the batch's shape, so a greedy output
may part from batch-1's at a near-tie, as a wider verify block already makes it at batch 1;
acceptance stays exact with respect to the logits each step computes. Drafters that need more than ids and logits
(draft models, EAGLE heads, SDSAT, a drafter's own acceptance rule) run at batch size 1 only.

A bad record (empty, longer than the context) gets an "error" result and never stalls the batch.
An out-of-memory in a forward halves the batch size, puts the rows it drops back at the head of
the queue (they restart; nothing of theirs was emitted yet) and goes on. Runs eagerly (no CUDA
graphs).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from samctl.decode.budget import TreeCalibration, choose_width
from samctl.decode.drafters.base import Drafter
from samctl.decode.engine.batched import BatchedTarget, measure_batch_cost
from samctl.decode.engine.transfer import to_device
from samctl.decode.loop import GenerationConfig, _make_generator, _Output
from samctl.decode.methods import REGISTRY, method as method_entry
from samctl.decode.metrics import Metrics
from samctl.decode.sampling import choose_tokens
from samctl.decode.tree import DraftTree, walk_tree
from samctl.index.errors import UserError

BATCH_ONE = "runs at batch size 1 only"


def batch_refusal(name: str) -> str:
    """Why method `name` has no batched form ("" when it has one)."""
    entry = method_entry(name)
    if entry.needs_draft:
        why = "its drafts come from a draft model"
    elif entry.needs_eagle:
        why = "its drafts come from an EAGLE head over the target's hidden states"
    elif entry.needs_sat_model:
        why = "it drafts with the target's own forward at SAT tokens"
    else:
        return ""
    return f"method {name} {BATCH_ONE} ({why}): use batch size 1 or another method"


def require_batchable(name: str) -> None:
    reason = batch_refusal(name)
    if reason:
        raise UserError(reason)


def _check_drafter(drafter: Drafter) -> None:
    name = drafter.name
    if name in REGISTRY:
        require_batchable(name)
    if drafter.needs_hidden or drafter.accept is not None:
        raise UserError(f"method {name} {BATCH_ONE} (it reads the target's hidden states or has its own "
                        "acceptance rule): use batch size 1 or another method")


@dataclass
class BatchResult:
    index: int  # the record's position in the input
    tokens: list[int]  # new tokens, EOS included when generation stopped on it
    finish_reason: str  # "eos" | "length" | "error"
    metrics: Metrics
    error: str = ""  # what was wrong with the record, for "error"


@dataclass
class BatchStats:
    """The whole run: every step's forward beside the host work around it."""

    batch_size: int = 0  # at the end (an out-of-memory halves it)
    steps: int = 0
    rows_per_step: list[int] = field(default_factory=list)
    width_per_step: list[int] = field(default_factory=list)  # draft nodes per row allowed (w*)
    forward_s: float = 0.0  # verify forwards
    host_s: float = 0.0  # everything else in the steps: drafting, budget, accept, commit, observe
    prefill_s: float = 0.0
    prefills: int = 0
    new_tokens: int = 0
    records: int = 0
    time_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. the batch size halved

    def to_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "batch_size": self.batch_size, "steps": self.steps, "records": self.records,
            "new_tokens": self.new_tokens, "time_s": round(self.time_s, 4),
            "tokens_per_s": round(self.new_tokens / self.time_s, 3) if self.time_s else 0.0,
            "records_per_hour": round(3600 * self.records / self.time_s, 1) if self.time_s else 0.0,
            "forward_ms_per_step": round(1e3 * self.forward_s / steps, 3),
            "host_ms_per_step": round(1e3 * self.host_s / steps, 3),
            "prefill_s": round(self.prefill_s, 4), "prefills": self.prefills,
            "mean_rows": round(float(np.mean(self.rows_per_step)), 2) if self.rows_per_step else 0.0,
            "mean_width": round(float(np.mean(self.width_per_step)), 3) if self.width_per_step else 0.0,
            "notes": list(self.notes),
        }


class _Row:
    """One record in flight: its drafter, its output so far, its pending token."""

    def __init__(self, index: int, prompt: np.ndarray, drafter: Drafter, config: GenerationConfig) -> None:
        self.index, self.prompt, self.drafter = index, prompt, drafter
        self.out = _Output(config, None)
        self.metrics = Metrics()
        self.t0 = -1
        self.started = time.perf_counter()
        self.scored = False  # the drafter scored this step's draft itself (`propose_scored`)
        # this step's draft: tree, path probabilities, whether it is a prefix of the proposal
        self.tree: DraftTree = DraftTree.empty()
        self.probs = np.zeros(0)
        self.prefix = True


class _OutOfMemory(Exception):
    pass


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


def stream_batch(
    model: torch.nn.Module,
    make_drafter: Callable[[], Drafter],
    prompts: Iterable[Sequence[int]],
    config: GenerationConfig,
    batch_size: int = 8,
    *,
    cost_ms: np.ndarray | None = None,
    max_width: int = 16,
    max_prefill_tokens: int = 8192,
    stats: BatchStats | None = None,
) -> Iterator[BatchResult]:
    """Generate for every prompt (host token ids) with up to `batch_size` in flight; yields each
    record's result as soon as it finishes (`index` says which). `make_drafter()` builds one drafter
    per slot (reused for the slot's later records, like batch-1 reuses one). `cost_ms`: [n] ms of a
    batched forward over 1..n total input tokens (`measure_batch_cost`; measured here when None);
    `max_width`: most draft nodes a row verifies per step; `max_prefill_tokens`: newcomers are
    prefilled together while their padded block stays within it. `stats` is filled if given."""
    stats = stats if stats is not None else BatchStats()
    start = time.perf_counter()
    records = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if batch_size < 1 or max_width < 0:
        raise UserError(f"batch size must be >= 1 (got {batch_size}) and the draft width >= 0 (got {max_width})")
    pending: deque[int] = deque()
    max_positions = BatchedTarget(model, 1, 2).max_positions  # cheap: the cache allocates lazily
    for i, prompt in enumerate(records):
        error = _record_error(prompt, max_positions)
        if error:
            stats.records += 1
            yield BatchResult(i, [], "error", Metrics(), error)
        else:
            pending.append(i)
    if not pending:
        stats.time_s = time.perf_counter() - start
        return
    longest = max(len(records[i]) for i in pending)
    capacity = longest + config.max_new_tokens + max_width + 2
    rows = min(batch_size, len(pending))
    target = BatchedTarget(model, rows, capacity)
    drafters = [make_drafter() for _ in range(rows)]
    _check_drafter(drafters[0])
    if cost_ms is None:
        cost_ms = measure_batch_cost(model, rows, max(1, min(max_width, 8)))
    generator = _make_generator(config.sampling, target.device)
    calibration = TreeCalibration()
    active: list[_Row] = []
    stats.batch_size = rows

    while pending or active:
        # 7) refill: newcomers take the free slots, prefilled in batched forwards
        try:
            _admit(target, active, drafters, pending, records, config, generator, max_prefill_tokens, stats)
        except _OutOfMemory:
            _halve(target, active, drafters, pending, stats)
            continue
        for row in [r for r in active if r.out.done]:  # a newcomer may finish on its first token
            yield _retire(target, active, drafters, row, stats)
        if not active:
            continue
        try:
            finished = _step(target, active, config, generator, calibration, cost_ms, max_width, stats)
        except _OutOfMemory:
            _halve(target, active, drafters, pending, stats)
            continue
        for row in finished:
            yield _retire(target, active, drafters, row, stats)
    stats.time_s = time.perf_counter() - start


def generate_batch(
    model: torch.nn.Module,
    make_drafter: Callable[[], Drafter],
    prompts: Iterable[Sequence[int]],
    config: GenerationConfig,
    batch_size: int = 8,
    on_result: Callable[[BatchResult], None] | None = None,
    **options,
) -> list[BatchResult]:
    """`stream_batch`, collected in input order; `on_result` sees each result as it finishes."""
    results: dict[int, BatchResult] = {}
    for result in stream_batch(model, make_drafter, prompts, config, batch_size, **options):
        results[result.index] = result
        if on_result is not None:
            on_result(result)
    return [results[i] for i in sorted(results)]


def _record_error(prompt: np.ndarray, max_positions: int) -> str:
    if len(prompt) == 0:
        return "the prompt is empty: give at least one token of text"
    if len(prompt) + 1 > max_positions:
        return f"prompt is {len(prompt)} tokens, the model's context is {max_positions}: shorten the prompt"
    return ""


# -- the step -----------------------------------------------------------------------------------


def _step(target: BatchedTarget, active: list[_Row], config: GenerationConfig, generator: torch.Generator | None,
          calibration: TreeCalibration, cost_ms: np.ndarray, max_width: int, stats: BatchStats) -> list[_Row]:
    # -> the rows that finished this step. Row b of `active` is slot b of the cache.
    tic = time.perf_counter()
    # 1) propose: each row's tree and its nodes' path probabilities
    fixed = 0  # widest tree that cannot be cut (context rows: lookahead's window)
    for b, row in enumerate(active):
        t_draft = time.perf_counter()
        room = min(row.out.remaining - 1, target.max_positions - int(target.lengths[b]) - 1)
        _propose(row, calibration, max(room, 0))
        if row.tree.accept_limit is not None:
            fixed = max(fixed, len(row.tree))
        row.metrics.draft_s += time.perf_counter() - t_draft
    # 2) budget: one width for the step, each row keeps a prefix of its tree
    width = choose_width([r.probs for r in active], cost_ms, max_width, fixed)
    for row in active:
        if row.tree.accept_limit is None and len(row.tree) > width:
            row.tree = _prefix(row.tree, width)
            if row.prefix:
                row.drafter.keep_first(width)
    trees = [r.tree for r in active]
    inputs = [_verify_input(r.t0, r.tree, target.device) for r in active]

    # 3) verify
    t_forward = time.perf_counter()
    try:
        logits, offsets = target.verify(inputs, trees)
    except (RuntimeError, torch.OutOfMemoryError) as err:
        if _is_oom(err) and target.rows > 1:
            raise _OutOfMemory() from err
        raise
    forward_s = time.perf_counter() - t_forward

    # 4) accept: one draw (or argmax) per real input, all rows, one host sync
    flat = torch.cat(inputs)
    choices = choose_tokens(logits, config.sampling, generator)
    host = torch.stack((flat, choices)).cpu().numpy()  # the step's one host sync
    paths = []
    for b, tree in enumerate(trees):
        ids, chosen = host[0, offsets[b]: offsets[b + 1]], host[1, offsets[b]: offsets[b + 1]]
        paths.append(walk_tree(tree.parents, ids[1:], chosen, tree.drafts))

    # 5) commit
    target.keep(paths)
    finished = []
    for b, (row, tree, path) in enumerate(zip(active, trees, paths)):
        ids = host[0, offsets[b]: offsets[b + 1]]
        committed = ids[path]
        bonus = int(host[1, offsets[b] + path[-1]])
        before = len(row.out.tokens)
        row.out.emit([int(t) for t in committed[1:]] + [bonus])
        row.metrics.record_step(drafted=tree.drafts, accepted=min(len(path) - 1, len(row.out.tokens) - before))
        row.metrics.verify_s += forward_s
        if not row.scored:
            calibration.learn(tree.parents, tree.drafts, path)
        row.t0 = bonus
        # 6) observe
        t_draft = time.perf_counter()
        if row.out.done or target.lengths[b] + 1 >= target.max_positions:
            finished.append(row)
        else:
            row.drafter.observe(committed, flat[offsets[b]: offsets[b + 1]], logits[offsets[b]: offsets[b + 1]])
        row.metrics.record_draft(time.perf_counter() - t_draft)
    stats.steps += 1
    stats.rows_per_step.append(len(active))
    stats.width_per_step.append(width)
    stats.forward_s += forward_s
    stats.host_s += time.perf_counter() - tic - forward_s
    return finished


def _propose(row: _Row, calibration: TreeCalibration, room: int) -> None:
    # Sets row.tree, row.probs (path probabilities, prefix-closed order) and row.prefix (whether
    # the tree is a prefix of the drafter's proposal, so `keep_first` may be told its length).
    tree, probs = row.drafter.propose_scored(row.t0)
    row.scored = probs is not None
    if probs is None:
        if tree.q is not None:
            raise UserError(f"method {row.drafter.name} {BATCH_ONE} (its drafts carry draft "
                            "probabilities): use batch size 1 or another method")
        probs = calibration.score(tree.parents)
    row.prefix = True
    if len(tree):
        depth = tree.depths()
        if depth.max() > room:  # drafts deeper than the tokens still wanted, or the context, are waste
            keep = np.flatnonzero(depth <= room)
            row.prefix = bool(len(keep) == 0 or keep[-1] == len(keep) - 1)
            tree, probs = tree.limit_depth(room), probs[keep]
    if tree.accept_limit is not None:
        probs = probs[: tree.accept_limit]
    row.tree, row.probs = tree, probs


def _prefix(tree: DraftTree, k: int) -> DraftTree:
    """The first k nodes of `tree` (a tree again: parents come before their children)."""
    if tree.is_chain:
        return DraftTree.chain(tree.tokens[:k])
    return DraftTree(tokens=tree.tokens[:k], parents=tree.parents[:k])


def _verify_input(t0: int, tree: DraftTree, device: torch.device) -> torch.Tensor:
    # -> [1 + m] int64 on device: the pending token then the draft nodes (placeholders -1)
    tokens = tree.tokens
    if isinstance(tokens, torch.Tensor):
        ids = torch.empty(len(tree) + 1, dtype=torch.int64, device=device)
        ids[0] = t0
        ids[1:] = tokens
        return ids
    ids = np.empty(len(tree) + 1, dtype=np.int64)
    ids[0] = t0
    ids[1:] = tokens
    return to_device(ids, device)


# -- admission, retirement, out-of-memory --------------------------------------------------------


def _admit(target: BatchedTarget, active: list[_Row], drafters: list[Drafter], pending: deque[int],
           records: list[np.ndarray], config: GenerationConfig, generator: torch.Generator | None,
           max_prefill_tokens: int, stats: BatchStats) -> None:
    # Fills slots len(active).. from the queue. The records that fit are taken in queue order,
    # then prefilled shortest first in groups of similar length (the longest at most 1.5x the
    # shortest) whose padded block [k, longest] stays within max_prefill_tokens (at least one per
    # group): padding costs forward time like real tokens. While other rows are decoding, one
    # group per step, so a wave of newcomers delays them by one prefill; the rest go back to the
    # head of the queue.
    decoding = bool(active)
    while pending and len(active) < target.rows:
        wave = sorted((pending.popleft() for _ in range(min(len(pending), target.rows - len(active)))),
                      key=lambda i: len(records[i]))
        group: list[int] = []
        for i in wave:
            n = len(records[i])
            if group and (n * (len(group) + 1) > max_prefill_tokens or n > 1.5 * len(records[group[0]])):
                break
            group.append(i)
        pending.extendleft(reversed(wave[len(group):]))
        slots = list(range(len(active), len(active) + len(group)))
        newcomers = [_Row(i, records[i], drafters[s], config) for i, s in zip(group, slots)]
        wants_all = [r.drafter.prefill_logits == "all" for r in newcomers]
        tic = time.perf_counter()
        try:
            logits = target.prefill(slots, [r.prompt for r in newcomers], wants_all)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if _is_oom(err) and target.rows > 1:
                pending.extendleft(reversed(group))
                raise _OutOfMemory() from err
            raise
        last = torch.stack([lg[-1] for lg in logits])  # [k, V]
        firsts = choose_tokens(last, config.sampling, generator).cpu().numpy()  # the prefill's one sync
        elapsed = time.perf_counter() - tic
        stats.prefill_s += elapsed
        stats.prefills += 1
        for row, lg, t0 in zip(newcomers, logits, firsts):
            row.metrics.prefill_s = elapsed
            t_draft = time.perf_counter()
            row.drafter.start(row.prompt, lg)
            row.metrics.draft_s += time.perf_counter() - t_draft
            row.t0 = int(t0)
            row.out.emit([row.t0])
            active.append(row)
        if decoding:
            return


def _retire(target: BatchedTarget, active: list[_Row], drafters: list[Drafter], row: _Row,
            stats: BatchStats) -> BatchResult:
    # Takes `row` out of slot b; the last row moves into the hole so rows stay packed in [0, A).
    b = active.index(row)
    last = len(active) - 1
    if b != last:
        target.move_row(last, b)
        active[b] = active[last]
        drafters[b], drafters[last] = drafters[last], drafters[b]
    else:
        target.lengths[b] = 0
    active.pop()
    if not row.out.done:
        row.out.finish_reason = "length"  # the model's context is full
    row.drafter.finish(np.asarray(row.out.tokens, dtype=np.int64))
    row.metrics.new_tokens = len(row.out.tokens)
    row.metrics.time_s = time.perf_counter() - row.started
    stats.records += 1
    stats.new_tokens += len(row.out.tokens)
    return BatchResult(row.index, row.out.tokens, row.out.finish_reason, row.metrics)


def _halve(target: BatchedTarget, active: list[_Row], drafters: list[Drafter], pending: deque[int],
           stats: BatchStats) -> None:
    # Out of memory: rows in slots >= half go back to the head of the queue, in input order, and
    # restart later (nothing of theirs was emitted); the cache keeps the first half.
    before = target.rows
    half = max(1, before // 2)
    dropped = active[half:]
    del active[half:]
    pending.extendleft(sorted((r.index for r in dropped), reverse=True))
    target.shrink(half)
    del drafters[half:]
    stats.batch_size = half
    stats.notes.append(f"out of memory at batch size {before}: continuing at {half}")
