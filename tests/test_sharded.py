"""Sharded stores (index/sharded.py): the same answers as one store, untrusted manifests, atomic writes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from samctl.index.automaton import SuffixAutomaton
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
from samctl.index.load import load_datastore
from samctl.index.sharded import (MANIFEST, ShardedAutomaton, StoreDirectoryWriter, children, load_sharded,
                                  plan_shards, build_shard as write_shard)
from samctl.index.errors import UserError
from samctl.index.store import StoreError


def corpus(seed: int, n_docs: int = 12, vocab: int = 6) -> tuple[np.ndarray, np.ndarray]:
    # a small alphabet so that long matches and shared substrings across documents are common
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, rng.integers(1, 40)) for _ in range(n_docs)]
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64)
    return np.concatenate(docs).astype(np.int32), offsets


def meta(tokens: np.ndarray, offsets: np.ndarray, vocab: int = 6) -> StoreMeta:
    return StoreMeta(tokenizer_name="test", tokenizer_fingerprint="fp", vocab_size=vocab, eos_token_id=None,
                     build=BuildConfig(kind="sam"), corpus=CorpusStats(documents=len(offsets) - 1,
                                                                       tokens=len(tokens), inputs=("x",)))


def build_shard(path, tokens, doc_offsets, meta):
    """One shard's automaton, written to path: its manifest entry."""
    return write_shard(path, np.ascontiguousarray(tokens, dtype=np.int32), doc_offsets, meta)[0]


def write_sharded(path, tokens, offsets, n: int) -> None:
    bounds = plan_shards(offsets, n)
    with StoreDirectoryWriter(path) as writer:
        entries = []
        for i in range(n):
            lo, hi = offsets[bounds[i]], offsets[bounds[i + 1]]
            entries.append(build_shard(writer.shard_path(i), tokens[lo:hi],
                                       offsets[bounds[i]:bounds[i + 1] + 1] - lo, meta(tokens, offsets)))
        writer.commit(meta(tokens, offsets), entries)


def test_plan_shards_keeps_documents_whole_and_balanced():
    offsets = np.array([0, 5, 6, 7, 30, 31, 60, 61, 62, 100])
    for n in range(1, 10):
        b = plan_shards(offsets, n)
        assert b[0] == 0 and b[-1] == 9 and np.all(np.diff(b) >= 1), (n, b)
    b = plan_shards(np.arange(0, 1001, 10), 4)
    assert np.diff(b).tolist() == [25, 25, 25, 25]
    with pytest.raises(Exception, match="at least 10 documents"):
        plan_shards(offsets, 10)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_sharded_store_answers_as_the_single_store(tmp_path, seed, n):
    tokens, offsets = corpus(seed)
    single_path, sharded_path = tmp_path / "one.sam", tmp_path / "many.samd"
    save_datastore(single_path, SuffixAutomaton.build(tokens, offsets), meta(tokens, offsets))
    write_sharded(sharded_path, tokens, offsets, n)
    for occurrence in ("first", "latest"):
        single = load_datastore(single_path, occurrence=occurrence)
        sharded = load_datastore(sharded_path, verify=True, occurrence=occurrence)
        assert len(sharded.structure) == n and sharded.structure.num_tokens == len(tokens)
        rng = np.random.default_rng(seed + 100)
        for _ in range(60):
            # queries from inside documents (long matches) and random ones (short matches)
            if rng.random() < 0.6:
                start = int(rng.integers(0, len(tokens)))
                query = tokens[max(0, start - rng.integers(1, 12)):start + 1]
            else:
                query = rng.integers(0, 6, rng.integers(1, 10)).astype(np.int32)
            a, b = single.lookup(query, 8, 4), sharded.lookup(query, 8, 4)
            assert (a.match_length, a.count) == (b.match_length, b.count), query
            assert a.continuation.tolist() == b.continuation.tolist(), (query, occurrence)
            assert a.next_tokens.tolist() == b.next_tokens.tolist() and a.next_counts.tolist() == b.next_counts.tolist()


def test_streaming_pointer_and_peek_match_the_single_automaton():
    tokens, offsets = corpus(7, n_docs=20)
    single = SuffixAutomaton.build(tokens, offsets)
    bounds = plan_shards(offsets, 4)
    shards = [SuffixAutomaton.build(tokens[offsets[lo]:offsets[hi]], offsets[lo:hi + 1] - offsets[lo])
              for lo, hi in zip(bounds[:-1], bounds[1:])]
    sharded = ShardedAutomaton(shards)
    text = np.random.default_rng(0).integers(0, 6, 300).astype(np.int32)
    states, lengths = sharded.pointer()
    state, length = 0, 0
    for t in text:
        shard, s, m = sharded.peek(states, lengths, int(t))
        state, length = single.step(state, length, int(t))
        assert m == length
        assert sharded.continuation(shard, s, 6).tolist() == single.continuation(state, 6).tolist()
        sharded.walk(states, lengths, np.array([t], dtype=np.int32))
    assert sharded.best(states, lengths)[2] == length


def test_children_lists_every_out_edge():
    tokens, offsets = corpus(3)
    sam = SuffixAutomaton.build(tokens, offsets)
    arrays = sam.kernel_arrays
    for state in range(sam.num_states):
        tok, cnt = children(arrays.states, arrays.edges, state)
        top_tok, top_cnt = sam.topk_next(state, 100)
        assert sorted(zip(tok.tolist(), cnt.tolist())) == sorted(zip(top_tok.tolist(), top_cnt.tolist()))


@pytest.fixture
def sharded_dir(tmp_path):
    tokens, offsets = corpus(1)
    path = tmp_path / "s.samd"
    write_sharded(path, tokens, offsets, 3)
    return path


def _manifest(path) -> dict:
    return json.loads((path / MANIFEST).read_text())


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / MANIFEST).write_text("{not json"), "not JSON"),
    (lambda p: (p / MANIFEST).unlink(), "without manifest.json"),
    (lambda p: (p / MANIFEST).write_text(json.dumps({**_manifest(p), "format_version": 99})), "upgrade samctl"),
    (lambda p: (p / MANIFEST).write_text(json.dumps({**_manifest(p), "shards": []})), "no shard list"),
    (lambda p: (p / MANIFEST).write_text(json.dumps(
        {**_manifest(p), "shards": [{**_manifest(p)["shards"][0], "file": "../x.sam"}]})), "shard file name"),
    (lambda p: (p / MANIFEST).write_text(json.dumps(
        {**_manifest(p), "tokenizer": {**_manifest(p)["tokenizer"], "fingerprint": "other"}})), "tokenizer"),
    (lambda p: (p / "shard-00001.sam").unlink(), "lacks shard"),
    (lambda p: (p / "shard-00001.sam").write_bytes((p / "shard-00001.sam").read_bytes()[:-10]), "bytes"),
    (lambda p: (p / "shard-00002.sam").write_bytes((p / "shard-00000.sam").read_bytes()), "bytes|tokens"),
])
def test_damaged_manifest_or_shard_is_one_store_error(sharded_dir, damage, message):
    damage(sharded_dir)
    with pytest.raises(StoreError, match=message) as info:
        load_sharded(sharded_dir)
    assert "\n" not in str(info.value)


def test_flipped_bit_in_a_raw_shard_is_caught_by_verify(sharded_dir):
    shard = sharded_dir / "shard-00001.sam"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum|corrupt"):
        load_sharded(sharded_dir, verify=True)


def test_store_directory_appears_complete_or_not_at_all(tmp_path):
    tokens, offsets = corpus(2)
    path = tmp_path / "s.samd"
    with pytest.raises(KeyboardInterrupt):
        with StoreDirectoryWriter(path) as writer:
            build_shard(writer.shard_path(0), tokens, offsets, meta(tokens, offsets))
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    write_sharded(path, tokens, offsets, 2)
    first = load_sharded(path).manifest
    write_sharded(path, tokens, offsets, 3)  # replaces the older store in one rename
    assert len(load_sharded(path).manifest["shards"]) == 3 != len(first["shards"])
    assert sorted(os.listdir(tmp_path)) == ["s.samd"]


def test_a_directory_that_is_not_a_store_is_never_replaced(tmp_path):
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a samctl store"):
        StoreDirectoryWriter(folder)
    assert (folder / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("args, message", [
    (["--shards", "2", "--kind", "ngram"], "n-gram table"),
    (["--shards", "0"], "--shards must be >= 1"),
    (["--ray"], "add --shards N"),
    (["--shards", "99"], "at least 99 documents"),
])
def test_build_shard_options_are_checked_in_one_line(tmp_path, capsys, args, message):
    from samctl.cli import main

    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    with pytest.raises(SystemExit) as info:
        main(["build", str(docs), "-o", str(tmp_path / "s.samd"), "--tokenizer", "bytes", "-q", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_info_and_query_read_a_store_directory(tmp_path, capsys):
    from samctl.cli import main

    docs = tmp_path / "d.jsonl"
    docs.write_text("".join(json.dumps({"text": f"the number {i} and the word {i % 3}"}) + "\n" for i in range(9)))
    for out, extra in (("one.sam", []), ("many.samd", ["--shards", "3", "--workers", "1"])):
        with pytest.raises(SystemExit) as info:
            main(["build", str(docs), "-o", str(tmp_path / out), "--tokenizer", "bytes", "-q", *extra])
            raise SystemExit(0)
        assert info.value.code == 0, capsys.readouterr().err
    answers = []
    for out in ("one.sam", "many.samd"):
        with pytest.raises(SystemExit):
            main(["query", str(tmp_path / out), "--text", "and the word 1", "--json"])
            raise SystemExit(0)
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0] == answers[1] and answers[0]["match_length"] == len("and the word 1")
    with pytest.raises(SystemExit):
        main(["info", str(tmp_path / "many.samd"), "--json", "--verify"])
        raise SystemExit(0)
    report = json.loads(capsys.readouterr().out)
    assert len(report["shards"]) == 3 and report["tokens"] == sum(s["tokens"] for s in report["shards"])
