"""The server's scheduler, between asyncio and the Session: requests in, text and results out.

One worker thread owns every Session (torch generations must not share a KV cache concurrently)
and runs `Job`s; a job hands its events to a thread-safe `sink`:

    Started(prompt_tokens)   the session and prompt are resolved; generation begins
    Text(text)               new text, stop strings cut (OpenAI: the stop string is not sent)
    Done(result, reason)     the result and the OpenAI finish reason
    Failed(error)            a RequestError: refused before generation, or failed
    Cancelled()              the client went away; the job stopped after its current step

Every submitted job gets exactly one of Done / Failed / Cancelled, last. While the worker prepares
the batched engine (its verify cost read or measured), `starting` says so and jobs wait;
`stop_starting` (SIGTERM) ends that at its next forward and refuses them (503).
This module knows Sessions, token ids and text; not HTTP, not pydantic.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from samctl.decode.engine.cost import Stopped
from samctl.decode.loop import DrafterPool, GenerationResult
from samctl.decode.sampling import SamplingConfig
from samctl.detok import IncrementalDetokenizer
from samctl.index.errors import ConfigError, UserError

# text with repeats, so that drafters take the paths real requests take
WARM_UP_PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return add(add(a, b), c)\n"

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # samctl's -> OpenAI's


class RequestError(Exception):
    """An error a client gets as OpenAI shapes it: HTTP status, message, type, param, code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def request_error(err: UserError, word: Callable[[str], str] | None = None, **details: Any) -> RequestError:
    """The settings a ConfigError names worded by `word`, by default as the command-line flags that
    set them (the server's: not the request's to change)."""
    if not isinstance(err, ConfigError):
        return RequestError(str(err), **details)
    from samctl.options import flag

    return RequestError(err.render(word or flag), **details)


@dataclass(frozen=True)
class Started:
    prompt_tokens: int


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Done:
    result: GenerationResult
    reason: str


@dataclass(frozen=True)
class Failed:
    error: RequestError


@dataclass(frozen=True)
class Cancelled:
    pass


Event = Started | Text | Done | Failed | Cancelled
Sink = Callable[[Event], None]
ENDS = (Done, Failed, Cancelled)  # every job's last event is one of these, and its only one


def _shutting_down() -> RequestError:
    return RequestError("the server is shutting down", status=503, kind="server_error")


class Sessions:
    """One session per (store name, method), all on one engine: the first of each store is given,
    the others are built on first use, by the worker thread (a drafter may measure the verify cost)."""

    def __init__(self, by_store: dict[str | None, Any], model_name: str | None = None) -> None:
        if not by_store:
            raise UserError("a server needs at least one session")
        self.by_store = dict(by_store)
        self.default_store = next(iter(self.by_store))
        first = self.by_store[self.default_store]
        self.default_method = first.config.method
        self.model_name = model_name or str(first.engine.name)
        self._built: dict[tuple[str | None, str], Any] = {(k, s.config.method): s for k, s in self.by_store.items()}

    @property
    def store_names(self) -> list[str]:
        return [name for name in self.by_store if name is not None]

    def check(self, store: str | None, method: str | None) -> tuple[str | None, str]:
        """(store, method) of a request, defaults filled in; unknown names are a RequestError."""
        from samctl.decode.methods import ALL_METHODS

        method = method or self.default_method
        if method not in ALL_METHODS:
            raise RequestError(f"unknown method {method!r}: choose from {', '.join(ALL_METHODS)}", param="method",
                               code="unknown_method")
        if store is not None and store not in self.by_store:
            names = ", ".join(self.store_names) or "none (start the server with --sam NAME=STORE)"
            raise RequestError(f"unknown store {store!r}: this server has {names}", param="store",
                               code="unknown_store")
        return self.default_store if store is None else store, method

    def get(self, store: str | None, method: str):
        key = (store, method)
        if key not in self._built:
            try:
                self._built[key] = self.by_store[store].for_method(method)
            except UserError as err:  # a method that needs what the server was not given
                raise request_error(err, param="method", code="method_unavailable") from err
        return self._built[key]


class StopCut:
    """Cuts streamed text at the first stop string (not itself returned), holding back a tail that
    could still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[:min(hits)]
        # the longest tail of the text that begins a stop string waits for what follows
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self, text: str) -> str:
        out = self.push(text)
        if not self.stopped:
            out, self.held = out + self.held, ""
        return out


@dataclass
class Request:
    prompt: str | list[int] | list[dict[str, str]]
    store: str | None
    method: str
    max_new_tokens: int | None = None
    sampling: SamplingConfig | None = None
    prediction: str | None = None
    stop: tuple[str, ...] = ()


class Job:
    """One request on the worker thread, turning tokens into text events; `cancel` (from any
    thread) stops it at its next step."""

    def __init__(self, request: Request, sessions: Sessions, sink: Sink) -> None:
        self.request, self.sessions, self.sink = request, sessions, sink
        self.cancelled = threading.Event()
        self._detok: IncrementalDetokenizer | None = None
        self._stop = StopCut(list(request.stop))

    def cancel(self) -> None:
        self.cancelled.set()

    def prepare(self) -> tuple[Any, list[int], int] | None:
        """(session, prompt ids, max new tokens), with Started sent; None (and Cancelled sent) when
        the job was cancelled. A refused request raises its error."""
        if self.cancelled.is_set():
            self.sink(Cancelled())
            return None
        r = self.request
        session = self.sessions.get(r.store, r.method)
        ids = self._encode(session)
        self._detok = IncrementalDetokenizer(session.decode)
        # no answer outgrows the context, so a larger max_tokens would only size the KV cache
        room = session.engine.target.max_positions - len(ids)
        self.sink(Started(len(ids)))
        return session, ids, min(r.max_new_tokens or session.config.max_new_tokens, room)

    def finish(self, result: GenerationResult) -> None:
        if result.finish_reason == "error":
            self.fail(RequestError(result.error, status=500, kind="server_error"))
            return
        if self.cancelled.is_set():
            self.sink(Cancelled())
            return
        self._send(self._stop.finish(self._detok.finish()))
        reason = "stop" if self._stop.stopped else FINISH_REASONS[result.finish_reason]
        self.sink(Done(result, reason))

    def fail(self, err: Exception) -> None:
        if isinstance(err, Stopped):  # a measurement this job waited for, stopped by a shutdown
            err = _shutting_down()
        elif isinstance(err, UserError):
            err = request_error(err)
        elif not isinstance(err, RequestError):  # the server keeps serving; the client learns what failed
            err = RequestError(f"generation failed: {type(err).__name__}: {err}", status=500, kind="server_error")
        self.sink(Failed(err))

    def _encode(self, session) -> list[int]:
        prompt, engine = self.request.prompt, session.engine
        if isinstance(prompt, str):
            ids = engine.encode(prompt, chat=False)
        elif prompt and isinstance(prompt[0], dict):
            ids = engine.encode_conversation(prompt, chat=bool(getattr(engine.tokenizer, "chat_template", None)))
        else:
            ids = [int(t) for t in prompt]
            if any(t < 0 or t >= engine.vocab_size for t in ids):
                raise RequestError(f"token ids must be in [0, {engine.vocab_size})", param="prompt")
        if not ids:
            raise RequestError("the prompt is empty: give at least one token of text", param="prompt")
        limit = engine.target.max_positions
        if len(ids) + 1 > limit:
            raise RequestError(f"the prompt is {len(ids)} tokens, {engine.target.context_note} is {limit}: "
                               "shorten it", param="messages" if prompt and isinstance(prompt[0], dict) else "prompt",
                               code="context_length_exceeded")
        return ids

    def on_tokens(self, tokens: list[int]) -> bool | int:
        """Stream the new text; True stops generation (the client is gone), k stops it after the
        k-th of these tokens (it completed a stop string: the answer ends there)."""
        if self.cancelled.is_set():
            return True
        if not self._stop.stops:
            self._send(self._detok.push(tokens))
            return False
        for k, token in enumerate(tokens, 1):  # a step commits several tokens; the stop may come at any
            self._send(self._stop.push(self._detok.push([token])))
            if self._stop.stopped:
                return k
        return False

    def _send(self, text: str) -> None:
        if text:
            self.sink(Text(text))


class _SessionDrafters(DrafterPool):
    """A session's row drafters, sharing the kept drafter's cross-request memory (each row reads it
    through its own cursor). A drafter that cannot share it (an n-gram pool: lookahead, ouroboros)
    starts from a copy, and the kept one takes in each of its responses."""

    def __init__(self, session) -> None:
        super().__init__(self._fresh)
        self.session = session
        self.copies = False  # row drafters keep memories of their own

    def _fresh(self):
        drafter, kept = self.session.fresh_drafter(), self.session.drafter
        if drafter.keeps_memory and kept.keeps_memory and not drafter.share_memory(kept):
            drafter.load_memory(kept.memory_documents())  # --memory-file and every response so far
            self.copies = True
        return drafter

    def give(self, drafter, output: np.ndarray) -> None:
        super().give(drafter, output)
        if self.copies and len(output):
            self.session.drafter.load_memory([output])


class BatchScheduler:
    """Up to `batch_size` jobs generate at once as rows of the batched engine (decode.loop.BatchRun),
    joining free slots between steps. A job with no batched form (SDSAT's methods), and every job
    when `batch_size` is 1, runs alone (a one-row run), in arrival order, one step of it between
    two steps of the batch: neither holds the other back for more than a step."""

    def __init__(self, sessions: Sessions, batch_size: int = 8) -> None:
        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        self.sessions, self.batch_size = sessions, batch_size
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._closed = False
        self._stopping = threading.Event()  # start-up and any later measurement end at the next forward
        self.starting = "preparing the engine (the batch's verify cost, read from the cache or measured, and a warm-up run)"
        self._run = None  # decode.loop.BatchRun, built by the worker on the first batched job
        self._jobs: dict[int, Job] = {}  # in the run, by key
        self._drafters: dict[int, _SessionDrafters] = {}  # by id(session)
        self._alone: deque[tuple[Job, Any]] = deque()  # jobs with a one-row run each; the first one steps
        self._thread = threading.Thread(target=self._work, name="samctl-batch-worker", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return (self._run.running if self._run is not None else 0) + min(len(self._alone), 1)

    @property
    def waiting(self) -> int:
        return len(self._inbox) + (self._run.waiting if self._run is not None else 0) + max(len(self._alone) - 1, 0)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                job.sink(Failed(_shutting_down()))
                return
            self._inbox.append(job)
            self._cond.notify()

    def stop_starting(self) -> None:
        """A measurement in progress stops at its next forward; if the engine never became ready, the
        jobs waiting for it are refused. Jobs already generating go on to their end."""
        self._stopping.set()
        with self._cond:
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Finish every job submitted so far, then stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _work(self) -> None:
        self._open_run()
        while True:
            with self._cond:
                while not self._inbox and not self._jobs and not self._alone and not self._closed:
                    self._cond.wait()
                if self._closed and not self._inbox and not self._jobs and not self._alone:
                    return
            while self._inbox:  # one at a time: the rest count as waiting meanwhile
                with self._cond:
                    job = self._inbox.popleft()
                if self._stopping.is_set() and self.starting:  # shutting down before the engine was ready
                    job.sink(Failed(_shutting_down()))
                else:
                    self._take(job)
            if self._jobs:
                self._step()
            if self._alone:
                self._step_alone()

    def _open_run(self) -> None:
        # at start, so that no request waits for the verify cost or kernel loads while /health says
        # ready; should it fail, the first batched job tries again and its client learns why
        session = self.sessions.by_store[self.sessions.default_store]
        try:
            if self.batch_size > 1 and not session.batch_refusal():
                self._run = session.batch_run(self.batch_size, stop=self._stopping.is_set)
            if not self._stopping.is_set():
                ids = session.encode(WARM_UP_PROMPT)
                if self._run is not None:
                    if not session.batch_warm:
                        session.warm_up_batched([ids], self._run.cost)
                elif not session.warm:
                    session.warm_up(ids)
        except Stopped:
            return  # still starting: the waiting jobs are refused
        except Exception:
            self._run = None
        self.starting = ""

    def _take(self, job: Job) -> None:
        try:
            prepared = job.prepare()
            if prepared is None:
                return
            session, ids, max_new_tokens = prepared
            r = job.request
            if self.batch_size == 1 or session.batch_refusal():  # the one row (key 0) of a run of its own
                self._alone.append((job, session.one_row_run(ids, prediction=r.prediction, on_tokens=job.on_tokens,
                                                             max_new_tokens=max_new_tokens, sampling=r.sampling)))
                return
            if self._run is None:
                self._run = session.batch_run(self.batch_size, stop=self._stopping.is_set)
            config = replace(session.generation, max_new_tokens=max_new_tokens,
                             sampling=r.sampling or session.generation.sampling)
            drafters = self._drafters.get(id(session))
            if drafters is None:
                drafters = self._drafters[id(session)] = _SessionDrafters(session)
            self._run.submit(id(job), ids, config, drafters, on_tokens=job.on_tokens,
                             prediction=session.prediction_ids(r.prediction))
        except Exception as err:
            job.fail(err)
            return
        self._jobs[id(job)] = job

    def _step_alone(self) -> None:
        job, run = self._alone[0]
        if job.cancelled.is_set():
            run.cancel(0)
        try:
            results = run.step()
        except Exception as err:
            self._alone.popleft()
            job.fail(err)
            return
        for result in results:
            self._alone.popleft()
            job.finish(result)

    def _step(self) -> None:
        run = self._run
        for key, job in self._jobs.items():
            if job.cancelled.is_set():
                run.cancel(key)
        try:
            results = run.step()
        except Exception as err:  # the batch is lost; its jobs learn why, the server goes on
            for job in self._jobs.values():
                job.fail(err)
            self._jobs.clear()
            self._run = None
            return
        for result in results:  # a cancelled job's row leaves as "cancelled": `finish` sends Cancelled
            self._jobs.pop(result.index).finish(result)
