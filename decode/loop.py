"""The decode loop: one engine for every method, one record or thousands.

Up to `batch_size` records are in flight, each with its own drafter instance, in the rows of one
`BatchedTarget` (decode/engine/batched.py); batch 1 is one row. `BatchRun` is the one step loop:
records are submitted to its queue at any time (a JSONL batch all at once, a server as requests
arrive, `generate` one record), each with its own generation length, sampling, prediction and
token callback, and each step runs:

    1) propose  every row's drafter proposes a tree rooted at its pending token t0, with per-node
                path acceptance estimates (`propose_scored`, else `TreeCalibration`)
    2) budget   one width for the step (decode/budget.py): each row keeps a prefix of its tree
                (off for `generate`: one record's drafter sizes its own drafts)
    3) verify   one target forward over every row's block, padded to the widest, tree masks inside
    4) accept   the target's choice at every real input (argmax or one draw each), moved to the
                host in the step's only synchronization; each row walks its own tree
                (`decode.accept.batch_accept`)
    5) commit   the accepted paths are kept with one gather; tokens emitted per row, stopping at
                EOS, max_new_tokens or a stop the token callback reports
    6) observe  each drafter sees its committed tokens and its own inputs' logits (and, for a
                drafter with `needs_hidden`, the target's last hidden state at each committed
                position, from the same verify forward)
    7) refill   finished and cancelled rows leave (results go out at once); the queue's next
                records are prefilled together into the free slots, the rest packed down

Greedy output equals plain greedy decoding token for token, up to floating-point summation order,
which a batch of other rows changes as a wider verify does (in half precision a greedy output may
part from batch-1's at a near-tie; acceptance stays exact for the logits each step computes). With
sampling, one draw per node shared by every path through it keeps each row's output distribution
exactly the target's (`decode.accept`), each row with its own sampling and generator. SDSAT drafts
with the target's own forward, so it runs as a one-row batch.

A bad record gets an "error" result and never stalls the batch. An out-of-memory in a forward
halves the batch size and puts the dropped rows back at the head of the queue, except rows whose
tokens already streamed out through `on_tokens`, which end with an "error" result. On CUDA with
`graphs`, every verify replays a graph captured when the run starts (decode/engine/graphs.py).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from samctl.decode.accept import batch_accept, choose_rows, speculative_accept
from samctl.decode.budget import TreeCalibration, choose_width
from samctl.decode.drafters.base import Drafter
from samctl.decode.engine.batched import BatchedTarget, verify_input
from samctl.decode.engine.cost import VerifyCost, measure_batch_cost
from samctl.decode.engine.graphs import enable_batch_graphs
from samctl.decode.engine.target import VERIFY_SLACK, TargetModel, room
from samctl.decode.engine.transfer import to_device
from samctl.decode.methods import REGISTRY, method as method_entry
from samctl.decode.metrics import Metrics, PredictionUsage
from samctl.decode.sampling import SamplingConfig
from samctl.decode.tree import DraftTree
from samctl.index.errors import ConfigError, UserError


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("{max_new_tokens} must be >= 1, got {value}", value=self.max_new_tokens)


@dataclass
class GenerationResult:
    """One record's answer, from `generate` and from a batch alike."""

    tokens: list[int]  # new tokens only, EOS included when generation stopped on it
    finish_reason: str  # "eos" | "length" | "stop" (on_tokens asked) | "cancelled" | "error"
    metrics: Metrics
    prediction: PredictionUsage | None = None  # when the record had a prediction and its drafter counts it
    index: Any = None  # the record's key in a batch: its position in the input for stream_batch
    error: str = ""  # what was wrong with the record, for "error"


class _Output:
    """Collects emitted tokens, cutting at the first EOS, exactly at max_new_tokens, and where
    on_tokens says a stop string ended the answer."""

    def __init__(self, config: GenerationConfig, on_tokens: Callable[[list[int]], bool | None] | None) -> None:
        self.tokens: list[int] = []
        self.limit = config.max_new_tokens
        self.eos = set(config.eos_token_ids)
        self.on_tokens = on_tokens
        self.finish_reason = ""

    def emit(self, new: list[int]) -> None:
        take = new[: self.limit - len(self.tokens)]
        for i, tok in enumerate(take):
            if tok in self.eos:
                take = take[: i + 1]
                self.finish_reason = "eos"
                break
        self.tokens.extend(take)
        if not self.finish_reason and len(self.tokens) >= self.limit:
            self.finish_reason = "length"
        if not self.on_tokens or not take:
            return
        # on_tokens ends generation (a stop string, a client gone) by returning True (after every
        # token it was given) or an int k: the k-th completed a stop string, the rest are not the
        # answer and are dropped (a step may commit several tokens past a stop string)
        answer = self.on_tokens(take)
        if answer is None or answer is False:
            return
        if answer is not True and answer < len(take):
            del self.tokens[len(self.tokens) - len(take) + answer:]
            self.finish_reason = "stop"
        elif not self.finish_reason:
            self.finish_reason = "stop"

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)


def prompt_error(prompt: np.ndarray, max_positions: int, context_note: str = "the model's context",
                 vocab_size: int | None = None) -> str:
    """Why no token can be generated after `prompt` ("" when one can)."""
    if len(prompt) == 0:
        return "the prompt is empty: give at least one token of text"
    if len(prompt) + 1 > max_positions:
        return f"prompt is {len(prompt)} tokens, {context_note} is {max_positions}: shorten the prompt"
    if vocab_size is not None:  # else the embedding lookup fails deep in torch (IndexError)
        bad = np.flatnonzero((prompt < 0) | (prompt >= vocab_size))
        if len(bad):
            return (f"token id {int(prompt[bad[0]])} at position {int(bad[0])} is not in the model's vocabulary "
                    f"[0, {vocab_size}): pass ids of this model's tokenizer")
    return ""


BATCH_ONE = "runs at batch size 1 only"


def batch_blocker(name: str) -> str:
    """What keeps method `name` from the batched engine, as a clause ("" when nothing does):
    SDSAT drafts with the target's own forward and cache, which rows share."""
    return "it drafts with the target's own forward at SAT tokens" if method_entry(name).needs_sat_model else ""


def batch_refusal(name: str) -> str:
    """Why method `name` has no batched form, in one line that says what to do ("" when it has one)."""
    why = batch_blocker(name)
    return f"method {name} {BATCH_ONE} ({why}): use batch size 1 or another method" if why else ""


def require_batchable(name: str) -> None:
    reason = batch_refusal(name)
    if reason:
        raise UserError(reason)


def _check_drafter(drafter: Drafter, target: BatchedTarget) -> None:
    name = drafter.name
    if name in REGISTRY and target.rows > 1:
        require_batchable(name)
    if drafter.needs_hidden and not target.gives_hidden:
        raise UserError(f"method {name} reads the target's hidden states, which this model does not give "
                        f"({getattr(target.model.config, 'model_type', 'its family')}: no final norm found): "
                        "use another method")


@dataclass
class BatchStats:
    """The whole run: every step's forward beside the host work around it."""

    batch_size: int = 0  # at the end (an out-of-memory halves it)
    steps: int = 0
    rows_per_step: list[int] = field(default_factory=list)
    width_per_step: list[int] = field(default_factory=list)  # draft nodes per row allowed (w*)
    forward_s: float = 0.0  # verify forwards
    host_s: float = 0.0  # everything else in the steps: drafting, budget, accept, commit, observe
    accept_s: float = 0.0  # the accept step, in host_s: on a GPU mostly the wait for the verify at the one sync
    prefill_s: float = 0.0
    prefills: int = 0
    captures: int = 0  # graphs captured inside the steps (a cache growth recaptures every bucket)
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
            "accept_ms_per_step": round(1e3 * self.accept_s / steps, 3),
            "prefill_s": round(self.prefill_s, 4), "prefills": self.prefills, "captures": self.captures,
            "mean_rows": round(float(np.mean(self.rows_per_step)), 2) if self.rows_per_step else 0.0,
            "mean_width": round(float(np.mean(self.width_per_step)), 3) if self.width_per_step else 0.0,
            "notes": list(self.notes),
        }


@dataclass
class _Waiting:
    """A record in the queue: what its row needs once a slot is free."""

    key: Any
    prompt: np.ndarray  # [n] int64 host token ids
    config: GenerationConfig
    pool: DrafterPool
    generator: torch.Generator | None
    on_tokens: Callable[[list[int]], bool | None] | None
    prediction: np.ndarray | None  # [p] int32 expected output, drafted from by this row only


class _Row:
    """One record in flight: its drafter, its output so far, its pending token."""

    def __init__(self, waiting: _Waiting, drafter: Drafter) -> None:
        self.key, self.prompt, self.config = waiting.key, waiting.prompt, waiting.config
        self.pool, self.generator, self.prediction = waiting.pool, waiting.generator, waiting.prediction
        self.drafter = drafter
        self.out = _Output(waiting.config, waiting.on_tokens)
        self.metrics = Metrics()
        self.t0 = -1
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        self.cancelled = False
        self.scored = False  # the drafter scored this step's draft itself (`propose_scored`)
        self.draft_s = 0.0  # this step's proposing time
        # this step's draft: tree, path probabilities
        self.tree: DraftTree = DraftTree.empty()
        self.probs = np.zeros(0)
        self.proposed = 0  # nodes in the drafter's proposal, before any cut
        self.leading = 0  # how many of the proposal's first nodes `tree` starts with, in order


class DrafterPool:
    """Idle drafters of one method, reused by later records (as batch 1 reuses its one drafter:
    calibration, Token Recycle's table and memory carry over). `give` takes a drafter back with
    the record's whole output; a subclass may share that output with other drafters."""

    def __init__(self, make: Callable[[], Drafter]) -> None:
        self.make = make
        self.idle: list[Drafter] = []

    def take(self) -> Drafter:
        return self.idle.pop() if self.idle else self.make()

    def give(self, drafter: Drafter, output: np.ndarray) -> None:
        self.idle.append(drafter)


class _OutOfMemory(Exception):
    pass


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


class BatchRun:
    """Up to `batch_size` records in the slots of one BatchedTarget, and a queue behind them.

    `submit` queues a record (any time, also between steps); each `step` lets cancelled rows leave,
    admits queued records into free slots, runs one verify step over every row and returns the
    results of the records that finished. Every submitted key gets exactly one result. Not
    thread-safe: one thread owns a run (it runs the model).

    `cost`: a VerifyCost, or t_ms [n] of one curve for every context (`measure_batch_cost`; measured
    here when None); `max_width`: most draft nodes a row verifies per step; `max_prefill_tokens`:
    bound on the padded block of newcomers prefilled together; `capacity`: initial cache length per
    row (it grows); `target`: run on this BatchedTarget as it is instead of a new one;
    `budget=False`: no step width, every row verifies its whole tree (for `generate`)."""

    def __init__(self, model: torch.nn.Module, batch_size: int = 8, *, cost: VerifyCost | np.ndarray | None = None,
                 max_width: int = 16, max_prefill_tokens: int = 8192, capacity: int = 256,
                 stats: BatchStats | None = None, graphs: bool = False, target: BatchedTarget | None = None,
                 budget: bool = True) -> None:
        if batch_size < 1 or max_width < 0:
            raise UserError(f"batch size must be >= 1 (got {batch_size}) and the draft width >= 0 (got {max_width})")
        if target is None:
            target = BatchedTarget(model, batch_size, max(capacity, max_width + 4))  # the cache allocates lazily
            # CUDA: every verify forward as a graph, captured now (decode/engine/graphs.py); else eager
            enable_batch_graphs(target, max_width, graphs)
        self.target, self.budget = target, budget
        if budget and cost is None:
            cost = measure_batch_cost(model, batch_size, max(1, min(max_width, 8)))
        self.cost = None if cost is None else VerifyCost.one_curve(cost)
        self.max_width, self.max_prefill_tokens = max_width, max_prefill_tokens
        self.stats = stats if stats is not None else BatchStats()
        self.stats.batch_size = batch_size
        self.calibration = TreeCalibration()
        self.active: list[_Row] = []  # row b of `active` is slot b of the cache
        self.pending: deque[_Waiting] = deque()
        self._cancelled: set = set()

    running = property(lambda self: len(self.active))
    waiting = property(lambda self: len(self.pending))
    idle = property(lambda self: not self.active and not self.pending)

    def submit(self, key: Any, prompt: Sequence[int], config: GenerationConfig, pool: DrafterPool, *,
               generator: torch.Generator | None = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
               prediction: Sequence[int] | None = None) -> None:
        """Queue a record. `generator`: the row's random draws when config.sampling samples (rows
        may share one); `on_tokens` gets each step's committed tokens and may return True to stop
        (finish reason "stop"); `prediction`: token ids of the expected output, for a drafter with
        `expect`. A prompt that is empty or fills the context is a UserError."""
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        error = prompt_error(ids, self.target.max_positions, self.target.context_note, self.target.vocab_size)
        if error:
            raise UserError(error)
        if generator is None and not config.sampling.greedy:
            generator = _make_generator(config.sampling, self.target.device)
        self.pending.append(_Waiting(key, ids, config, pool, generator, on_tokens,
                                     None if prediction is None else np.asarray(prediction, dtype=np.int32)))

    def cancel(self, key: Any) -> None:
        """The record `key` leaves at the next step (result "cancelled"), queued or in flight."""
        self._cancelled.add(key)

    def drain(self) -> Iterator[GenerationResult]:
        while not self.idle:
            yield from self.step()

    def step(self) -> list[GenerationResult]:
        done = self._leave_cancelled()
        # 7) refill: newcomers take the free slots, prefilled in batched forwards
        try:
            self._admit()
        except _OutOfMemory:
            return done + self._halve()
        done += [self._retire(r) for r in [r for r in self.active if r.out.done]]  # done on its first token
        if not self.active:
            return done
        try:
            finished = self._step()
        except _OutOfMemory:
            return done + self._halve()
        return done + [self._retire(row) for row in finished]

    def _leave_cancelled(self) -> list[GenerationResult]:
        if not self._cancelled:
            return []
        done = []
        for row in [r for r in self.active if r.key in self._cancelled]:
            row.out.finish_reason = "cancelled"
            done.append(self._retire(row))
        kept = [w for w in self.pending if w.key not in self._cancelled]
        done += [GenerationResult([], "cancelled", Metrics(), index=w.key) for w in self.pending if w.key in self._cancelled]
        self.pending = deque(kept)
        self._cancelled.clear()
        return done

    # -- the step -------------------------------------------------------------------------------

    def _step(self) -> list[_Row]:
        # -> the rows that finished this step. Row b of `active` is slot b of the cache.
        target, active, stats = self.target, self.active, self.stats
        tic = time.perf_counter()
        # 1) propose: each row's tree and its nodes' path probabilities (rows drafting with one
        # draft model draft together first, one forward a round for all of them)
        _draft_together(active)
        fixed = 0  # widest tree that cannot be cut (context rows: lookahead's window)
        for b, row in enumerate(active):
            t_draft = time.perf_counter()
            room = min(row.out.remaining - 1, target.max_positions - int(target.lengths[b]) - 1)
            _propose(row, self.calibration if self.budget else None, max(room, 0))
            if row.tree.accept_limit is not None:
                fixed = max(fixed, len(row.tree))
            row.draft_s = time.perf_counter() - t_draft
        # 2) budget: one width for the step, each row keeps a prefix of its tree
        if not self.budget:
            width = max(len(r.tree) for r in active)
        else:
            context = float(np.mean(target.lengths[: len(active)]))  # each input row attends its own row's
            width = choose_width([r.probs for r in active], self.cost.at(context), self.max_width, fixed)
        for row in active:
            if row.tree.accept_limit is None and len(row.tree) > width:
                row.tree = row.tree.prefix(width)
            if len(row.tree) < row.proposed and len(row.tree) <= row.leading:  # cut to a prefix of the proposal
                row.drafter.keep_first(len(row.tree))
        trees = [r.tree for r in active]
        inputs = [verify_input(r.t0, r.tree, target.device) for r in active]

        # 3) verify
        t_forward = time.perf_counter()
        captured = target.graphs.captures if target.graphs is not None else 0
        try:
            logits, offsets = target.verify(inputs, trees)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if _is_oom(err) and target.rows > 1:
                raise _OutOfMemory() from err
            raise
        forward_s = time.perf_counter() - t_forward
        if target.graphs is not None:
            stats.captures += target.graphs.captures - captured

        # 4) accept: one draw (or argmax) per real input, each row by its own sampling, one host sync
        flat = torch.cat(inputs)
        t_accept = time.perf_counter()
        paths, nexts, host = batch_accept(logits, offsets, flat, trees, [r.config.sampling for r in active],
                                          [r.generator for r in active], [_own_rule(r) for r in active])
        accept_s = time.perf_counter() - t_accept
        stats.accept_s += accept_s

        # 5) commit: tokens go out per row as they are committed (on_tokens)
        target.keep(paths)
        finished = []
        for b, (row, tree, path, bonus) in enumerate(zip(active, trees, paths, nexts)):
            committed = host[offsets[b]: offsets[b + 1]][path]
            before = len(row.out.tokens)
            row.out.emit([int(t) for t in committed[1:]] + [bonus])
            row.metrics.record_step(drafted=tree.drafts, accepted=min(len(path) - 1, len(row.out.tokens) - before))
            row.metrics.verify_s += forward_s
            row.metrics.accept_s += accept_s
            if not row.scored and self.budget:
                self.calibration.learn(tree.parents, tree.drafts, path)
            row.t0 = bonus
            # 6) observe
            t_draft = time.perf_counter()
            if row.out.done or target.lengths[b] >= target.max_positions:  # no position left for t0
                finished.append(row)
            elif row.drafter.needs_hidden:  # [1 + a, H] at the committed inputs, from this verify
                row.drafter.observe(committed, flat[offsets[b]: offsets[b + 1]], logits[offsets[b]: offsets[b + 1]],
                                    hidden=target.hidden[to_device(offsets[b] + path, target.device)])
            else:
                row.drafter.observe(committed, flat[offsets[b]: offsets[b + 1]], logits[offsets[b]: offsets[b + 1]])
            row.metrics.record_draft(row.draft_s + time.perf_counter() - t_draft)
        stats.steps += 1
        stats.rows_per_step.append(len(active))
        stats.width_per_step.append(width)
        stats.forward_s += forward_s
        stats.host_s += time.perf_counter() - tic - forward_s
        return finished

    # -- admission, retirement, out-of-memory ------------------------------------------------------

    def _admit(self) -> None:
        # Fills slots len(active).. in queue order, prefilled shortest first in groups of similar length
        # (longest <= 1.5x shortest) whose padded block [k, longest] stays within max_prefill_tokens (at
        # least one per group): padding costs forward time like real tokens. While other rows decode,
        # one group per step (newcomers delay them by one prefill); the rest go back to the queue's head.
        target, active, pending, stats = self.target, self.active, self.pending, self.stats
        decoding = bool(active)
        while pending and len(active) < target.rows:
            wave = sorted((pending.popleft() for _ in range(min(len(pending), target.rows - len(active)))),
                          key=lambda w: len(w.prompt))
            group: list[_Waiting] = []
            for w in wave:
                n = len(w.prompt)
                if group and (n * (len(group) + 1) > self.max_prefill_tokens or n > 1.5 * len(group[0].prompt)):
                    break
                group.append(w)
            pending.extendleft(reversed(wave[len(group):]))
            slots = list(range(len(active), len(active) + len(group)))
            longest = max(len(w.prompt) + w.config.max_new_tokens for w in group)
            target.reserve(room(min(longest, target.max_positions), self.max_width))
            newcomers = [_Row(w, w.pool.take()) for w in group]
            wants_all = [r.drafter.prefill_logits == "all" for r in newcomers]
            if any(r.drafter.needs_hidden for r in newcomers):
                target.wants_hidden = True  # for the rest of the run: EAGLE rows read every forward's
            tic = time.perf_counter()
            try:
                logits = target.prefill(slots, [r.prompt for r in newcomers], wants_all)
            except (RuntimeError, torch.OutOfMemoryError) as err:
                if _is_oom(err) and target.rows > 1:
                    pending.extendleft(reversed(group))
                    raise _OutOfMemory() from err
                raise
            last = torch.stack([lg[-1] for lg in logits])  # [k, V]
            firsts = choose_rows(last, np.arange(len(newcomers) + 1), [r.config.sampling for r in newcomers],
                                 [r.generator for r in newcomers]).cpu().numpy()  # the prefill's one sync
            elapsed = time.perf_counter() - tic
            stats.prefill_s += elapsed
            stats.prefills += 1
            for i, (row, lg, t0) in enumerate(zip(newcomers, logits, firsts)):
                row.metrics.prefill_s = elapsed
                t_draft = time.perf_counter()
                row.drafter.expect(row.prediction)  # this row's prediction, or none (a reused drafter forgets the last)
                extra = {"hidden": target.prefill_hidden[i]} if row.drafter.needs_hidden else {}
                row.drafter.start(row.prompt, lg, **extra)
                row.metrics.draft_s += time.perf_counter() - t_draft
                row.t0 = int(t0)
                row.out.emit([row.t0])
                active.append(row)
            if decoding:
                return

    def _retire(self, row: _Row) -> GenerationResult:
        # Takes `row` out of slot b; the last row moves into the hole so rows stay packed in [0, A).
        target, active = self.target, self.active
        b = active.index(row)
        last = len(active) - 1
        if b != last:
            target.move_row(last, b)
            active[b] = active[last]
        else:
            target.lengths[b] = 0
        active.pop()
        if not row.out.done:
            row.out.finish_reason = "length"  # the model's context is full
        output = np.asarray(row.out.tokens, dtype=np.int64)
        row.drafter.finish(output)
        prediction = row.drafter.prediction_usage() if row.prediction is not None and len(row.prediction) else None
        row.pool.give(row.drafter, output)
        row.metrics.new_tokens = len(row.out.tokens)
        row.metrics.time_s = time.perf_counter() - row.started
        row.metrics.cpu_s = time.process_time() - row.cpu_started  # the process's, as time_s is the wall's: rows share both
        self.stats.records += 1
        self.stats.new_tokens += len(row.out.tokens)
        return GenerationResult(row.out.tokens, row.out.finish_reason, row.metrics, prediction, index=row.key)

    def _halve(self) -> list[GenerationResult]:
        # Out of memory: rows in slots >= half leave the cache. Those that emitted nothing to an
        # `on_tokens` yet go back to the head of the queue, in submission order, and restart; a
        # row whose tokens already streamed out cannot restart and ends with an error.
        target, stats = self.target, self.stats
        before = target.rows
        half = max(1, before // 2)
        dropped = self.active[half:]
        del self.active[half:]
        target.resize(half)
        failed = []
        for row in reversed(dropped):
            if row.out.on_tokens is None:
                self.pending.appendleft(_Waiting(row.key, row.prompt, row.config, row.pool, row.generator, None,
                                                 row.prediction))
            else:
                failed.append(GenerationResult(row.out.tokens, "error", row.metrics, index=row.key,
                                               error=f"out of memory at batch size {before}: retry the request"))
        stats.batch_size = half
        stats.notes.append(f"out of memory at batch size {before}: continuing at {half}")
        return failed


def stream_batch(model: torch.nn.Module, make_drafter: Callable[[], Drafter], prompts: Iterable[Sequence[int]],
                 config: GenerationConfig, batch_size: int = 8, *, cost: VerifyCost | np.ndarray | None = None,
                 max_width: int = 16, max_prefill_tokens: int = 8192, stats: BatchStats | None = None,
                 predictions: Sequence[Sequence[int] | None] | None = None,
                 graphs: bool = False) -> Iterator[GenerationResult]:
    """Generate for every prompt (host token ids) with up to `batch_size` in flight (a BatchRun);
    yields each record's result as soon as it finishes (`index` says which). `make_drafter()`'s
    drafters are reused by later records, as batch 1 reuses one. `predictions[i]`: token ids of
    record i's expected output (or None). The other arguments are BatchRun's."""
    stats = stats if stats is not None else BatchStats()
    start = time.perf_counter()
    records = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if batch_size < 1 or max_width < 0:
        raise UserError(f"batch size must be >= 1 (got {batch_size}) and the draft width >= 0 (got {max_width})")
    if records:
        max_positions = BatchedTarget(model, 1, 2).max_positions  # cheap: the cache allocates lazily
        longest = min(max(len(r) for r in records) + config.max_new_tokens, max_positions)
        run = BatchRun(model, min(batch_size, len(records)), cost=cost, max_width=max_width,
                       max_prefill_tokens=max_prefill_tokens, capacity=longest + max_width + 2, stats=stats,
                       graphs=graphs)
        pool = DrafterPool(make_drafter)
        pool.idle.append(make_drafter())
        _check_drafter(pool.idle[0], run.target)
        items = ((i, r, None if predictions is None else predictions[i]) for i, r in enumerate(records))
        yield from feed(run, items, config, pool, ahead=len(records))
    stats.time_s = time.perf_counter() - start


def feed(run: BatchRun, items: Iterable[tuple[Any, Sequence[int], Sequence[int] | None]], config: GenerationConfig,
         pool: DrafterPool, ahead: int | None = None) -> Iterator[GenerationResult]:
    """Submit `items` (key, prompt ids, prediction ids or None), read lazily, to `run` while fewer
    than `ahead` records (default: the run's batch size) wait for a slot, and yield each result as
    it finishes: the batch stays full, and a long input is never held in memory. A prompt the model
    cannot take gets an "error" result. Records draw from one random stream (sampling)."""
    items = iter(items)
    ahead = ahead or run.target.rows
    generator = _make_generator(config.sampling, run.target.device)
    spent = False
    while True:
        while not spent and run.waiting < ahead:
            item = next(items, None)
            if item is None:
                spent = True
                break
            key, ids, prediction = item
            try:
                run.submit(key, ids, config, pool, generator=generator, prediction=prediction)
            except UserError as err:
                run.stats.records += 1
                yield GenerationResult([], "error", Metrics(), index=key, error=str(err))
        if spent and run.idle:
            return
        yield from run.step()


def generate_batch(model: torch.nn.Module, make_drafter: Callable[[], Drafter], prompts: Iterable[Sequence[int]],
                   config: GenerationConfig, batch_size: int = 8,
                   on_result: Callable[[GenerationResult], None] | None = None, **options) -> list[GenerationResult]:
    """`stream_batch`, collected in input order; `on_result` sees each result as it finishes."""
    results: dict[int, GenerationResult] = {}
    for result in stream_batch(model, make_drafter, prompts, config, batch_size, **options):
        results[result.index] = result
        if on_result is not None:
            on_result(result)
    return [results[i] for i in sorted(results)]


@torch.inference_mode()
def generate(target: TargetModel, drafter: Drafter, prompt_ids: list[int] | np.ndarray, config: GenerationConfig,
             on_tokens: Callable[[list[int]], bool | None] | None = None,
             prediction: Sequence[int] | None = None) -> GenerationResult:
    """Generate after prompt_ids with drafts from `drafter`, as the one row of a BatchRun on
    `target.rows` with no step budget (the drafter sizes its own drafts). `on_tokens` gets the new
    tokens of each step and may return True to stop after them, or k to stop after the first k;
    `prediction`: token ids of the expected output, for a drafter with `expect`."""
    rows = target.rows
    wanted, eager_before = rows.wants_hidden, rows.eager_fallbacks
    run = one_row_run(target, drafter, prompt_ids, config, on_tokens, prediction)
    try:
        (result,) = run.drain()
    finally:
        rows.wants_hidden = wanted
    result.metrics.eager_verifies = rows.eager_fallbacks - eager_before
    return result


def one_row_run(target: TargetModel, drafter: Drafter, prompt_ids: list[int] | np.ndarray, config: GenerationConfig,
                on_tokens: Callable[[list[int]], bool | None] | None = None,
                prediction: Sequence[int] | None = None) -> BatchRun:
    """`generate`'s run with its record (key 0) submitted and nothing run yet, for a caller that
    steps it between other work (the server, between two steps of its batch)."""
    run = BatchRun(target.model, 1, target=target.rows, budget=False, max_width=VERIFY_SLACK)
    # submit refuses a prompt the model cannot take before the drafter is checked
    run.submit(0, prompt_ids, config, DrafterPool(lambda: drafter), on_tokens=on_tokens, prediction=prediction)
    _check_drafter(drafter, target.rows)
    return run


def _draft_together(active: list[_Row]) -> None:
    # Rows whose drafter drafts this step with a draft model (sd, specdec++, sam+draft, ouroboros)
    # get their trees from one batch of draft forwards per drafter class and draft model; each
    # row's propose then returns its own.
    groups: dict[tuple, list] = {}
    for row in active:
        drafter = row.drafter.model_drafter(row.t0)
        if drafter is not None:
            groups.setdefault((type(drafter), id(drafter.draft.rows)), []).append((drafter, row.t0))
    for (kind, _), group in groups.items():
        if len(group) > 1:
            drafters, t0s = zip(*group)
            for drafter, t0, tree in zip(drafters, t0s, kind.draft_together(drafters, t0s)):
                drafter.ready = (t0, tree)


def _propose(row: _Row, calibration: TreeCalibration | None, room: int) -> None:
    # Sets row.tree, row.probs (path probabilities, prefix-closed order), row.proposed and
    # row.leading: a cut of the tree to k <= leading nodes is the proposal's first k nodes, so
    # `keep_first(k)` may tell the drafter what was verified. Without a calibration (no step
    # budget: one record alone) the drafter sizes its own tree (`propose`) and no budget reads probs.
    if calibration is None:
        tree, probs = row.drafter.propose(row.t0), None
    else:
        tree, probs = row.drafter.propose_scored(row.t0)
    row.scored = probs is not None
    row.proposed = row.leading = len(tree)
    if probs is None:
        probs = calibration.score(tree.parents) if calibration is not None else np.ones(len(tree))
    if len(tree):
        depth = tree.depths()
        if depth.max() > room:  # drafts deeper than the tokens still wanted, or the context, are waste
            keep = np.flatnonzero(depth <= room)
            row.leading = int(np.argmin(np.append(keep, -1) == np.arange(len(keep) + 1)))
            tree, probs = tree.limit_depth(room), probs[keep]
            row.drafter.keep_depth(room)
    row.tree, row.probs = tree, probs[: tree.accept_limit]  # context rows are never accepted (None: none)


def _own_rule(row: _Row) -> Callable | None:
    """The acceptance rule a row's step needs besides the shared tree rule: the drafter's own
    (a reference reproduction), or speculative sampling's for sampled chains carrying q."""
    if row.drafter.accept is not None:
        return row.drafter.accept
    if row.tree.q is not None and not row.config.sampling.greedy:
        return speculative_accept
    return None


def _make_generator(sampling: SamplingConfig, device: torch.device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator
