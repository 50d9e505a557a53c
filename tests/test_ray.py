"""Scale-out on a local Ray instance (2 CPUs): shards built as Ray tasks, batch generation with Ray
Data actors. Skipped when Ray is not installed (the `ray` extra)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from samctl.index.load import load_datastore
from samctl.cli import main
from tests.test_cli_generate import PROMPT

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow,  # a Ray instance, actors and spawned build processes: ~2 minutes in all
              pytest.mark.xdist_group("ray")]  # pytest -n: one worker runs every Ray test


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    from samctl.cluster import LOCAL, start_ray

    start_ray(LOCAL, num_cpus=2, object_store_mb=500)
    yield
    ray.shutdown()


def run(args: list[str], capsys) -> tuple[int, str, str]:
    """The real entry point in this process (so it finds the module's Ray instance)."""
    with pytest.raises(SystemExit) as info:
        main(args)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "return", "def", "(a, b)", "+", "\n"]
    rows = [{"text": " ".join(rng.choice(words, rng.integers(5, 60)))} for _ in range(60)]
    path = tmp / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp, path


def test_ray_build_equals_local_build_and_answers_as_one_store(corpus, capsys):
    tmp, path = corpus
    common = [str(path), "--tokenizer", "bytes", "-q"]
    assert run(["build", *common, "-o", str(tmp / "one.sam")], capsys)[0] == 0
    assert run(["build", *common, "-o", str(tmp / "local.samd"), "--shards", "3", "--workers", "2"], capsys)[0] == 0
    assert run(["build", *common, "-o", str(tmp / "ray.samd"), "--shards", "3", "--ray"], capsys)[0] == 0
    for name in ("shard-00000.sam", "shard-00001.sam", "shard-00002.sam"):
        assert (tmp / "ray.samd" / name).read_bytes() == (tmp / "local.samd" / name).read_bytes()
    one, sharded = load_datastore(tmp / "one.sam"), load_datastore(tmp / "ray.samd", verify=True)
    tokens = np.asarray(one.sam.tokens)
    rng = np.random.default_rng(1)
    for _ in range(200):
        end = int(rng.integers(1, len(tokens)))
        query = tokens[max(0, end - int(rng.integers(1, 30))):end]
        query = query[query >= 0]
        a, b = one.lookup(query, 12, 5), sharded.lookup(query, 12, 5)
        assert (a.match_length, a.count, a.continuation.tolist(), a.next_tokens.tolist(), a.next_counts.tolist()) \
            == (b.match_length, b.count, b.continuation.tolist(), b.next_tokens.tolist(), b.next_counts.tolist())


def test_ray_builds_suffix_array_shards_as_the_local_build_does(corpus, capsys):
    pytest.importorskip("infini_gram", reason="suffix-array stores need infini-gram: pip install 'samctl[sa]'")
    tmp, path = corpus
    common = [str(path), "--tokenizer", "bytes", "-q", "--kind", "sa", "--shards", "2"]
    assert run(["build", *common, "-o", str(tmp / "local-sa.samd"), "--workers", "2"], capsys)[0] == 0
    assert run(["build", *common, "-o", str(tmp / "ray-sa.samd"), "--ray"], capsys)[0] == 0
    for shard in ("shard-00000.sa", "shard-00001.sa"):
        for name in ("tokenized.0", "table.0", "offset.0"):
            assert (tmp / "ray-sa.samd" / shard / name).read_bytes() == (tmp / "local-sa.samd" / shard / name).read_bytes()
    assert load_datastore(tmp / "ray-sa.samd", verify=True).kind == "sa"


def _records() -> list[str]:
    return [
        json.dumps({"id": "a", "prompt": PROMPT}),
        json.dumps({"id": "b", "prompt": "The quick brown fox"}),
        "this is not json",
        json.dumps({"id": "d", "nothing": "here"}),
        json.dumps({"question_id": 7, "turns": ["The quick brown fox", "The dog sleeps."]}),
        json.dumps({"id": "f", "prompt": PROMPT + PROMPT}),
    ]


def _without_timings(lines: str) -> list[dict]:
    records = [json.loads(line) for line in lines.splitlines()]
    for record in records:
        record.pop("metrics", None)
    return records


def test_ray_batch_equals_local_batch_in_order_with_bad_records(model_dir, tmp_path, capsys):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(_records()) + "\n")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in (PROMPT * 2, "The quick brown fox jumps", PROMPT)))
    store = tmp_path / "s.samd"
    code, _, err = run(["build", str(docs), "-o", str(store), "--tokenizer", str(model_dir), "--shards", "2", "-q"],
                       capsys)
    assert code == 0, err
    common = ["generate", "--model", str(model_dir), "--sam", str(store), "--input", str(inputs),
              "--max-new-tokens", "12", "--threads", "1", "--quiet"]
    local_code, _, local_err = run([*common, "--output", str(tmp_path / "local.jsonl")], capsys)
    ray_code, _, ray_err = run([*common, "--output", str(tmp_path / "ray.jsonl"), "--ray", "--workers", "2"], capsys)
    assert local_code == ray_code == 1 and "2 record(s) failed" in local_err and "2 record(s) failed" in ray_err
    local = _without_timings((tmp_path / "local.jsonl").read_text())
    distributed = _without_timings((tmp_path / "ray.jsonl").read_text())
    assert [r.get("id", r.get("line")) for r in distributed] == ["a", "b", 3, "d", 7, "f"]
    assert distributed == local
    assert "not JSON" in distributed[2]["error"] and "text" in distributed[5]

    # resume after a kill: the output holds two finished records and half of a third
    partial = (tmp_path / "local.jsonl").read_text().splitlines(keepends=True)
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(partial[:2]) + partial[2][:15])
    code, _, _ = run([*common, "--output", str(resumed), "--ray", "--workers", "2", "--resume"], capsys)
    assert code == 1
    assert _without_timings(resumed.read_text()) == local
    assert [r["id"] for r in _without_timings(resumed.read_text())[:2]] == ["a", "b"]


def test_ray_errors_are_one_line(model_dir, tmp_path, capsys):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"prompt": "x"}) + "\n")
    code, _, err = run(["generate", "--model", str(tmp_path / "missing"), "--input", str(inputs), "--ray",
                        "--quiet"], capsys)
    assert code == 2 and "model " in err and "does not exist" in err and len(err.strip().splitlines()) == 1, err
    # a worker's ConfigError keeps its type across Ray, so its setting is worded as the flag
    code, _, err = run(["generate", "--model", str(model_dir), "--method", "sd", "--input", str(inputs), "--ray",
                        "--quiet"], capsys)
    assert code == 2 and "--draft-model" in err and "draft_model=" not in err, err
    code, _, err = run(["generate", "--model", str(model_dir), "--prompt", "x", "--ray"], capsys)
    assert code == 2 and "--ray applies to a batch" in err
