"""`samctl serve`: the OpenAI-compatible app on a live local server (uvicorn in a thread, a free
port, the batched engine), driven by the official openai client and httpx. Greedy answers through
the server equal `samctl generate` and plain decoding token for token, also with 16 clients at
once; Predicted Outputs counts are consistent; bad requests get OpenAI's error body and the server
goes on serving; a client that leaves mid-stream frees its slot."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from samctl.decode.drafters.base import NoDraft  # noqa: E402
from samctl.decode.loop import GenerationResult  # noqa: E402
from samctl.decode.metrics import Metrics  # noqa: E402
from samctl.decode.sampling import SamplingConfig  # noqa: E402
from samctl.scheduler import (BatchScheduler, Cancelled, Done, Failed, Job, Request as JobRequest,  # noqa: E402
                              Sessions, Started, StopCut, Text)
from samctl.server import create_app  # noqa: E402
from samctl.session import Session, SessionConfig  # noqa: E402

QUESTION = [{"role": "user", "content": "def add(a, b):"}]


def _serve(app, ready: bool = True) -> tuple:
    """(uvicorn server, base URL) of `app` on a free local port, served by a thread; with `ready`,
    once /health says the engine can serve."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.thread = threading.Thread(target=server.run, daemon=True)
    server.thread.start()
    while not server.started:
        assert server.thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    while ready and httpx.get(f"{url}/health").status_code == 503:
        time.sleep(0.05)
    return server, url


def _listens(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.fixture(scope="module")
def served(model_dir):
    """(session, base URL, client, app) of a server on a free local port, 4 rows in its batch."""
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=24, threads=1, quiet=True))
    app = create_app(session, batch_size=4)
    server, url = _serve(app)
    with httpx.Client(base_url=url, timeout=120) as client:
        yield session, url, client, app
    server.should_exit = True
    server.thread.join(60)


def openai_client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def plain(session, messages=None, ids=None):
    """Plain greedy decoding's answer (tokens), run while the server is idle."""
    if ids is None:
        ids = session.engine.encode_conversation(messages, chat=True)
    return session.generate(ids, drafter=NoDraft()).tokens


def body(session, **fields):
    return {"model": session.engine.name, "messages": QUESTION, **fields}


def sse(response) -> list:
    """The data lines of a server-sent event stream, JSON decoded ([DONE] kept as text)."""
    events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_models_health_and_metrics(served):
    session, _, client, _ = served
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [session.engine.name]
    text = client.get("/metrics").text
    for name in ("samctl_requests_running", "samctl_generation_tokens_total", "samctl_spec_decode_num_draft_tokens_total",
                 "samctl_spec_decode_num_accepted_tokens_total", "samctl_spec_decode_mean_acceptance_length"):
        assert f"\n{name} " in text


def test_greedy_chat_equals_samctl_generate_streamed_or_not(served, model_dir):
    from tests.test_cli_generate import samctl

    session, url, _, _ = served
    proc = samctl("generate", "--model", str(model_dir), "--prompt", QUESTION[0]["content"], "--chat", "--json",
                  "--max-new-tokens", "24", "--threads", "1", "--quiet")
    assert proc.returncode == 0, proc.stderr
    expected = json.loads(proc.stdout)["text"]
    plain_tokens = plain(session, QUESTION)
    assert expected == session.decode(plain_tokens)
    client = openai_client(url)
    answer = client.chat.completions.create(model=session.engine.name, messages=QUESTION)
    assert answer.object == "chat.completion" and answer.choices[0].message.content == expected
    usage = answer.usage
    assert usage.completion_tokens == len(plain_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # drafts were accepted (the answer repeats itself): equality shows verification at work
    assert 0 < usage.model_extra["num_accepted_draft_tokens"] <= usage.model_extra["num_draft_tokens"]
    assert usage.model_extra["mean_acceptance_length"] > 1.0

    chunks = list(client.chat.completions.create(model=session.engine.name, messages=QUESTION, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(plain_tokens)
    other = client.chat.completions.create(model=session.engine.name, messages=QUESTION, extra_body={"method": "pld"})
    assert other.choices[0].message.content == expected  # another method, the same answer


def test_text_completions_from_text_or_token_ids(served):
    session, _, client, _ = served
    ids = session.engine.encode("The quick brown fox", chat=False)
    expected = session.decode(plain(session, ids=ids))
    for prompt in ("The quick brown fox", ids):
        answer = client.post("/v1/completions", json={"model": session.engine.name, "prompt": prompt}).json()
        assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == expected
    with client.stream("POST", "/v1/completions", json={"model": session.engine.name, "prompt": ids,
                                                        "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    assert events[-1] == "[DONE]" and all(e["usage"] is None for e in events[:-1])  # no usage unless asked
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected


def test_sixteen_concurrent_clients_each_get_their_sequential_answer(served):
    """16 threads on a 4-row batch: streaming and not, long and short answers, two of them
    sampled; every greedy answer equals its own plain decoding."""
    session, url, _, app = served
    words = ["def add(a, b):", "The quick brown fox", "Summarize the document.", "The dog sleeps.",
             "return a + b", "The answer is in", "jumps over the lazy dog", "def f(x):"]
    questions = [[{"role": "user", "content": words[i % 8] + " " * (i // 8)}] for i in range(16)]
    limits = [24 if i % 3 else 7 for i in range(16)]
    expected = [session.decode(plain(session, q)[:n]) for q, n in zip(questions, limits)]
    sampled = {5, 10}
    client = openai_client(url)
    answers: list = [None] * 16

    def ask(i: int) -> None:
        extra = {"temperature": 0.8, "seed": i} if i in sampled else {}
        if i % 2:
            stream = client.chat.completions.create(model=session.engine.name, messages=questions[i],
                                                    max_tokens=limits[i], stream=True, **extra)
            answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            answer = client.chat.completions.create(model=session.engine.name, messages=questions[i],
                                                    max_tokens=limits[i], **extra)
            answers[i] = answer.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(isinstance(a, str) for a in answers)
    assert max(app.state.scheduler._run.stats.rows_per_step) > 1  # they did share steps
    assert [a for i, a in enumerate(answers) if i not in sampled] == \
        [e for i, e in enumerate(expected) if i not in sampled]


# A text completion whose greedy answer survives the tiny tokenizer's decode -> encode (asserted),
# so that a prediction of its text is token for token the answer.
PREDICTED = "The"


def _client(session, batch_size: int):
    from fastapi.testclient import TestClient

    return TestClient(create_app(session, batch_size=batch_size))


def test_usage_maps_prediction_counts_to_accepted_and_rejected():
    from samctl.decode.drafters.adaptive import PredictionCount
    from samctl.decode.metrics import PredictionUsage
    from samctl.openai_api import usage_of
    from samctl.server import Counters

    # a tree of 3 nodes, root children 0 and 1, node 2 under 0; positions 4, 5 and 6 of the
    # prediction; the step accepted node 0 then node 2: 4 and 6 accepted, 5 drafted and rejected
    count = PredictionCount(8)
    count.add(np.array([4, 5, 6], np.int32), np.array([10, 11, 12]), np.array([-1, -1, 0], np.int32),
              np.array([10, 12]))
    assert count.usage() == PredictionUsage(tokens=8, accepted=2, rejected=1)
    result = GenerationResult([10, 12, 13], "length", Metrics(new_tokens=3, steps=1, accepted=2, drafted=3),
                              PredictionUsage(tokens=8, accepted=2, rejected=1))
    usage = usage_of(5, result)
    assert usage.completion_tokens_details.model_dump() == {"accepted_prediction_tokens": 2,
                                                            "rejected_prediction_tokens": 1}
    counters = Counters()
    counters.finished(Done(result, "length"), 5)
    assert (counters.prediction_accepted, counters.prediction_rejected) == (2, 1)


def test_the_events_make_one_answer_streamed_plain_and_in_a_batch_file():
    """One event sequence through the three consumers: the streamed chunks, the plain completion
    and the OpenAI Batch line carry the same text, finish reason and usage; a failure is the same
    error in all three."""
    from samctl.decode.metrics import PredictionUsage
    from samctl.openai_api import ChatRequest, CompletionRequest, Reply
    from samctl.records import _BatchRequest
    from samctl.scheduler import RequestError

    result = GenerationResult([1, 2, 3], "eos", Metrics(new_tokens=3, steps=2, accepted=1, drafted=4),
                              PredictionUsage(tokens=5, accepted=1, rejected=2))
    events = [Started(7), Text("He"), Text("llo"), Done(result, "stop")]
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    for body in (ChatRequest(model="m", messages=QUESTION, **usage), CompletionRequest(model="m", prompt="x", **usage)):
        streamed, plain, batch = Reply(body, "m"), Reply(body, "m"), _BatchRequest("c1", body, "m")
        chunks = [c.model_dump() for e in events for c in streamed.add(e)]
        for event in events:
            plain.add(event)
            batch.sink(event)
        answer = plain.completion().model_dump()
        line, failed, tokens = batch.result()
        line = json.loads(line)
        assert not failed and tokens == 3 and line["custom_id"] == "c1" and line["response"]["status_code"] == 200
        assert {k: v for k, v in line["response"]["body"].items() if k not in ("id", "created")} == \
            {k: v for k, v in answer.items() if k not in ("id", "created")}
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join((c["delta"].get("content") or "") if "delta" in c else c["text"] for c in choices)
        choice = answer["choices"][0]
        assert text == choice.get("text", choice.get("message", {}).get("content")) == "Hello"
        assert choices[-1]["finish_reason"] == choice["finish_reason"] == "stop"
        assert chunks[-1]["usage"] == answer["usage"] and answer["usage"]["prompt_tokens"] == 7
        assert answer["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 1,
                                                                "rejected_prediction_tokens": 2}
    refused = RequestError("the prompt is empty", param="prompt")
    streamed, plain, batch = Reply(body, "m"), Reply(body, "m"), _BatchRequest("c2", body, "m")
    assert streamed.add(Failed(refused)) == [refused.body()]
    plain.add(Failed(refused))
    batch.sink(Failed(refused))
    with pytest.raises(RequestError):
        plain.completion()
    line, failed, _ = batch.result()
    assert failed and json.loads(line)["error"] == refused.body()["error"]


def test_prediction_counts_at_batch_one_and_batched(served):
    """A prediction that is the answer itself: every accepted draft comes from it, so
    accepted_prediction_tokens equals num_accepted_draft_tokens (the last step included) and none
    is rejected, at batch 1 and on the batched engine alike; a prediction right for half of the
    answer then wrong: both counts positive. The answer never changes."""
    session = served[0].for_method("adaptive", settings={"memory": 0})  # only the prediction differs
    tokens = plain(session, ids=session.engine.encode(PREDICTED, chat=False))
    expected = session.decode(tokens)
    assert session.prediction_ids(expected) == tokens  # the prediction is the answer, token for token
    half = session.decode(tokens[: len(tokens) // 2]) + " The quick brown fox jumps over the lazy dog."
    usages = {}
    for batch_size in (1, 2):
        with _client(session, batch_size) as client:
            for name, prediction in (("none", None), ("right", expected), ("half", half)):
                fields = {} if prediction is None else {"prediction": {"type": "content", "content": prediction}}
                answer = client.post("/v1/completions", json={"model": session.engine.name, "prompt": PREDICTED,
                                                              **fields}).json()
                assert answer["choices"][0]["text"] == expected
                usages[batch_size, name] = answer["usage"]
    for batch_size in (1, 2):
        none, right, half_right = (usages[batch_size, name] for name in ("none", "right", "half"))
        assert none["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
        assert right["num_accepted_draft_tokens"] >= none["num_accepted_draft_tokens"]
        assert right["completion_tokens_details"] == {
            "accepted_prediction_tokens": right["num_accepted_draft_tokens"], "rejected_prediction_tokens": 0}
        details = half_right["completion_tokens_details"]
        assert 0 < details["accepted_prediction_tokens"] < len(tokens) // 2
        assert details["rejected_prediction_tokens"] > 0  # its wrong half was drafted
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] <= \
            len(session.prediction_ids(half))
    # the batched engine takes other steps than batch 1, so its counts differ exactly as its
    # accepted drafts do
    one, batched = usages[1, "right"], usages[2, "right"]
    assert batched["completion_tokens_details"]["accepted_prediction_tokens"] - \
        one["completion_tokens_details"]["accepted_prediction_tokens"] == \
        batched["num_accepted_draft_tokens"] - one["num_accepted_draft_tokens"]


def _stop_index(session, tokens: list[int], stop: str) -> int:
    """How many tokens the answer has when it ends at `stop`: the first prefix whose text holds it."""
    return next(k for k in range(1, len(tokens) + 1) if stop in session.decode(tokens[:k]))


@pytest.mark.parametrize("batch_size", [1, 4])
def test_stop_strings_end_the_answer_and_its_tokens(served, batch_size):
    """The text is cut before the stop string, and generation ends with the token that completed
    it: completion_tokens counts up to that token, never on to max_tokens nor to the end of the
    step that committed it."""
    session = served[0]
    tokens = plain(session, QUESTION)
    expected = session.decode(tokens)
    stop = "my"
    at = _stop_index(session, tokens, stop)
    assert at < len(tokens) - 2
    with _client(session, batch_size) as client:
        answer = client.post("/v1/chat/completions", json=body(session, stop=[stop])).json()
        with client.stream("POST", "/v1/chat/completions", json=body(
                session, stop=stop, stream=True, stream_options={"include_usage": True})) as response:
            events = sse(response)
    assert answer["choices"][0]["message"]["content"] == expected[:expected.index(stop)]
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == at
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert streamed == expected[:expected.index(stop)]
    assert events[-2]["usage"]["completion_tokens"] == at


def test_every_response_teaches_the_one_cross_request_memory(model_dir):
    """Four rows at once: every response joins the session's memory, which the rows' drafters and
    the kept one (batch 1's) hold as one object, not one copy each."""
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=8, threads=1, quiet=True))
    scheduler = BatchScheduler(Sessions({None: session}), batch_size=4)
    events: list[list] = [[] for _ in range(4)]
    with scheduler._cond:  # the worker takes them all before its first step: one batch
        for i, text in enumerate(("def add(a, b):", "The quick brown fox", "The dog sleeps.", "def f(x):")):
            scheduler.submit(Job(JobRequest(prompt=text, store=None, method="adaptive"), scheduler.sessions,
                                 events[i].append))
    scheduler.close()
    assert scheduler._run.stats.rows_per_step[0] == 4
    outputs = [e[-1].result.tokens for e in events]
    assert sorted(d.tolist() for d in session.drafter.memory_documents()) == sorted(outputs)
    rows = next(iter(scheduler._drafters.values())).idle
    assert len(rows) == 4 and {id(d.memory) for d in rows + [session.drafter]} == {id(session.drafter.memory)}


def test_the_batch_gets_each_requests_sampling(model_dir, monkeypatch):
    """A spy on the batched engine's submit: the config a request's row runs with is the request's
    (temperature, top_p, seed, max_tokens; top_k and EOS the session's)."""
    from fastapi.testclient import TestClient

    from samctl.decode.loop import BatchRun
    from samctl.decode.loop import GenerationConfig

    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=24, threads=1, quiet=True,
                                    sampling=SamplingConfig(top_k=7)))
    session.warm = session.batch_warm = True  # no warm-up runs at start: the spy sees the requests alone
    seen, submit = [], BatchRun.submit
    monkeypatch.setattr(BatchRun, "submit", lambda self, key, prompt, config, pool, **kw:
                        seen.append(config) or submit(self, key, prompt, config, pool, **kw))
    with TestClient(create_app(session, batch_size=2)) as client:
        for fields in ({"temperature": 0.7, "top_p": 0.9, "seed": 5, "max_tokens": 6}, {"max_tokens": 5}):
            assert client.post("/v1/chat/completions", json=body(session, **fields)).status_code == 200
    eos = session.engine.eos_token_ids
    assert seen == [GenerationConfig(6, eos, SamplingConfig(temperature=0.7, top_k=7, top_p=0.9, seed=5)),
                    GenerationConfig(5, eos, SamplingConfig(top_k=7))]


def test_draft_model_requests_share_the_draft_batch_and_answer_as_alone():
    """Four `sd` requests at once on the embedded target and draft: one batch, its rows drafting as
    rows of the draft's own batch (one draft forward a round), each answer its plain greedy one."""
    session = Session(SessionConfig(method="sd", max_new_tokens=24, threads=1, quiet=True))
    prompts = ("def add(a, b):", "The quick brown fox", "Summarize: the cat sat on the mat.", "import os\n")
    expected = [session.generate(p, drafter=NoDraft()).tokens for p in prompts]
    scheduler = BatchScheduler(Sessions({None: session}), batch_size=4)
    events: list[list] = [[] for _ in prompts]
    with scheduler._cond:  # the worker takes them all before its first step: one batch
        for prompt, sink in zip(prompts, events):
            scheduler.submit(Job(JobRequest(prompt=prompt, store=None, method="sd"), scheduler.sessions, sink.append))
    scheduler.close()
    assert scheduler._run.stats.rows_per_step[0] == 4
    assert [e[-1].result.tokens for e in events] == expected
    drafters = next(iter(scheduler._drafters.values())).idle
    assert len({id(d.draft.rows) for d in drafters}) == 1 and len({d.draft.row for d in drafters}) == 4


def test_a_request_without_a_batched_form_steps_between_the_batch_steps(tmp_path):
    """SDSAT drafts with the target's own forward, so its request runs as a one-row run of its own,
    one step of it between two steps of the batch: the two answers stream side by side, neither
    waits for the other's end, and each is its plain greedy answer."""
    from tests.conftest import save_tiny_model_with_tokenizer

    save_tiny_model_with_tokenizer(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sdsat"] = {"sat_token_id": config["vocab_size"] - 1, "sat_count": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    session = Session(SessionConfig(model=str(tmp_path), max_new_tokens=20, threads=1, quiet=True))
    session.warm = session.batch_warm = True
    expected = session.decode(session.generate("def add(a, b):", drafter=NoDraft()).tokens)
    scheduler = BatchScheduler(Sessions({None: session}), batch_size=4)
    timeline: list[tuple[str, object]] = []
    with scheduler._cond:  # the worker takes both before its first step
        for method in ("adaptive", "sdsat"):
            scheduler.submit(Job(JobRequest(prompt="def add(a, b):", store=None, method=method), scheduler.sessions,
                                 lambda event, method=method: timeline.append((method, event))))
    scheduler.close()
    for method, other in (("adaptive", "sdsat"), ("sdsat", "adaptive")):
        mine = [i for i, (m, e) in enumerate(timeline) if m == method and isinstance(e, Text)]
        done = next(i for i, (m, e) in enumerate(timeline) if m == other and isinstance(e, Done))
        assert mine and mine[0] < done, (method, [(m, type(e).__name__) for m, e in timeline])
        assert "".join(e.text for m, e in timeline if m == method and isinstance(e, Text)) == expected, method


def test_batched_rows_follow_their_own_seeds_beside_a_greedy_row(model_dir):
    """One batch: a greedy request, three sampled ones with distinct seeds and a repeat of one
    seed. The greedy row is its batch-1 greedy answer; distinct seeds give distinct answers; the
    repeated seed gives the same answer again."""
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=12, threads=1, quiet=True))
    ids = session.engine.encode("def add(a, b):", chat=False)
    scheduler = BatchScheduler(Sessions({None: session}), batch_size=8)
    samplings = [SamplingConfig()] + [SamplingConfig(temperature=1.0, seed=seed) for seed in (1, 2, 3, 1)]
    events: list[list] = [[] for _ in samplings]
    with scheduler._cond:  # the worker takes them all before its first step: one batch
        for sampling, sink in zip(samplings, events):
            scheduler.submit(Job(JobRequest(prompt=ids, store=None, method="adaptive", sampling=sampling),
                                 scheduler.sessions, sink.append))
    scheduler.close()
    assert scheduler._run.stats.rows_per_step[0] == len(samplings)
    greedy, *sampled = [e[-1].result.tokens for e in events]
    assert greedy == plain(session, ids=ids)
    assert len({tuple(t) for t in [greedy] + sampled[:3]}) == 4 and sampled[3] == sampled[0], sampled


def test_a_greedy_answer_is_the_same_after_other_requests_filled_the_memory(model_dir):
    """llama.cpp's greedy server output changes across runs with prompt caching; samctl's does
    not: a prompt's answer on a fresh server equals its answer after concurrent requests (other
    prompts, the same one inside longer ones, other methods) filled the cross-request memory,
    the batched cache's rows and batch 1's cache, which do change how it is drafted."""
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=24, threads=1, quiet=True))
    expected = session.decode(plain(session, QUESTION))
    app = create_app(session, batch_size=4)
    server, url = _serve(app)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            def ask(messages=QUESTION, **fields) -> dict:
                return client.post("/v1/chat/completions", json={**body(session, **fields), "messages": messages}).json()

            first = ask()
            others = [[{"role": "user", "content": text}] for text in (
                "The quick brown fox", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "Summarize the document.",
                "jumps over the lazy dog " * 8, "def f(x):", "The answer is in", "return a + b", "The dog sleeps.")]
            fillers = [threading.Thread(target=ask, args=(m,), kwargs={"max_tokens": 8 + 5 * i, **extra})
                       for i, m in enumerate(others) for extra in ({}, {"method": "pld"})]
            for t in fillers:
                t.start()
            for t in fillers:
                t.join(120)
            again = ask()
            streamed = list(openai_client(url).chat.completions.create(model=session.engine.name, messages=QUESTION,
                                                                       stream=True))
    finally:
        server.should_exit = True
        server.thread.join(60)
    assert len(session.drafter.memory_documents()) >= len(others) + 2  # the memory did fill
    assert again["usage"]["num_accepted_draft_tokens"] > first["usage"]["num_accepted_draft_tokens"]  # and drafted
    assert first["choices"][0]["message"]["content"] == expected
    assert again["choices"][0]["message"]["content"] == expected
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    with _client(session, 1) as client:  # batch 1, on the cache the session's earlier requests left
        answer = client.post("/v1/chat/completions", json=body(session)).json()
    assert answer["choices"][0]["message"]["content"] == expected


class _FakeSession:
    """A session without a model: token t is the letter chr(97 + t); generation counts upwards
    from the prompt's last token, calling on_tokens once per token, and waits for `gate`."""

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()
        self.ran: list[list[int]] = []
        self.engine = SimpleNamespace(name="fake", vocab_size=26, tokenizer=None,
                                      target=SimpleNamespace(max_positions=64, context_note="the context"),
                                      encode=lambda text, chat: [ord(c) - 97 for c in text])
        self.config = SimpleNamespace(method="adaptive", store=None, max_new_tokens=5, sampling=SamplingConfig())

    def batch_refusal(self) -> str:  # a BatchScheduler runs its jobs alone, as for a draft-model method
        return "the fake session has no batched form"

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + t) for t in ids)

    def one_row_run(self, ids, *, prediction=None, on_tokens=None, max_new_tokens=5, sampling=None):
        return _FakeRun(self, ids, on_tokens, max_new_tokens)


class _FakeRun:
    """A one-row run of _FakeSession's: a token a step (the first step waits for the gate)."""

    def __init__(self, session: _FakeSession, ids, on_tokens, max_new_tokens: int) -> None:
        self.session, self.ids, self.on_tokens, self.max_new_tokens = session, ids, on_tokens, max_new_tokens
        self.tokens: list[int] = []
        self.cancelled = False

    def cancel(self, key) -> None:
        self.cancelled = True

    def step(self) -> list[GenerationResult]:
        if not self.tokens:
            self.session.entered.set()
            self.session.gate.wait(30)
            self.session.ran.append(self.ids)
        if self.cancelled:
            return [self._result("cancelled")]
        self.tokens.append((self.ids[-1] + 1 + len(self.tokens)) % 26)
        if self.on_tokens(self.tokens[-1:]):
            return [self._result("stop")]
        return [self._result("length")] if len(self.tokens) == self.max_new_tokens else []

    def _result(self, reason: str) -> GenerationResult:
        return GenerationResult(self.tokens, reason, Metrics(new_tokens=len(self.tokens)), index=0)


def _job(sessions, prompt: str, events: list, stop=()) -> Job:
    return Job(JobRequest(prompt=prompt, store=None, method="adaptive", stop=stop), sessions, events.append)


@pytest.mark.parametrize("batched", [False, True])
def test_the_scheduler_finishes_what_it_was_given_and_skips_cancelled_jobs(batched):
    session = _FakeSession()
    sessions = Sessions({None: session})
    scheduler = BatchScheduler(sessions, 4 if batched else 1)
    first, second, third = [], [], []
    jobs = [_job(sessions, "a", first), _job(sessions, "h", second), _job(sessions, "p", third, stop=("rs",))]
    for job in jobs:
        scheduler.submit(job)
    jobs[1].cancel()  # still queued behind the first
    session.gate.set()
    scheduler.close()  # returns once every submitted job has ended
    assert [type(e) for e in first] == [Started, Text, Text, Text, Text, Text, Done]
    assert "".join(e.text for e in first if isinstance(e, Text)) == "bcdef" and first[-1].reason == "length"
    assert second == [Cancelled()] and session.ran == [[0], [15]]
    assert "".join(e.text for e in third if isinstance(e, Text)) == "q" and third[-1].reason == "stop"
    late = []
    scheduler.submit(_job(sessions, "a", late))
    assert isinstance(late[0], Failed) and late[0].error.status == 503


def test_shutdown_finishes_the_request_in_flight():
    # uvicorn's SIGTERM handler sets should_exit; set here, the same graceful path runs
    session = _FakeSession()
    server, url = _serve(create_app(Sessions({None: session})))
    lines: list[str] = []

    def ask() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"model": "fake", "prompt": "a", "stream": True}) as response:
            lines.extend(response.iter_lines())

    client = threading.Thread(target=ask)
    client.start()
    assert session.entered.wait(30)
    server.should_exit = True
    # the shutdown begins (uvicorn stops listening first) while the request is still generating
    deadline = time.monotonic() + 30
    while _listens(url) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _listens(url), "the server did not begin its shutdown"
    session.gate.set()
    client.join(60)
    server_thread = server.thread
    server_thread.join(60)
    assert not server_thread.is_alive()
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "bcdef"


def test_shutdown_finishes_the_batched_requests_in_flight(model_dir, monkeypatch):
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=24, threads=1, quiet=True))
    expected = session.decode(plain(session, QUESTION))
    on_tokens = Job.on_tokens
    monkeypatch.setattr(Job, "on_tokens", lambda self, t: time.sleep(0.05) or on_tokens(self, t))
    server, url = _serve(create_app(session, batch_size=2))
    answers: list = []
    streaming = [threading.Event(), threading.Event()]

    def ask(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                          json={"model": session.engine.name, "messages": QUESTION, "stream": True}) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                streaming[i].set()
        answers.append("".join(json.loads(e).get("choices", [{}])[0].get("delta", {}).get("content") or ""
                               for e in (x.removeprefix("data: ") for x in lines if x.startswith("data: "))
                               if e != "[DONE]"))

    clients = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for c in clients:
        c.start()
    assert all(e.wait(30) for e in streaming)
    server.should_exit = True  # what uvicorn's SIGTERM handler does
    for c in clients:
        c.join(60)
    server.thread.join(60)
    assert not server.thread.is_alive()
    assert answers == [expected, expected]


def test_stores_are_named_on_the_command_line_and_by_requests(tmp_path):
    from samctl.commands.serve import _stores
    from samctl.index.errors import UserError
    from samctl.scheduler import RequestError

    (tmp_path / "docs.sam").write_bytes(b"")
    (tmp_path / "code.sam").write_bytes(b"")
    docs, code = str(tmp_path / "docs.sam"), str(tmp_path / "code.sam")
    assert _stores((docs, f"src={code}")) == {"docs": docs, "src": code}
    for bad in ((docs, docs), (f"x={tmp_path / 'missing.sam'}",), ("=a.sam",)):
        with pytest.raises(UserError):
            _stores(bad)
    sessions = Sessions({"docs": _FakeSession(), "src": _FakeSession()})
    assert sessions.check(None, None) == ("docs", "adaptive") and sessions.check("src", "pld") == ("src", "pld")
    with pytest.raises(RequestError, match="docs, src"):
        sessions.check("other", None)


def test_stop_cut_holds_back_a_possible_stop_string():
    cut = StopCut(["END"])
    assert cut.push("abc E") == "abc " and cut.push("N") == "" and cut.push("D tail") == "" and cut.stopped
    cut = StopCut(["END"])
    assert cut.push("x EN") == "x " and cut.finish("") == "EN"


@pytest.mark.parametrize("change, status, param", [
    ({"n": 2}, 400, "n"),
    ({"temperature": -1}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"prediction": {"type": "file", "content": "x"}}, 400, "prediction.type"),
    ({"method": "nope"}, 400, "method"),
    ({"store": "nope"}, 400, "store"),
    ({"method": "sd"}, 400, "method"),  # needs a draft model the server was not given
    ({"speculation": "maybe"}, 400, "speculation"),
    ({"speculation": "off", "method": "pld"}, 400, "speculation"),
    ({"model": "other"}, 404, "model"),
    ({"frequency_penalty": 1.0}, 400, "frequency_penalty"),  # ignored, they would have changed nothing
    ({"presence_penalty": -0.5}, 400, "presence_penalty"),
    ({"logit_bias": {"42": 5}}, 400, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, change, status, param):
    session, _, client, _ = served
    response = client.post("/v1/chat/completions", json={**body(session), **change})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert client.post("/v1/chat/completions", json=body(session, max_tokens=2)).status_code == 200


def test_neutral_penalties_and_text_format_are_accepted(served):
    session, _, client, _ = served
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}}
    assert client.post("/v1/chat/completions", json={**body(session, max_tokens=2), **neutral}).status_code == 200


def test_a_method_the_server_cannot_run_names_the_flag_to_start_it_with(served):
    session, _, client, _ = served
    response = client.post("/v1/chat/completions", json=body(session, method="sd"))
    message = response.json()["error"]["message"]
    assert message.startswith("method sd needs a draft model: pass --draft-model with ")
    assert "draft_model=" not in message


def test_a_request_may_turn_speculation_off(served):
    # plain decoding for this request only: no drafts, the same text
    session, _, client, _ = served
    on = client.post("/v1/chat/completions", json=body(session)).json()
    off = client.post("/v1/chat/completions", json=body(session, speculation="off")).json()
    assert off["usage"]["num_draft_tokens"] == 0 < on["usage"]["num_draft_tokens"]
    assert off["choices"][0]["message"]["content"] == on["choices"][0]["message"]["content"]


def test_malformed_json_and_overlong_prompts_are_refused(served):
    session, url, client, _ = served
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    response = client.post("/v1/completions", json={"model": session.engine.name,
                                                    "prompt": [5] * (session.engine.target.max_positions + 1)})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    official = openai_client(url)
    with pytest.raises(openai.BadRequestError):
        official.chat.completions.create(model=session.engine.name, messages=QUESTION, n=2)
    with pytest.raises(openai.NotFoundError):
        official.chat.completions.create(model="other", messages=QUESTION)
    assert official.chat.completions.create(model=session.engine.name, messages=QUESTION, max_tokens=2).choices


def test_a_client_leaving_mid_stream_frees_its_slot(served, monkeypatch):
    session, _, client, app = served
    on_tokens = Job.on_tokens
    monkeypatch.setattr(Job, "on_tokens", lambda self, t: time.sleep(0.1) or on_tokens(self, t))  # >= 12 steps: 1.2 s
    scheduler = app.state.scheduler
    tokens_before = scheduler._run.stats.new_tokens
    with client.stream("POST", "/v1/completions", json={"model": session.engine.name, "prompt": "The",
                                                        "max_tokens": 200, "stream": True}) as response:
        next(response.iter_lines())  # the role chunk goes out when the job starts, maybe before its row is admitted
        deadline = time.monotonic() + 30
        while not scheduler.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.running == 1
    deadline = time.monotonic() + 30
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.running == 0 and scheduler.waiting == 0
    assert scheduler._run.stats.new_tokens - tokens_before < 200  # it stopped early
    metrics = client.get("/metrics").text
    assert 'samctl_requests_total{outcome="cancelled"} 1' in metrics and "\nsamctl_requests_running 0" in metrics
    assert client.post("/v1/completions", json={"model": session.engine.name, "prompt": "The",
                                                "max_tokens": 3}).status_code == 200


def test_the_embedded_models_id_is_default(tmp_path):
    from samctl.tokenizer import DEFAULT_MODEL_DIR
    from tests.test_cli_generate import samctl

    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("no embedded model")
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
              "body": {"model": name, "prompt": "def add(a, b):", "max_tokens": 4}} for name in ("default", "other")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = samctl("generate", "--input", str(tmp_path / "in.jsonl"), "--threads", "1", "--quiet")
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [o["response"]["status_code"] for o in out] == [200, 404], proc.stderr
    assert out[0]["response"]["body"]["model"] == "default"


def test_generate_reads_and_writes_openai_batch_lines(served, model_dir, tmp_path):
    from tests.test_cli_generate import samctl

    session, _, client, _ = served
    name = str(model_dir)
    chat = {"model": name, "messages": QUESTION, "max_tokens": 24}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": name, "prompt": "The quick brown fox", "max_tokens": 24, "stop": ["zz"]}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "temperature": -1}},
        {"custom_id": "other", "method": "POST", "url": "/v1/completions", "body": {"model": "gpt-4o", "prompt": "x"}},
    ]
    latin1 = b'{"custom_id": "latin", "method": "POST", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}\n'
    (tmp_path / "in.jsonl").write_bytes("".join(json.dumps(line) + "\n" for line in lines).encode()
                                        + b"{not json\n" + latin1)  # the custom_id survives the bad byte (issue 42, item 10)
    proc = samctl("generate", "--model", name, "--input", str(tmp_path / "in.jsonl"), "--output",
                  str(tmp_path / "out.jsonl"), "--threads", "1", "--batch-size", "2", "--quiet")
    assert proc.returncode == 1, proc.stderr  # four lines failed
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", "text", "bad", "other", None, "latin"]
    assert "is not UTF-8 (byte 0xe9" in out[5]["error"]["message"]
    served_chat = client.post("/v1/chat/completions", json=chat).json()
    assert out[0]["error"] is None and out[0]["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["choices"] == served_chat["choices"]
    assert out[0]["response"]["body"]["object"] == "chat.completion"
    expected = session.decode(plain(session, ids=session.engine.encode("The quick brown fox", chat=False)))
    assert out[1]["response"]["body"]["choices"][0]["text"] == expected
    assert [o["response"]["status_code"] for o in out[2:]] == [400, 404, 400, 400]
    assert out[2]["error"]["param"] == "temperature" and out[2]["response"]["body"] is None
    assert out[3]["error"]["code"] == "model_not_found"


def test_an_api_key_is_checked_on_every_request_but_health(model_dir):
    from fastapi.testclient import TestClient

    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=2, threads=1, quiet=True))
    with TestClient(create_app(session, api_key="sesame")) as client:
        for path in ("/v1/models", "/metrics"):
            refused = client.get(path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert client.get(path, headers={"Authorization": "Bearer sesame"}).status_code == 200
        deadline = time.monotonic() + 120  # a load balancer's probe has no key: 503 while starting, then 200
        while (health := client.get("/health")).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 200 and health.text == "ok"


def test_int8_requests_share_the_batch_and_equal_plain_int8_decoding(model_dir):
    """--quantize int8 batches in the server too: 6 concurrent clients on a 3-row batch, each greedy
    answer exactly the int8 model's own plain decoding."""
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=16, threads=1, quiet=True, quantize="int8"))
    questions = [[{"role": "user", "content": w}] for w in
                 ("def add(a, b):", "The quick brown fox", "The dog sleeps.", "return a + b", "def f(x):", "The answer is")]
    expected = [session.decode(plain(session, q)) for q in questions]
    app = create_app(session, batch_size=3)
    server, url = _serve(app)
    try:
        client = openai_client(url)
        answers: list = [None] * len(questions)

        def ask(i: int) -> None:
            answers[i] = client.chat.completions.create(model=session.engine.name, messages=questions[i],
                                                        max_tokens=16).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert max(app.state.scheduler._run.stats.rows_per_step) > 1  # they did share steps
        assert answers == expected
    finally:
        server.should_exit = True
        server.thread.join(60)
