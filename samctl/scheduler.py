"""Requests in, text and results out: the server's scheduler, between asyncio and the Session.

torch generations must not run concurrently on one KV cache, so one worker thread owns every
Session and runs `Job`s; the HTTP side (asyncio) only submits jobs and reads their events. A job
hands its events to a thread-safe `sink` (the server wraps `loop.call_soon_threadsafe` into an
asyncio.Queue):

    ("started", prompt_tokens)   the session and prompt are resolved; generation begins
    ("text", delta)              new text, stop strings cut (OpenAI: the stop string is not sent)
    ("done", result, reason)     the GenerationResult and the OpenAI finish reason
    ("error", RequestError)      refused before generation (bad store, method, prompt) or failed
    ("cancelled",)               the client went away; the job stopped after its current step

The contract a scheduler keeps (`submit`, `close`, `running`, `waiting`): every submitted job
gets exactly one of done / error / cancelled, last; a cancelled job stops at its next step and
frees its slot; `close` finishes what was submitted, then returns. `SerialScheduler` runs one job
at a time (batch 1). A batched engine runs many jobs at once behind the same contract: it is the
one class to add, chosen in `samctl.server.create_app` (its `scheduler` argument); jobs, the
HTTP side and the counts stay as they are.

This module knows Sessions, token ids and text; not HTTP, not pydantic.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from samctl.decode.sampling import SamplingConfig
from samctl.detok import IncrementalDetokenizer
from samctl.index.errors import UserError

Sink = Callable[[tuple], None]
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # samctl's -> OpenAI's


class RequestError(Exception):
    """An error a client gets as OpenAI shapes it: HTTP status, message, type, param, code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class Sessions:
    """The server's sessions, one per (store name, method), all on one engine: the first of each
    store is given, the others are built on first use (by the worker thread: building a drafter
    may measure the verify cost on the model). Each keeps its drafter, so the cross-request
    memory learns from every response of its method and store."""

    def __init__(self, by_store: dict[str | None, Any], model_name: str | None = None) -> None:
        if not by_store:
            raise UserError("a server needs at least one session")
        self.by_store = dict(by_store)
        self.default_store = next(iter(self.by_store))
        first = self.by_store[self.default_store]
        self.engine = first.engine
        self.default_method = first.config.method
        self.model_name = model_name or str(self.engine.name)
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
        if store is None:
            return self.default_store, method
        if store not in self.by_store:
            names = ", ".join(self.store_names) or "none (start the server with --sam NAME=STORE)"
            raise RequestError(f"unknown store {store!r}: this server has {names}", param="store",
                               code="unknown_store")
        return store, method

    def get(self, store: str | None, method: str):
        key = (store, method)
        if key not in self._built:
            try:
                self._built[key] = self.by_store[store].for_method(method)
            except UserError as err:  # a method that needs what the server was not given
                raise RequestError(str(err), param="method", code="method_unavailable") from err
        return self._built[key]


class StopCut:
    """Cuts streamed text at the first stop string (OpenAI: the stop string itself is not
    returned), holding back a tail that could still become one."""

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
    """What a job generates: a prompt (text, token ids or a conversation), on one session."""

    prompt: str | list[int] | list[dict[str, str]]
    store: str | None
    method: str
    max_new_tokens: int | None = None
    sampling: SamplingConfig | None = None
    prediction: str | None = None
    stop: tuple[str, ...] = ()


class Job:
    """One request on the worker thread: resolves its session and prompt, generates, and turns
    tokens into text events; `cancel` (from any thread) stops it at its next step."""

    def __init__(self, request: Request, sessions: Sessions, sink: Sink) -> None:
        self.request, self.sessions, self.sink = request, sessions, sink
        self.cancelled = threading.Event()
        self._detok: IncrementalDetokenizer | None = None
        self._stop = StopCut(list(request.stop))

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self) -> None:
        if self.cancelled.is_set():
            self.sink(("cancelled",))
            return
        r = self.request
        try:
            # 1) the session and the prompt's ids
            session = self.sessions.get(r.store, r.method)
            ids = self._encode(session)
            self._detok = IncrementalDetokenizer(session.decode)
            # no answer outgrows the context, so a larger max_tokens would only size the KV cache
            room = session.engine.target.max_positions - len(ids)
            max_new_tokens = min(r.max_new_tokens or session.config.max_new_tokens, room)
            self.sink(("started", len(ids)))
            # 2) generate, text streaming through on_tokens
            result = session.generate(ids, prediction=r.prediction, on_tokens=self._on_tokens,
                                      max_new_tokens=max_new_tokens, sampling=r.sampling)
        except RequestError as err:
            self.sink(("error", err))
            return
        except UserError as err:
            self.sink(("error", RequestError(str(err))))
            return
        except Exception as err:  # the server keeps serving; the client learns what failed
            self.sink(("error", RequestError(f"generation failed: {type(err).__name__}: {err}", status=500,
                                             kind="server_error")))
            return
        # 3) the end: the rest of the text, then the result
        if self.cancelled.is_set():
            self.sink(("cancelled",))
            return
        tail = self._stop.finish(self._detok.finish())
        if tail:
            self.sink(("text", tail))
        reason = "stop" if self._stop.stopped else FINISH_REASONS[result.finish_reason]
        self.sink(("done", result, reason))

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

    def _on_tokens(self, tokens: list[int]) -> bool:
        """Stream the new text; True stops generation (the client is gone, or a stop string came)."""
        if self.cancelled.is_set():
            return True
        text = self._stop.push(self._detok.push(tokens))
        if text:
            self.sink(("text", text))
        return self._stop.stopped


class Scheduler(Protocol):
    running: int
    waiting: int

    def submit(self, job: Job) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


class SerialScheduler:
    """Batch 1: a queue and one worker thread that runs one job at a time, in arrival order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._closed = False
        self.running = 0
        self._thread = threading.Thread(target=self._work, name="samctl-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        if self._closed:
            job.sink(("error", RequestError("the server is shutting down", status=503, kind="server_error")))
            return
        self._queue.put(job)

    def close(self, timeout: float | None = None) -> None:
        """Finish every job submitted so far, then stop the worker."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.running = 1
            try:
                job.run()
            finally:
                self.running = 0
