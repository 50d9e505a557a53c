"""OpenAI's request and response shapes as pydantic models, and what lies between a body and the
scheduler (`job_request`, `Reply`, `invalid`), shared by the server and `samctl generate --input`
with OpenAI Batch API lines.

Fields OpenAI defines and samctl does not implement are refused unless at their default (`n` > 1,
`logprobs`), so a client never gets silently less than it asked for; unknown fields are ignored,
as vLLM does. samctl's own fields (`method`, `store`, `top_k`) ride beside OpenAI's, as the openai
client's `extra_body` sends them.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer

if TYPE_CHECKING:  # the scheduler loads torch; the schemas alone do not
    from samctl.decode.loop import GenerationResult
    from samctl.scheduler import Cancelled, Done, Event, Failed, Request, RequestError, Sessions


def _refuse(message: str, bad: Callable[[Any], bool]) -> AfterValidator:
    """A field check: a 400 naming the field, saying `message`, when bad(value)."""
    def check(value: Any) -> Any:
        if bad(value):
            raise ValueError(message)
        return value
    return AfterValidator(check)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """Predicted Outputs: the expected output (e.g. the file being edited)."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


_NO_PENALTY = _refuse("penalties are not supported (lossless decoding keeps the model's distribution): send 0 or "
                      "leave it out", bool)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Annotated[str | list[str] | None,
                    _refuse("at most 4 stop sequences", lambda stop: isinstance(stop, list) and len(stop) > 4)] = None
    n: Annotated[int, _refuse("only n = 1 is supported: send one request per choice", lambda n: n != 1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prediction: Prediction | None = None
    # accepted at their neutral values only: anything else would change the answer, and is not done
    frequency_penalty: Annotated[float | None, _NO_PENALTY] = None
    presence_penalty: Annotated[float | None, _NO_PENALTY] = None
    logit_bias: Annotated[dict[str, float] | None, _refuse("logit_bias is not supported: leave it out", bool)] = None
    response_format: Annotated[dict[str, Any] | None, _refuse(
        "only {\"type\": \"text\"} is supported (no JSON mode or schemas)",
        lambda f: f is not None and f.get("type") != "text")] = None
    # samctl's own
    method: str | None = None
    speculation: Literal["on", "off"] = "on"  # off: plain decoding for this request (method ar)
    store: str | None = None
    top_k: int | None = Field(default=None, ge=0)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_turn(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Annotated[bool | None, _refuse("logprobs are not supported", bool)] = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: Annotated[str | list[int] | list[str], _refuse(
        "one prompt per request: send one request per prompt",
        lambda prompt: isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str),
    )] = Field(min_length=1)
    logprobs: Annotated[int | None, _refuse("not supported", bool)] = None
    echo: Annotated[bool, _refuse("not supported", bool)] = False

    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# -- responses ----------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails
    # speculative decoding, under vLLM's names
    mean_acceptance_length: float  # tokens committed per verify step, bonus included
    draft_acceptance_rate: float  # accepted draft tokens / draft tokens
    num_spec_steps: int  # verify steps (target forwards after the prefill)
    num_draft_tokens: int
    num_accepted_draft_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A chunk's increment; fields it does not carry are left out, as OpenAI sends them
    (`{"role": "assistant", "content": ""}` first, then `{"content": ...}`, `{}` last)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class TextChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    """A text completion, and also each chunk of a streamed one (OpenAI uses the one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "samctl"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# -- OpenAI Batch API lines (`samctl generate --input`, as `vllm run-batch` reads them) -----------


class BatchLine(BaseModel):
    """One input line: `{"custom_id", "method": "POST", "url", "body"}`."""

    model_config = ConfigDict(extra="ignore")

    custom_id: str
    method: Literal["POST"]
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]

    def request(self) -> ChatRequest | CompletionRequest:
        """The body, validated by the endpoint's schema (pydantic's ValidationError if bad)."""
        schema = ChatRequest if self.url == "/v1/chat/completions" else CompletionRequest
        return schema.model_validate(self.body)


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: ChatCompletion | Completion | None = None


class BatchOutputLine(BaseModel):
    """One output line: the response (status 200 and the completion the server returns), or the
    status and `error` (OpenAI's error object) of a refused or failed request."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: dict[str, Any] | None = None


def is_batch_line(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "custom_id" in record and "body" in record


# -- between a body and the scheduler -----------------------------------------------------------


def invalid(errors: list[dict[str, Any]]) -> "RequestError":
    """pydantic's errors (the first is reported) -> a 400 naming the field."""
    from samctl.scheduler import RequestError

    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return RequestError(f"the body is not valid JSON: {first.get('msg', '')}")
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return RequestError(f"{'.'.join(loc) or 'body'}: {message}", param=".".join(loc) or None, code=first.get("type"))


def job_request(body: ChatRequest | CompletionRequest, sessions: "Sessions") -> "Request":
    """The scheduler's Request of a validated body: the model must be the one served (404), the
    store and method known (400); sampling fields the body leaves out take the session's."""
    from dataclasses import replace

    from samctl.index.errors import UserError
    from samctl.scheduler import Request, RequestError, request_error

    if body.model != sessions.model_name:
        raise RequestError(f"model {body.model!r} is not served here: this server has {sessions.model_name!r}",
                           status=404, param="model", code="model_not_found")
    if body.speculation == "off" and body.method not in (None, "ar"):
        raise RequestError(f"speculation off and method {body.method!r} contradict each other: send one of them",
                           param="speculation")
    store, method = sessions.check(body.store, "ar" if body.speculation == "off" else body.method)
    default = sessions.by_store[store].config.sampling
    given = {k: v for k in ("temperature", "top_k", "top_p", "seed") if (v := getattr(body, k)) is not None}
    try:
        sampling = replace(default, **given)
    except UserError as err:  # a sampling field of the body
        raise request_error(err, word=str) from err
    prompt = [m.as_turn() for m in body.messages] if isinstance(body, ChatRequest) else body.prompt_input()
    return Request(prompt=prompt, store=store, method=method, max_new_tokens=body.token_limit(), sampling=sampling,
                   prediction=body.prediction.text() if body.prediction else None, stop=body.stops())


def usage_of(prompt_tokens: int, result: "GenerationResult") -> Usage:
    m, p = result.metrics, result.prediction
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=m.new_tokens, total_tokens=prompt_tokens + m.new_tokens,
        completion_tokens_details=CompletionTokensDetails(accepted_prediction_tokens=p.accepted if p else 0,
                                                          rejected_prediction_tokens=p.rejected if p else 0),
        mean_acceptance_length=round(1.0 + m.accepted / m.steps, 4) if m.steps else 1.0,
        draft_acceptance_rate=round(m.acceptance_rate, 4), num_spec_steps=m.steps, num_draft_tokens=m.drafted,
        num_accepted_draft_tokens=m.accepted)


class Reply:
    """One request's events as OpenAI's bodies, for a stream, a plain response and a Batch line:
    `add` returns the stream chunks an event makes; once the request has ended, `completion` is
    the plain body, or raises the request's error."""

    def __init__(self, body: ChatRequest | CompletionRequest, model: str) -> None:
        self.body, self.model, self.chat = body, model, isinstance(body, ChatRequest)
        self.id, self.created = new_id("chatcmpl" if self.chat else "cmpl"), now()
        self.prompt_tokens, self.parts = 0, []
        self.end: Done | Failed | Cancelled | None = None

    def add(self, event: "Event") -> list[BaseModel | dict[str, Any]]:
        from samctl.scheduler import ENDS, Done, Failed, Started, Text

        if isinstance(event, ENDS):
            self.end = event
        match event:
            case Started(prompt_tokens):
                self.prompt_tokens = prompt_tokens
                return [self._chunk(None, role="assistant")] if self.chat else []
            case Text(text):
                self.parts.append(text)
                return [self._chunk(text)]
            case Done(result, reason):
                options = self.body.stream_options
                usage = usage_of(self.prompt_tokens, result) if options and options.include_usage else None
                return [self._chunk(None, reason)] + ([self._chunk(None, usage=usage)] if usage else [])
            case Failed(error):
                return [error.body()]
        return []

    def completion(self) -> ChatCompletion | Completion:
        from samctl.scheduler import Failed

        if isinstance(self.end, Failed):
            raise self.end.error
        text, reason = "".join(self.parts), self.end.reason
        if self.chat:
            choice, shape = ChatChoice(message=AssistantMessage(content=text), finish_reason=reason), ChatCompletion
        else:
            choice, shape = TextChoice(text=text, finish_reason=reason), Completion
        return shape(id=self.id, created=self.created, model=self.model, choices=[choice],
                     usage=usage_of(self.prompt_tokens, self.end.result))

    def _chunk(self, text: str | None, reason: str | None = None, usage: Usage | None = None,
               role: str | None = None) -> ChatChunk | Completion:
        if self.chat:
            choice = ChunkChoice(delta=Delta(role=role, content="" if role else text), finish_reason=reason)
        else:
            choice = TextChoice(text=text or "", finish_reason=reason)
        return (ChatChunk if self.chat else Completion)(id=self.id, created=self.created, model=self.model,
                                                        choices=[] if usage else [choice], usage=usage)
