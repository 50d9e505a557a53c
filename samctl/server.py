"""`samctl serve`'s ASGI app: OpenAI-compatible endpoints over Sessions, with Predicted Outputs.

    POST /v1/chat/completions   messages -> the chat template -> generate (streamed as SSE or not)
    POST /v1/completions        prompt text or token ids -> generate
    GET  /v1/models             the one model served
    GET  /health                200 "ok" once the engine can serve; 503 "starting: ..." before
                                (its verify cost is being read or measured), 503 when stopping
    GET  /metrics               Prometheus text: requests, tokens, draft and accepted tokens

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`. Each request's events
cross from the scheduler's worker thread into its own asyncio.Queue; a client that goes away
cancels its job. The routes read `request.app.state`, which `create_app` fills.
"""
from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from samctl.openai_api import ChatRequest, CompletionRequest, ModelCard, ModelList, Reply, invalid, job_request, now
from samctl.scheduler import ENDS, BatchScheduler, Cancelled, Done, Event, Failed, Job, RequestError, Sessions

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
routes = APIRouter()


class _Gone(Exception):
    """The client disconnected; its job is cancelled."""


class Counters:
    """Totals since start, for /metrics (updated on the event loop only)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # by outcome: stop, length, cancelled, error
        self.prompt_tokens = self.completion_tokens = 0
        self.steps = self.drafted = self.accepted = 0
        self.prediction_accepted = self.prediction_rejected = 0

    def finished(self, end: Done | Failed | Cancelled, prompt_tokens: int = 0) -> None:
        outcome = end.reason if isinstance(end, Done) else "error" if isinstance(end, Failed) else "cancelled"
        self.requests[outcome] = self.requests.get(outcome, 0) + 1
        if isinstance(end, Done):  # a request that failed or was cancelled counts no tokens
            self.prompt_tokens += prompt_tokens
            m, prediction = end.result.metrics, end.result.prediction
            self.completion_tokens += m.new_tokens
            self.steps, self.drafted, self.accepted = self.steps + m.steps, self.drafted + m.drafted, self.accepted + m.accepted
            if prediction is not None:
                self.prediction_accepted += prediction.accepted
                self.prediction_rejected += prediction.rejected

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


def create_app(sessions: Any, *, batch_size: int = 8, api_key: str | None = None) -> FastAPI:
    """`sessions`: a Session, or a samctl.scheduler.Sessions of several stores, served by a
    BatchScheduler of `batch_size` rows started with the app."""
    if not isinstance(sessions, Sessions):
        sessions = Sessions({sessions.config.store: sessions})
    app = FastAPI(title="samctl", lifespan=_lifespan)
    app.state.sessions, app.state.scheduler, app.state.batch_size = sessions, None, batch_size
    app.state.api_key, app.state.counters, app.state.created = api_key, Counters(), now()
    app.state.stopping = threading.Event()  # set by stop_starting (SIGTERM)
    app.include_router(routes)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(RequestError, _error)
    app.add_exception_handler(_Gone, _gone)
    app.middleware("http")(_authorize)
    return app


def stop_starting(app: FastAPI) -> None:
    """SIGTERM (safe from a signal handler): /health says so, and a start-up still in progress ends,
    the requests waiting for it refused (503) so that they do not hold uvicorn's shutdown."""
    app.state.stopping.set()
    if app.state.scheduler is not None:
        app.state.scheduler.stop_starting()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    if state.scheduler is None:
        state.scheduler = BatchScheduler(state.sessions, state.batch_size)
    if state.stopping.is_set():  # the signal came before the scheduler
        state.scheduler.stop_starting()
    yield
    # uvicorn has waited for the open requests; a start-up still measuring stops (nobody waits for
    # it now), the worker finishes what it holds, then stops
    state.scheduler.stop_starting()
    await asyncio.to_thread(state.scheduler.close)


def _error(request: Request | None, err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    return _error(request, invalid(list(err.errors())))


async def _gone(request: Request, err: _Gone) -> JSONResponse:  # nobody reads it: the client left
    return _error(request, RequestError("the client closed the request", status=499, code="client_closed"))


async def _authorize(request: Request, call_next):
    api_key = request.app.state.api_key
    # /health stays open: load balancers and orchestrators probe it without credentials
    if (api_key is not None and request.url.path != "/health"
            and request.headers.get("authorization") != f"Bearer {api_key}"):
        return _error(request, RequestError("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                            status=401, code="invalid_api_key"))
    return await call_next(request)


@routes.get("/health")
async def health(request: Request) -> PlainTextResponse:
    state = request.app.state
    if state.scheduler is None or state.scheduler.starting:
        reason = state.scheduler.starting if state.scheduler is not None else "starting the worker"
        return PlainTextResponse(f"starting: {reason}", status_code=503, headers={"Retry-After": "1"})
    if state.stopping.is_set():
        return PlainTextResponse("stopping", status_code=503)
    return PlainTextResponse("ok")


@routes.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    counters, scheduler = request.app.state.counters, request.app.state.scheduler
    return PlainTextResponse(counters.prometheus(scheduler), media_type="text/plain; version=0.0.4")


@routes.get("/v1/models")
async def models(request: Request) -> ModelList:
    return ModelList(data=[ModelCard(id=request.app.state.sessions.model_name, created=request.app.state.created)])


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    return await _respond(body, request)


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await _respond(body, request)


async def _respond(body: ChatRequest | CompletionRequest, request: Request):
    """Submit the job and wait until it has started (so that a refusal is still a plain JSON
    error, never half a stream); then stream its events, or collect them into the completion."""
    state = request.app.state
    wanted = job_request(body, state.sessions)  # a RequestError (404, 400) before anything is queued
    loop, events = asyncio.get_running_loop(), asyncio.Queue()

    def sink(event: Event) -> None:  # worker thread -> this request's queue
        with suppress(RuntimeError):  # a closed loop: nobody is listening any more
            loop.call_soon_threadsafe(events.put_nowait, event)

    job, reply = Job(wanted, state.sessions, sink), Reply(body, state.sessions.model_name)
    state.scheduler.submit(job)
    event = await _next(job, events, request)
    opening = reply.add(event)
    if isinstance(event, Failed):
        state.counters.finished(event)
        raise event.error
    if body.stream:
        return StreamingResponse(_stream(reply, opening, job, events, state.counters), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    while not isinstance(event, ENDS):
        event = await _next(job, events, request)
        reply.add(event)
    if isinstance(event, Cancelled):
        raise _Gone()
    state.counters.finished(event, reply.prompt_tokens)
    return reply.completion()  # a Failed raises its RequestError


async def _next(job: Job, events: asyncio.Queue, request: Request) -> Event:
    """The job's next event; a client that has gone cancels the job (_Gone)."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                request.app.state.counters.finished(Cancelled())
                raise _Gone() from None


async def _stream(reply: Reply, opening: list, job: Job, events: asyncio.Queue, counters: Counters
                  ) -> AsyncIterator[str]:
    """SSE chunks, then [DONE]. The client leaving (the response task is cancelled) cancels the job."""
    end = None
    try:
        for chunk in opening:
            yield _data(chunk)
        while end is None:
            event = await events.get()
            if isinstance(event, Cancelled):
                return
            if isinstance(event, ENDS):
                end = event
                counters.finished(end, reply.prompt_tokens)
            for chunk in reply.add(event):
                yield _data(chunk)
        yield "data: [DONE]\n\n"
    finally:
        if end is None:
            job.cancel()
            counters.finished(Cancelled())


def _data(chunk: Any) -> str:
    return f"data: {json.dumps(chunk) if isinstance(chunk, dict) else chunk.model_dump_json()}\n\n"
