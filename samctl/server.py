"""`samctl serve`'s ASGI app: OpenAI-compatible endpoints over Sessions, with Predicted Outputs.

    POST /v1/chat/completions   messages -> the chat template -> generate (streamed as SSE or not)
    POST /v1/completions        prompt text or token ids -> generate
    GET  /v1/models             the one model served
    GET  /health                200 "ok" once the engine can serve; 503 "starting: ..." before
                                (its verify cost is being read or measured), 503 when stopping
    GET  /metrics               Prometheus text: requests, tokens, draft and accepted tokens

Requests are validated by the schemas of samctl.openai_api; every error is OpenAI's
`{"error": {"message", "type", "param", "code"}}` (400 for a bad request, 404 for an unknown
model, 401 for a missing or wrong --api-key). Generation happens on the scheduler's worker
thread (samctl.scheduler: by default many requests at once on the batched engine); each
request's events cross to asyncio through `loop.call_soon_threadsafe` into its own
asyncio.Queue. A client that goes away cancels its job, which leaves at its next step.
samctl.openai_api turns a body into the scheduler's request and a result into a completion, for
this app and for `samctl generate --input` with OpenAI Batch API lines alike. At shutdown
(SIGTERM: uvicorn stops accepting and waits for the open requests) the scheduler finishes what it
was given, then stops; `stop_starting(app)`, called by `samctl serve`'s signal handler, first ends
a start-up still in progress, so that the requests waiting for it are refused (503) instead of
holding the shutdown.

Usage reports prompt, completion and total tokens, Predicted Outputs' accepted and rejected
prediction tokens (decode.metrics.PredictionUsage defines them) and the speculative metrics
under vLLM's names.
"""
from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from samctl.decode.loop import GenerationResult
from samctl.openai_api import (ChatChunk, ChatRequest, ChunkChoice, Completion, CompletionRequest, Delta, ModelCard,
                               ModelList, TextChoice, completion, invalid, job_request, new_id, now, usage_of)
from samctl.scheduler import BatchScheduler, Job, RequestError, Sessions

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class _Gone(Exception):
    """The client disconnected; its job is cancelled."""


class Counters:
    """Totals since start, for /metrics (updated on the event loop only)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # by outcome: stop, length, cancelled, error
        self.prompt_tokens = self.completion_tokens = 0
        self.steps = self.drafted = self.accepted = 0
        self.prediction_accepted = self.prediction_rejected = 0

    def finished(self, outcome: str, prompt_tokens: int = 0, result: GenerationResult | None = None) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1
        self.prompt_tokens += prompt_tokens
        if result is not None:
            m = result.metrics
            self.completion_tokens += m.new_tokens
            self.steps, self.drafted, self.accepted = self.steps + m.steps, self.drafted + m.drafted, self.accepted + m.accepted
            if result.prediction is not None:
                self.prediction_accepted += result.prediction.accepted
                self.prediction_rejected += result.prediction.rejected

    def prometheus(self, scheduler: BatchScheduler) -> str:
        # tokens per verify step: each step commits its accepted drafts plus one bonus token
        mean = 1.0 + self.accepted / self.steps if self.steps else 0.0
        lines = ["# HELP samctl_requests_total Requests finished, by outcome.",
                 "# TYPE samctl_requests_total counter"]
        lines += [f'samctl_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        for name, kind, value, text in (
            ("requests_running", "gauge", scheduler.running, "Requests generating now."),
            ("requests_waiting", "gauge", scheduler.waiting, "Requests queued."),
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of finished requests."),
            ("generation_tokens_total", "counter", self.completion_tokens, "Generated tokens."),
            ("spec_decode_num_drafts_total", "counter", self.steps, "Verify steps (target forwards after prefill)."),
            ("spec_decode_num_draft_tokens_total", "counter", self.drafted, "Draft tokens verified."),
            ("spec_decode_num_accepted_tokens_total", "counter", self.accepted, "Draft tokens accepted."),
            ("spec_decode_mean_acceptance_length", "gauge", round(mean, 4), "Tokens per verify step, bonus included."),
            ("prediction_accepted_tokens_total", "counter", self.prediction_accepted, "Accepted prediction tokens."),
            ("prediction_rejected_tokens_total", "counter", self.prediction_rejected, "Rejected prediction tokens."),
        ):
            lines += [f"# HELP samctl_{name} {text}", f"# TYPE samctl_{name} {kind}", f"samctl_{name} {value}"]
        return "\n".join(lines) + "\n"


def create_app(sessions: Any, *, scheduler: BatchScheduler | None = None, batch_size: int = 8,
               api_key: str | None = None) -> FastAPI:
    """The ASGI app over `sessions` (a Session, or a samctl.scheduler.Sessions of several stores);
    `scheduler` defaults to a BatchScheduler of `batch_size` rows, started with the app."""
    if not isinstance(sessions, Sessions):
        sessions = Sessions({sessions.config.store: sessions})
    counters = Counters()
    state: dict[str, Any] = {"scheduler": scheduler}
    stopping = threading.Event()  # set by stop_starting (SIGTERM)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state["scheduler"] is None:
            state["scheduler"] = BatchScheduler(sessions, batch_size)
        app.state.scheduler = state["scheduler"]
        if stopping.is_set():  # the signal came before the scheduler
            state["scheduler"].stop_starting()
        yield
        # uvicorn has waited for the open requests; a start-up still measuring stops (nobody waits
        # for it now), the worker finishes what it holds, then stops
        state["scheduler"].stop_starting()
        await asyncio.to_thread(state["scheduler"].close)

    app = FastAPI(title="samctl", lifespan=lifespan)
    created = now()

    # -- errors -------------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return _error(invalid(list(err.errors())))

    @app.exception_handler(_Gone)
    async def _gone(request: Request, err: _Gone) -> JSONResponse:  # nobody reads it: the client left
        return _error(RequestError("the client closed the request", status=499, code="client_closed"))

    @app.exception_handler(RequestError)
    async def _refused(request: Request, err: RequestError) -> JSONResponse:
        return _error(err)

    @app.middleware("http")
    async def _authorize(request: Request, call_next):
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(RequestError("missing or wrong API key: send 'Authorization: Bearer KEY'", status=401,
                                       code="invalid_api_key"))
        return await call_next(request)

    # -- endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> PlainTextResponse:
        scheduler = state["scheduler"]
        if scheduler is None or scheduler.starting:
            reason = scheduler.starting if scheduler is not None else "starting the worker"
            return PlainTextResponse(f"starting: {reason}", status_code=503, headers={"Retry-After": "1"})
        if stopping.is_set():
            return PlainTextResponse("stopping", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(counters.prometheus(state["scheduler"]), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=sessions.model_name, created=created)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _respond(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(body, request)

    # -- jobs ---------------------------------------------------------------------------------

    async def _respond(body: ChatRequest | CompletionRequest, request: Request):
        job, events, started = await _start(body, request)
        if body.stream:
            return _sse(_stream(body, job, events, started))
        text, result, reason = await _collect(job, events, started, request)
        return completion(body, sessions.model_name, text, started, result, reason)

    async def _start(body: ChatRequest | CompletionRequest, request: Request) -> tuple[Job, asyncio.Queue, int]:
        """Submit the job; wait until it has started (so that a refusal is still a plain JSON
        error, never half a stream). -> (job, its events, prompt tokens)."""
        wanted = job_request(body, sessions)  # a RequestError (404, 400) before anything is queued
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(event: tuple) -> None:  # worker thread -> this request's queue
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        job = Job(wanted, sessions, sink)
        state["scheduler"].submit(job)
        event = await _next(job, events, request)
        if event[0] == "error":
            counters.finished("error")
            raise event[1]
        return job, events, event[1]

    async def _next(job: Job, events: asyncio.Queue, request: Request) -> tuple:
        """The job's next event; a client that has gone cancels the job (_Gone)."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    counters.finished("cancelled")
                    raise _Gone() from None

    async def _collect(job: Job, events: asyncio.Queue, prompt_tokens: int, request: Request
                       ) -> tuple[str, GenerationResult, str]:
        parts = []
        while True:
            event = await _next(job, events, request)
            if event[0] == "text":
                parts.append(event[1])
            elif event[0] == "done":
                counters.finished(event[2], prompt_tokens, event[1])
                return "".join(parts), event[1], event[2]
            elif event[0] == "error":
                counters.finished("error")
                raise event[1]
            else:  # cancelled
                raise _Gone()

    async def _events(job: Job, events: asyncio.Queue, prompt_tokens: int) -> AsyncIterator[tuple]:
        """A streaming job's events until its end; the client leaving (the response task is
        cancelled) cancels the job."""
        done = False
        try:
            while True:
                event = await events.get()
                if event[0] == "done":
                    done = True
                    counters.finished(event[2], prompt_tokens, event[1])
                elif event[0] == "error":
                    done = True
                    counters.finished("error")
                elif event[0] == "cancelled":
                    return
                yield event
                if done:
                    return
        finally:
            if not done:
                job.cancel()
                counters.finished("cancelled")

    async def _stream(body: ChatRequest | CompletionRequest, job: Job, events: asyncio.Queue,
                      prompt_tokens: int) -> AsyncIterator[str]:
        """SSE: a chat request's deltas (after one that opens the assistant's turn) or a completion's
        text pieces, then the finish reason, the usage when asked for, and [DONE]."""
        chat, created_at = isinstance(body, ChatRequest), now()
        rid = new_id("chatcmpl" if chat else "cmpl")

        def chunk(text: str | None, reason: str | None = None, usage: Any = None) -> str:
            if chat:
                choices = [ChunkChoice(delta=Delta(content=text), finish_reason=reason)]
            else:
                choices = [TextChoice(text=text or "", finish_reason=reason)]
            shape = ChatChunk if chat else Completion
            return _data(shape(id=rid, created=created_at, model=sessions.model_name,
                               choices=[] if usage else choices, usage=usage))

        if chat:
            yield _data(ChatChunk(id=rid, created=created_at, model=sessions.model_name,
                                  choices=[ChunkChoice(delta=Delta(role="assistant", content=""))]))
        async for event in _events(job, events, prompt_tokens):
            if event[0] == "text":
                yield chunk(event[1])
            elif event[0] == "error":
                yield f"data: {json.dumps(event[1].body())}\n\n"
            else:
                yield chunk(None, event[2])
                if body.include_usage():
                    yield chunk(None, usage=usage_of(prompt_tokens, event[1]))
        yield "data: [DONE]\n\n"

    def _stop_starting() -> None:
        stopping.set()
        if state["scheduler"] is not None:
            state["scheduler"].stop_starting()

    app.state.sessions, app.state.counters, app.state.stop_starting = sessions, counters, _stop_starting
    return app


def stop_starting(app: FastAPI) -> None:
    """The server is shutting down (SIGTERM; safe from a signal handler): /health says so, and a
    start-up still in progress ends at its next forward, the requests waiting for it refused (503)
    so that they do not hold uvicorn's wait for open requests."""
    app.state.stop_starting()


def _error(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _data(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
