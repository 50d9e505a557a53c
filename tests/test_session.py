"""The Session: one configuration, validated up front, behind every command and the Python API."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from samctl.decode.sampling import SamplingConfig
from samctl.index.errors import ConfigError, UserError
from samctl.session import Session, SessionConfig

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("changes, named", [
    ({"method": "no-such"}, "unknown method"),
    ({"threads": 0}, "threads="),
    ({"max_new_tokens": 0}, "max_new_tokens="),
    ({"settings": {"max_nodez": 3}}, "max_nodez"),
    ({"settings": {"gamma": 0}}, "gamma="),
    ({"settings": {"max_nodes": "8"}}, "max_nodes= must be an integer, got '8'"),
    ({"settings": {"min_prob": "0.1"}}, "min_prob= must be a number, got '0.1'"),
    ({"settings": {"bounds": 3}}, "bounds= must be (MIN, MAX), each an integer, got 3"),
    ({"store": 3}, "store= must be a path (a str or os.PathLike), got int 3"),
    ({"dtype": "float8"}, "dtype= must be one of auto, float32, float16, bfloat16, got 'float8'"),
    ({"sampling": {"temperature": 0.7}}, "sampling= must be a samctl.decode.configs.SamplingConfig("),
])
def test_a_bad_configuration_is_refused_before_anything_loads(changes, named):
    with pytest.raises(UserError, match=re.escape(named)):
        SessionConfig(model="/nonexistent/model", **changes)


def test_paths_may_be_pathlib_paths(model_dir, tmp_path):
    # a Path was an AttributeError ('PosixPath' object has no attribute 'startswith') at load;
    # an int store was opened as a file descriptor
    config = SessionConfig(model=model_dir, memory_file=tmp_path / "m.sam", quiet=True)
    assert config.model == str(model_dir) and config.memory_file == str(tmp_path / "m.sam")
    session = Session(SessionConfig(model=model_dir, method="pld", max_new_tokens=2, quiet=True))
    assert len(session.generate("hello hello").tokens) == 2


def test_a_session_generates_compares_and_records_its_configuration(model_dir):
    config = SessionConfig(model=str(model_dir), method="pld", max_new_tokens=12, quiet=True,
                           settings={"pld_tokens": 3})
    session = Session(config)
    result = session.generate("def f(x):\n    return x + 1\n\ndef g(x):\n")
    check = session.compare("def f(x):\n    return x + 1\n\ndef g(x):\n", result)
    assert check["identical"] and len(result.tokens) == 12
    recorded = session.record["config"]["session"]
    assert recorded["method"] == "pld" and recorded["settings"] == {"pld_tokens": 3}
    assert session.record["config"]["method"]["pld"]["num_draft"] == 3  # settings reached the drafter


def test_sessions_of_other_methods_share_the_loaded_engine(model_dir):
    session = Session(SessionConfig(model=str(model_dir), method="ar", max_new_tokens=8, quiet=True))
    other = session.for_method("adaptive")
    assert other.engine is session.engine and other.drafter is not session.drafter
    prompt = [{"role": "user", "content": "abc abc abc abc"}]
    assert other.generate(prompt).tokens == session.generate(prompt).tokens


def test_sampling_settings_reach_the_generation(model_dir):
    sampling = SamplingConfig(temperature=0.8, top_k=0, top_p=1.0, seed=7)
    session = Session(SessionConfig(model=str(model_dir), method="pld", max_new_tokens=10, sampling=sampling,
                                    quiet=True))
    first = session.generate("hello hello")
    again = session.generate("hello hello")
    assert first.tokens == again.tokens  # one seed, one sample
    assert session.generation.sampling == sampling
    # ... and a sample, not the argmax (a session that dropped its sampling would pass the above)
    assert first.tokens != session.generate("hello hello", sampling=SamplingConfig()).tokens


def test_a_per_call_override_is_checked_not_dropped(model_dir):
    # max_new_tokens=0 was read as unset (`or`) and gave the configuration's 8 tokens; a dict for
    # sampling failed deep in the drafter with an AttributeError
    session = Session(SessionConfig(model=str(model_dir), method="pld", max_new_tokens=8, quiet=True))
    with pytest.raises(ConfigError, match=re.escape("max_new_tokens= must be >= 1, got 0")):
        session.generate("hello hello", max_new_tokens=0)
    with pytest.raises(ConfigError, match=re.escape("sampling= must be a samctl.decode.configs.SamplingConfig(")):
        session.generate("hello hello", sampling={"temperature": 0.7})
    assert len(session.generate("hello hello", max_new_tokens=1).tokens) == 1


def test_token_ids_outside_the_vocabulary_are_refused_per_prompt(model_dir):
    # they were an IndexError from torch's embedding, and in a batch took the good prompts with them
    session = Session(SessionConfig(model=str(model_dir), method="pld", max_new_tokens=4, quiet=True))
    vocab = session.engine.vocab_size
    with pytest.raises(UserError, match=re.escape(f"token id {vocab} at position 1 is not in the model's vocabulary")):
        session.generate([1, vocab])
    good, high, negative = session.generate_batch([[1, 2, 3], [1, vocab + 5], [-1, 2]], batch_size=2)
    assert good.tokens == session.generate([1, 2, 3]).tokens and good.error == ""
    assert high.finish_reason == negative.finish_reason == "error"
    assert f"token id {vocab + 5} at position 1" in high.error and "token id -1 at position 0" in negative.error


def test_a_prompt_of_the_wrong_shape_is_one_user_error(model_dir):
    # a message without content was a KeyError, ids as strings a ValueError, an int a TypeError, and
    # generate_batch("text") ran each character as a prompt
    session = Session(SessionConfig(model=str(model_dir), method="pld", max_new_tokens=2, quiet=True))
    for prompt, named in [([{"role": "user"}], "{'role': 'user'}"), (["a", "b"], "'a'"), ([1, "b"], "'b'"),
                          (5, "int 5"), (None, "NoneType None")]:
        with pytest.raises(UserError, match=re.escape(f"a prompt is text, a list of token ids or a list of "
                                                      f"messages ({{'role': str, 'content': str}} each), not")) as err:
            session.encode(prompt)
        assert named in str(err.value)
    assert session.encode(torch.tensor([1, 2, 3])) == session.encode(np.array([1, 2, 3])) == [1, 2, 3]
    with pytest.raises(UserError, match="generate_batch takes a list of prompts, not one str"):
        session.generate_batch("abc")
    with pytest.raises(UserError, match="a prediction is the expected output as text, not int 5"):
        session.generate("hello", prediction=5)  # was a ValueError from the tokenizer


def test_readme_python_api_example_runs_as_written(capsys):
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- python-api-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "tokens per step" in out


def test_generate_batch_equals_one_prompt_at_a_time(model_dir):
    session = Session(SessionConfig(model=str(model_dir), method="adaptive", max_new_tokens=10, quiet=True))
    prompts = ["def f(x):\n    return x + 1\n", "abc abc abc abc", "hello", "x = 1\ny = 2\nz ="]
    batched = session.generate_batch(prompts, batch_size=3)
    alone = Session(SessionConfig(model=str(model_dir), method="ar", max_new_tokens=10, quiet=True))
    assert [r.tokens for r in batched] == [alone.generate(p).tokens for p in prompts]


def test_generate_input_batches_and_keeps_every_line(model_dir, tmp_path):
    import json

    from click.testing import CliRunner

    from samctl.cli import cli

    lines = [json.dumps({"id": "a", "prompt": "def f(x):"}), "", json.dumps({"id": "c", "turns": ["a b", "c d"]}),
             json.dumps({"id": "d", "prompt": "abc abc abc"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    outs = []
    for size in ("3", "1"):
        run = CliRunner().invoke(cli, ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"),
                                       "--max-new-tokens", "8", "--batch-size", size, "--quiet"])
        outs.append([json.loads(line) for line in run.output.splitlines() if line.startswith("{")])
    assert [o.get("id", o.get("line")) for o in outs[0]] == ["a", 2, "c", "d"] and "id" not in outs[0][1]
    assert [o.get("text") for o in outs[0]] == [o.get("text") for o in outs[1]]
    assert "error" in outs[0][1]
    for out in outs:  # every record's CPU time is measured, batched or not (issue 42, item 9)
        for o in out:
            metrics = o.get("metrics", [])
            assert all(m["cpu_s"] > 0 for m in (metrics if isinstance(metrics, list) else [metrics])), o


def _submitted(monkeypatch) -> list:
    """Spy on BatchRun.submit: the GenerationConfig of every record that reaches the batched engine."""
    from samctl.decode.loop import BatchRun

    seen, submit = [], BatchRun.submit

    def spy(self, key, prompt, config, pool, **kwargs):
        seen.append(config)
        return submit(self, key, prompt, config, pool, **kwargs)

    monkeypatch.setattr(BatchRun, "submit", spy)
    return seen


def test_generate_batch_hands_the_engine_the_sessions_sampling_and_eos(model_dir, monkeypatch):
    sampling = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9, seed=3)
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=6, sampling=sampling, quiet=True))
    session.batch_warm = True  # no throwaway warm-up run: the spy sees the records alone
    seen = _submitted(monkeypatch)
    results = session.generate_batch(["def add(a, b):", "hello"], batch_size=2)
    assert len(results) == 2 and len(seen) == 2
    assert all(c == session.generation for c in seen)
    assert seen[0].sampling == sampling and seen[0].eos_token_ids == session.engine.eos_token_ids != ()


def test_eos_ends_a_batched_row(model_dir):
    """The tiny model greedily reaches its EOS (id 1) three tokens after FOX and not after the
    others: batched, that row stops there ("eos") while its neighbours run to the length, each
    equal to its batch-1 output; sampled at a low temperature, rows end at the EOS too."""
    session = Session(SessionConfig(model=str(model_dir), max_new_tokens=12, quiet=True))
    fox, dog, code = (session.engine.encode(text, chat=False) for text in ("The quick brown fox", "The dog sleeps.",
                                                                            "def add(a, b):"))
    eos = session.engine.eos_token_ids
    results = session.generate_batch([dog, fox, code], batch_size=3)
    assert [r.tokens for r in results] == [session.generate(p).tokens for p in (dog, fox, code)]
    assert results[1].tokens[-1] in eos and len(results[1].tokens) < 12 and results[1].finish_reason == "eos"
    assert [r.finish_reason for r in results] == ["length", "eos", "length"]

    # at T = 0.1 about 0.4 of FOX's samples take the greedy path to the EOS (measured): 12 rows
    # miss it with probability 0.6^12 < 0.003, whatever drafts the machine's cost curve sizes
    cool = session.for_method(session.config.method, sampling=SamplingConfig(temperature=0.1, seed=1))
    sampled = cool.generate_batch([fox] * 12 + [dog] * 2, batch_size=4)
    for r in sampled:
        stops = [i for i, t in enumerate(r.tokens) if t in eos]
        assert stops in ([], [len(r.tokens) - 1]) and (r.finish_reason == "eos") == bool(stops), r
    assert any(r.finish_reason == "eos" for r in sampled) and len({tuple(r.tokens) for r in sampled}) > 2


def test_row_drafters_get_the_sessions_settings(model_dir, monkeypatch):
    """Every drafter a batched row takes (Session.generate_batch, and the server's pool) is built
    with the session's method settings, not the defaults."""
    from samctl.decode.loop import DrafterPool
    from samctl.scheduler import BatchScheduler, Job, Request, Sessions

    session = Session(SessionConfig(model=str(model_dir), method="adaptive", max_new_tokens=6, quiet=True,
                                    settings={"max_nodes": 7, "min_prob": 0.2}))
    assert (session.drafter.config.max_nodes, session.drafter.config.min_prob) == (7, 0.2)
    session.batch_warm = True  # no throwaway warm-up run: the spy sees the records' drafters alone
    taken, take = [], DrafterPool.take
    monkeypatch.setattr(DrafterPool, "take", lambda self: taken.append(take(self)) or taken[-1])
    session.generate_batch(["def add(a, b):", "hello", "abc abc"], batch_size=2)
    scheduler = BatchScheduler(Sessions({None: session}), batch_size=2)
    scheduler.submit(Job(Request(prompt="hello", store=None, method="adaptive"), scheduler.sessions, lambda _: None))
    scheduler.close()
    assert len(taken) == 4 and all(d.config == session.drafter.config for d in taken), [d.config for d in taken]


# Run in a fresh process, so that no earlier test has loaded the kernels: every numba dispatcher's
# first call (compile, or load from the on-disk cache) is logged, and so is each record as the
# batch reads it (RECORD); the session's warm-up runs (batch 1, then batched) come before the first.
_JIT_PROBE = """
import json, sys
from numba.core.dispatcher import Dispatcher
import samctl.decode.loop as batch
from samctl.session import Session, SessionConfig
events, warming = [], []
original, feed, warm_up = Dispatcher._compile_for_args, batch.feed, Session.warm_up_batched
def compiling(self, *args, **kwargs):
    events.append(self.py_func.__name__)
    return original(self, *args, **kwargs)
def fed(run, items, *args, **kwargs):
    def marked():
        for item in items:
            if not warming:  # the warm-up's own batch goes through feed too
                events.append("RECORD")
            yield item
    return feed(run, marked(), *args, **kwargs)
def warm(self, *args, **kwargs):
    warming.append(True)
    try:
        return warm_up(self, *args, **kwargs)
    finally:
        warming.pop()
Dispatcher._compile_for_args, batch.feed, Session.warm_up_batched = compiling, fed, warm
session = Session(SessionConfig(model=sys.argv[1], method="adaptive", max_new_tokens=10, quiet=True))
results = session.generate_batch(["", "def f(x):\\n    return x + 1\\n", "hello"], batch_size=2)
print(json.dumps({"events": events, "errors": [bool(r.error) for r in results],
                  "cpu_s": [r.metrics.cpu_s for r in results]}))
"""


def test_a_batch_pays_no_jit_inside_its_records(model_dir):
    """The drafters' and the batched engine's kernels load in a throwaway warm-up on the first
    prompt the model can continue, before the records run, so that no record's metrics carry it
    (issue 42, item 9: 415 ms per step for the first record of a batch); cpu_s is measured."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _JIT_PROBE, str(model_dir)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    events = out["events"]
    # the first record is empty (an error, nothing to warm up on): the warm-up runs on the second
    second = [i for i, e in enumerate(events) if e == "RECORD"][1]
    assert events[:second].count("path_probs") == 1  # a kernel of adaptive's scored (batched) proposals
    assert [e for e in events[second:] if e != "RECORD"] == [], "kernels loaded while the records ran"
    assert out["errors"] == [True, False, False] and all(t > 0 for t in out["cpu_s"][1:])


def test_one_batch_run_serves_every_call_and_a_whole_input_stays_in_order(model_dir, monkeypatch):
    """generate_batch keeps one BatchRun per batch size (its cache and, on a GPU, its graphs are
    built once), and `generate --input` streams every record through it: no run per window of
    records, the batch refilled from the next records as rows finish, output lines in input order."""
    import io
    import json

    from samctl.decode.loop import BatchRun, BatchStats
    from samctl.records import RecordRunner

    session = Session(SessionConfig(model=str(model_dir), method="pld", max_new_tokens=8, quiet=True))
    prompts = ["def f(x):\n    return x", "hello world", "a b c a b c", "x = 1\ny = 2", "print('hi')",
               "for i in range(3):", "import os", "class A:"]
    alone = [session.generate(p).tokens for p in prompts]
    built, init = [], BatchRun.__init__
    monkeypatch.setattr(BatchRun, "__init__", lambda self, *a, **k: built.append(self) or init(self, *a, **k))
    first = session.generate_batch(prompts[:3], batch_size=2)
    second = session.generate_batch(prompts[3:], batch_size=2)
    assert [r.tokens for r in first + second] == alone  # float32: each record as it runs alone
    kept = [run for run in built if run.target.rows == 2]
    assert len(kept) == 1 and session._run is kept[0]

    lines = [json.dumps({"id": f"r{i}", "prompt": p}) for i, p in enumerate(prompts)]
    lines.insert(2, "not json")  # a bad record: its error, in its place
    lines.insert(5, json.dumps({"id": "multi", "turns": ["hello", "again"]}))  # one by one, in its place
    out = io.StringIO()
    stats = []
    stream = session.stream_batch
    monkeypatch.setattr(session, "stream_batch", lambda items, **k: stats.append(k["stats"]) or stream(items, **k))
    failed = RecordRunner(session, batch_size=2).batch(enumerate(lines, 1), lambda s: out.write(s + "\n"), quiet=True)
    rows = [json.loads(s) for s in out.getvalue().splitlines()]
    assert failed == 1 and [r.get("id", r.get("line")) for r in rows] == ["r0", "r1", 3, "r2", "r3", "multi", "r4", "r5", "r6", "r7"]
    assert "error" in rows[2] and len(rows[5]["metrics"]) == 2  # one per turn
    assert [rows[j]["text"] for j in (0, 1, 3, 4, 6, 7, 8, 9)] == [session.decode(t) for t in alone]
    assert len([run for run in built if run.target.rows == 2]) == 1  # the same run again
    # full until the tail: rows only leave once the input is spent (how many steps the tail takes
    # depends on the widths the measured cost curve chose, so it is not counted)
    steps = stats[0].rows_per_step
    assert isinstance(stats[0], BatchStats) and steps == sorted(steps, reverse=True) and steps[0] == 2, steps


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_server_warms_up_before_it_says_ready(model_dir, batch_size):
    """The scheduler's worker runs the warm-up (kernels, JIT caches) before `starting` clears, so
    that the first client's request pays none of it."""
    import time

    from samctl.scheduler import BatchScheduler, Sessions

    session = Session(SessionConfig(model=str(model_dir), method="adaptive", max_new_tokens=6, quiet=True))
    scheduler = BatchScheduler(Sessions({None: session}), batch_size=batch_size)
    deadline = time.monotonic() + 300
    while scheduler.starting and time.monotonic() < deadline:
        time.sleep(0.05)
    scheduler.close()
    assert not scheduler.starting
    assert session.batch_warm if batch_size > 1 else session.warm
