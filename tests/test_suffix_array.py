"""Suffix-array stores (index/suffix_array.py): the automaton's answers from a suffix array, untrusted
manifests and files, the drafters and commands over an `sa` store. Skipped without infini-gram."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("infini_gram", reason="suffix-array stores need infini-gram: pip install 'samctl[sa]'")

from samctl.index.automaton import SuffixAutomaton  # noqa: E402
from samctl.index.cursor import cursor  # noqa: E402
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta  # noqa: E402
from samctl.index.load import load_datastore  # noqa: E402
from samctl.index.store import StoreError  # noqa: E402
from samctl.index.suffix_array import build_suffix_array, load_suffix_array  # noqa: E402


def corpus(seed: int, vocab: int = 5, n_docs: int = 8) -> tuple[np.ndarray, np.ndarray]:
    # five ids: long matches and shared substrings across documents are common. A larger
    # vocabulary spreads them over both bytes (byte order is not id order).
    rng = np.random.default_rng(seed)
    ids = np.array([0, 1, 255, 256, vocab - 1]) if vocab > 257 else np.arange(vocab)
    docs = [ids[rng.integers(0, len(ids), rng.integers(1, 30))] for _ in range(n_docs)]
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64)
    return np.concatenate(docs).astype(np.int32), offsets


def meta(tokens: np.ndarray, offsets: np.ndarray, vocab: int) -> StoreMeta:
    return StoreMeta(tokenizer_name="test", tokenizer_fingerprint="fp", vocab_size=vocab, eos_token_id=None,
                     build=BuildConfig(kind="sa"), corpus=CorpusStats(documents=len(offsets) - 1, tokens=len(tokens)))


def build(path, seed: int, vocab: int = 5):
    tokens, offsets = corpus(seed, vocab)
    return build_suffix_array(path, tokens, offsets, meta(tokens, offsets, vocab), memory_limit=64 << 20), tokens, offsets


@pytest.mark.parametrize("seed", range(8))
def test_queries_equal_the_automatons(tmp_path, seed):
    """Match length, count, first-occurrence continuation and top-k next tokens equal the
    automaton's over the same documents (so no match crosses two documents)."""
    vocab = 0xFFFE if seed == 7 else 5  # seed 7: the largest vocabulary 16 bits hold beside the separator
    store, tokens, offsets = build(tmp_path / "s.sa", seed, vocab=vocab)
    sa, sam = store.structure, SuffixAutomaton.build(tokens, offsets)
    rng = np.random.default_rng(100 + seed)
    for _ in range(150):
        start = rng.integers(0, len(tokens))
        context = np.concatenate((tokens[start:start + rng.integers(0, 12)], tokens[rng.integers(0, len(tokens), 3)]))
        state, length = sam.match(context.astype(np.int32))
        lo, hi, sa_length = sa.match(context)
        assert sa_length == length, context
        if length:
            assert hi - lo == sam.count(state)
            for k in (1, 3, 8):
                np.testing.assert_array_equal(np.stack(sa.topk_next(lo, hi, length, k)), np.stack(sam.topk_next(state, k)))
        np.testing.assert_array_equal(sa.continuation(lo, hi, sa_length, 9), sam.continuation(state, 9))


@pytest.mark.parametrize("seed", range(4))
def test_cursor_streams_like_the_automatons(tmp_path, seed):
    """peek / advance / draft / tree over a growing text: the suffix array's cursor answers what the
    automaton's does (the REST tree included)."""
    store, tokens, offsets = build(tmp_path / "s.sa", seed)
    sa_cursor, sam_cursor = cursor(store.structure), cursor(SuffixAutomaton.build(tokens, offsets))
    rng = np.random.default_rng(seed)
    text = tokens[: rng.integers(1, 6)]
    sa_cursor.reset(text)
    sam_cursor.reset(text)
    for _ in range(60):
        t0 = int(rng.integers(0, 5))
        (a_len, a), (b_len, b) = sa_cursor.peek(t0), sam_cursor.peek(t0)
        assert a_len == b_len
        np.testing.assert_array_equal(sa_cursor.draft(a, 7), sam_cursor.draft(b, 7))
        for span in (2, 16):
            for got, want in zip(sa_cursor.tree(a, a_len, span, 12, 4), sam_cursor.tree(b, b_len, span, 12, 4)):
                np.testing.assert_array_equal(got, want)
        step = np.concatenate(([t0], rng.integers(0, 5, rng.integers(0, 3)))).astype(np.int32)
        sa_cursor.advance(step)
        sam_cursor.advance(step)


def test_damaged_truncated_and_foreign_stores_are_refused(tmp_path):
    path = tmp_path / "s.sa"
    build(path, 0)
    assert load_datastore(path).kind == "sa"
    load_suffix_array(path, verify=True)

    def copy(name: str):
        target = tmp_path / name
        shutil.copytree(path, target)
        return target

    truncated = copy("truncated.sa")
    with open(truncated / "table.0", "r+b") as f:
        f.truncate(os.path.getsize(truncated / "table.0") - 1)
    flipped = copy("flipped.sa")
    with open(flipped / "tokenized.0", "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 1]))
    newer = copy("newer.sa")
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    lying = copy("lying.sa")
    manifest["sa"]["tokens"] += 1
    (lying / "manifest.json").write_text(json.dumps(manifest))
    foreign = tmp_path / "foreign.sa"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"format": "something else", "kind": "sa"}')
    for store, message in ((truncated, "truncated"), (newer, "upgrade samctl"), (lying, "disagree"),
                           (foreign, "format is not")):
        with pytest.raises(StoreError, match=message) as err:
            load_datastore(store)
        assert "\n" not in str(err.value)
    load_datastore(flipped)  # sizes agree: only the checksum tells
    with pytest.raises(StoreError, match="checksum"):
        load_datastore(flipped, verify=True)


def test_vocabularies_past_16_bits_are_refused_in_one_line(tmp_path):
    tokens, offsets = corpus(0)
    with pytest.raises(Exception, match="16-bit token ids") as err:
        build_suffix_array(tmp_path / "s.sa", tokens, offsets, meta(tokens, offsets, 0xFFFF))
    assert "\n" not in str(err.value) and not (tmp_path / "s.sa").exists()


# ---------------------------------------------------------------------------------------------
# drafting: every store-reading method, unchanged, from an `sa` store


@pytest.mark.parametrize("method", ["sam", "rest"])
def test_store_methods_replay_alike_from_suffix_array_and_automaton(tmp_path, method):
    """Same corpus, same trace: `sam` and `rest` draft exactly what they draft from the automaton."""
    import torch

    from samctl.decode.methods import MethodConfig, make_drafter
    from samctl.decode.simulate import make_trace, replay

    rng = np.random.default_rng(5)
    docs = [rng.integers(3, 300, 400) for _ in range(3)]
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64)
    tokens = np.concatenate(docs).astype(np.int32)
    sa = build_suffix_array(tmp_path / "s.sa", tokens, offsets, meta(tokens, offsets, 300), memory_limit=64 << 20)
    prompt = np.concatenate((rng.integers(3, 300, 20), docs[1][50:60]))
    trace = make_trace(prompt, docs[1][60:250])
    results = []
    for static in (sa.structure, SuffixAutomaton.build(tokens, offsets)):
        drafter = make_drafter(method, vocab_size=300, device=torch.device("cpu"), eos_token_ids=(), static=static,
                               config=MethodConfig())
        results.append(replay(drafter, trace).to_dict())
    assert results[0]["mean_accepted"] > 3, results[0]
    same = ("steps", "accept_hist", "drafted", "accepted")
    assert [results[0][k] for k in same] == [results[1][k] for k in same]


def test_adaptive_drafts_long_matches_from_a_suffix_array(tmp_path):
    from samctl.decode.drafters.adaptive import AdaptiveConfig, AdaptiveDrafter
    from samctl.decode.simulate import make_trace, replay

    corpus_ids = np.random.default_rng(7).integers(3, 500, 500).astype(np.int32)
    offsets = np.array([0, len(corpus_ids)])
    sa = build_suffix_array(tmp_path / "s.sa", corpus_ids, offsets, meta(corpus_ids, offsets, 500),
                            memory_limit=64 << 20)
    prompt = np.concatenate((np.random.default_rng(8).integers(3, 500, 20), corpus_ids[100:110]))
    drafter = AdaptiveDrafter(AdaptiveConfig(recycle=False), static=sa.structure)
    m = replay(drafter, make_trace(prompt, corpus_ids[110:300]))
    assert m.mean_accepted > 6, m.to_dict()
