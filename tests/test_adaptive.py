"""`adaptive`: sources, scoring, cost-aware size, memory across requests, predictions.

Model-free: drafts are replayed against known references (decode.simulate.replay, which equals the
engine on the model's own output; tests/test_simulate.py). Greedy equality with plain decoding
and the chi-square sampling test run for every method in test_decode_greedy / _sampling.
"""
from __future__ import annotations

import numpy as np
import pytest

from samctl.decode.engine.cost import VerifyCost, linear_cost
from samctl.decode.drafters.adaptive import AdaptiveConfig, AdaptiveDrafter, Calibration
from samctl.decode.drafters.candidates import N_CELLS, select
from samctl.decode.drafters.base import NoDraft
from samctl.decode.simulate import make_trace, replay
from samctl.index.automaton import SuffixAutomaton
from samctl.index.ngram import NgramConfig, NgramTable

VOCAB = 500


def drafter(**settings) -> AdaptiveDrafter:
    cost = settings.pop("cost", None)
    static = settings.pop("static", None)
    return AdaptiveDrafter(AdaptiveConfig(recycle=False, **settings), static=static, cost=cost)


def random_doc(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, n)


def test_copy_from_prompt_drafts_long_and_is_accepted():
    doc = random_doc(0, 300)
    m = replay(drafter(), make_trace(np.concatenate((doc, random_doc(1, 20), doc[:4])), doc[4:260]))
    assert m.mean_accepted > 8, m.to_dict()


def test_steep_cost_drafts_narrow_flat_cost_drafts_wide():
    # Two competing continuations of the same context: a flat cost curve buys both branches, a
    # steep one (each node costing a whole forward) keeps only what is nearly sure.
    tok = np.array([10, 11, 12, 20, 21, 22], dtype=np.int32)
    par = np.array([-1, 0, 1, -1, 3, 4], dtype=np.int32)
    prob = np.array([0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    cell = np.zeros(6, dtype=np.int32)
    flat = select(tok, par, prob, cell, 6, linear_cost(0.0), 64, 0.0)
    steep = select(tok, par, prob, cell, 6, linear_cost(1.0), 64, 0.0)
    assert len(flat[0]) == 6 and len(steep[0]) == 0
    mid = select(tok, par, prob, cell, 6, linear_cost(0.3), 64, 0.0)
    assert 0 < len(mid[0]) < 6
    # kept nodes are the most probable, parents first
    assert mid[0].tolist() == [10, 11, 12, 20][: len(mid[0])]
    assert all(p < i for i, p in enumerate(mid[1]))


def test_a_long_context_prices_drafts_dearer_and_gets_shorter_ones():
    # VerifyCost: t(n) measured after 256 and after 1024 committed entries, linear in between and
    # beyond, relative to t(1) at the same context. Here each input row's attention costs 6 ms more
    # at 1024 than at 256, so a draft that pays after a short prompt does not after a long one.
    n = np.arange(1, 65, dtype=np.float64)
    cost = VerifyCost.measured(list(10.0 + 0.5 * n), list(10.0 + 6.5 * n), (256, 1024))
    assert cost.at(100)[8] < cost.at(1024)[8] < cost.at(4000)[8]
    assert cost.at(260) is cost.at(300)  # one bucket, computed once
    fixed = VerifyCost.fixed(linear_cost(0.1))
    assert fixed.at(10) is fixed.at(5000) is fixed.relative
    with pytest.raises(Exception, match="non-decreasing"):
        VerifyCost.fixed(np.array([1.0, 0.5]))
    doc, tail = random_doc(0, 300), random_doc(1, 20)
    sizes = []
    for prefix in (np.zeros(0, dtype=np.int64), random_doc(2, 3000)):
        d = drafter(cost=cost)
        d.start(np.concatenate((prefix, doc, tail, doc[:4])), None)
        sizes.append(len(d.propose(int(doc[4])).tokens))
    assert sizes[0] > sizes[1], sizes


def test_select_merges_same_path_from_two_sources():
    tok = np.array([7, 8, 7, 9], dtype=np.int32)
    par = np.array([-1, 0, -1, 2], dtype=np.int32)  # two sources: 7->8 and 7->9
    prob = np.array([0.5, 0.4, 0.9, 0.3])
    tokens, parents, _, _ = select(tok, par, prob, np.zeros(4, np.int32), 4, linear_cost(0.0), 64, 0.0)
    assert sorted(tokens.tolist()) == [7, 8, 9] and (parents == -1).sum() == 1


def test_ngram_store_with_a_long_match_drafts_at_default_settings():
    # An n-gram store's matches are at most max_n tokens long, so length thresholds made for
    # automata never fire; a 30-token exact match must still draft.
    answer = random_doc(2, 200)
    table = NgramTable.build(answer.astype(np.int32), np.array([0, len(answer)]), NgramConfig(max_n=4, min_count=1))
    prompt = np.concatenate((random_doc(3, 30), answer[:30]))
    m = replay(drafter(static=table), make_trace(prompt, answer[30:150]))
    assert m.mean_accepted > 4, m.to_dict()
    from samctl.decode.drafters.sam import SamDrafter
    assert replay(SamDrafter(static=table), make_trace(prompt, answer[30:150])).mean_accepted > 2


def test_memory_raises_acceptance_on_a_repeated_request_and_survives_eviction():
    d = drafter(memory=3)
    requests = [(random_doc(10 + i, 30), random_doc(100 + i, 120)) for i in range(6)]
    first = [replay(d, make_trace(p, out)).mean_accepted for p, out in requests]
    assert max(first) < 2.0, first  # nothing to copy the first time
    again = replay(d, make_trace(*requests[-1])).mean_accepted
    assert again > 6, again
    assert len(d.memory) == 3  # FIFO: the oldest went first
    evicted = replay(d, make_trace(*requests[0])).mean_accepted
    assert evicted < 2.0, evicted
    off = drafter(memory=0)
    for p, out in requests:
        replay(off, make_trace(p, out))
    assert replay(off, make_trace(*requests[-1])).mean_accepted < 2.0


def _longest_suffix_in(text: list[int], docs: list[list[int]]) -> int:
    # naive reference: the longest suffix of text that occurs inside one document
    for n in range(len(text), 0, -1):
        tail = text[len(text) - n:]
        if any(doc[i:i + n] == tail for doc in docs for i in range(len(doc) - n + 1)):
            return n
    return 0


@pytest.mark.parametrize("seed", range(6))
def test_a_row_drafts_from_what_other_rows_add_to_the_shared_memory_during_its_request(seed):
    """Rows share one memory: while one row's request runs, others end and add their outputs.
    The row's memory match must be the longest suffix of its text found in the memory as it is
    now (a naive search over the documents), and its drafts those of a drafter that had held
    that memory from the start."""
    rng = np.random.default_rng(seed)
    kept, row = drafter(), drafter()
    assert row.share_memory(kept) and row.memory is kept.memory
    docs = [rng.integers(3, 7, 30).tolist() for _ in range(2)]
    kept.load_memory([np.array(d) for d in docs])
    text = rng.integers(3, 7, 12).tolist()
    row.start(np.array(text), None)
    for step in range(30):
        committed = rng.integers(3, 7, int(rng.integers(1, 4))).tolist()
        if rng.random() < 0.3:  # another row ended, its output sometimes the text this row is writing
            docs.append((text[-8:] + committed) * int(rng.random() < 0.5) + rng.integers(3, 7, 20).tolist())
            kept.memory.add(np.array(docs[-1]))
        row.observe(np.array(committed), None, None)
        text += committed
        if step % 3 == 2:
            t0 = int(rng.integers(3, 7))
            alone = drafter()
            alone.load_memory([np.array(d) for d in docs])
            alone.calibration = row.calibration  # what the row learned from its own drafts so far
            alone.start(np.array(text), None)
            ours, theirs = row.propose(t0), alone.propose(t0)
            assert row.memory_pointer.length == _longest_suffix_in(text, docs), step
            assert ours.tokens.tolist() == theirs.tokens.tolist() and ours.parents.tolist() == theirs.parents.tolist()


def test_drafters_that_share_a_memory_hold_it_once_and_learn_from_each_other():
    kept, row = drafter(), drafter()
    assert row.share_memory(kept) and row.memory is kept.memory
    prompt, answer = random_doc(30, 30), random_doc(300, 120)
    replay(row, make_trace(prompt, answer))  # a row's response: the kept drafter (batch 1) drafts from it
    assert [d.tolist() for d in kept.memory_documents()] == [answer.tolist()]
    assert replay(kept, make_trace(prompt, answer)).mean_accepted > 6
    assert not row.share_memory(NoDraft())


def test_memory_round_trips_through_documents():
    d = drafter()
    requests = [(random_doc(20 + i, 30), random_doc(200 + i, 80)) for i in range(3)]
    for p, out in requests:
        replay(d, make_trace(p, out))
    docs = d.memory_documents()
    assert [len(x) for x in docs] == [80, 80, 80]
    fresh = drafter()
    fresh.load_memory(docs)
    assert replay(fresh, make_trace(*requests[1])).mean_accepted > 6


def test_prediction_outside_the_prompt_drafts_like_the_prompt():
    # A code edit: the output is the file with a few changes. Given as --prediction (not in the
    # prompt) it must serve about as well as when the file is in the prompt.
    original = random_doc(5, 400)
    edited = original.copy()
    edited[100:103] = [1, 2, 1]
    edited[250:252] = [2, 1]
    instruction = random_doc(6, 20)
    in_prompt = replay(drafter(), make_trace(np.concatenate((instruction, original)), edited)).mean_accepted
    d = drafter()
    d.expect(original)
    predicted = replay(d, make_trace(instruction, edited)).mean_accepted
    without = replay(drafter(), make_trace(instruction, edited)).mean_accepted
    assert without < 1.5 and predicted >= 0.95 * in_prompt, (without, predicted, in_prompt)


def test_prediction_usage_counts_drafted_and_accepted_prediction_positions():
    # prediction 10..15, prompt ends 10 11: after t0 = 12 the prediction drafts 13 14 15; the
    # target accepts 13 14 (then its own 40), and the last step (seen by `finish`) drafts nothing
    d = AdaptiveDrafter(AdaptiveConfig(recycle=False, memory=0))
    d.expect([10, 11, 12, 13, 14, 15])
    d.start(np.array([1, 10, 11]), None)
    assert d.propose(12).tokens.tolist() == [13, 14, 15]
    d.observe(np.array([12, 13, 14]), None, None)
    d.propose(40)
    d.finish(np.array([12, 13, 14, 40, 41]))
    usage = d.prediction_usage()
    assert (usage.tokens, usage.accepted, usage.rejected) == (6, 2, 1)
    d.start(np.array([1, 10, 11]), None)
    assert d.prediction_usage() is None  # the next request has no prediction


@pytest.mark.parametrize("seed", range(3))
def test_prediction_usage_stays_within_the_prediction(seed):
    edited = random_doc(seed, 300)
    prediction = edited.copy()
    prediction[50:60] = random_doc(seed + 10, 10)
    d = drafter()
    d.expect(prediction)
    assert replay(d, make_trace(random_doc(seed + 20, 20), edited)).mean_accepted > 2
    usage = d.prediction_usage()
    assert usage.accepted > 0 and usage.accepted + usage.rejected <= len(prediction)


def test_calibration_learns_from_rejections():
    cal = Calibration(AdaptiveConfig())
    tokens = np.array([5, 6], dtype=np.int64)
    parents = np.array([-1, 0], dtype=np.int32)
    cells = np.array([7, 8], dtype=np.int32)
    before = cal.means[7]
    for _ in range(50):
        cal.update(tokens, parents, cells, np.zeros(0, dtype=np.int64))  # nothing accepted
    assert cal.means[7] < 0.1 * before and cal.trials[8] == 0  # node 8 was never tried
    for _ in range(200):
        cal.update(tokens, parents, cells, np.array([5, 6]))
    assert cal.means[7] > 0.75 and cal.means[8] > 0.9  # 200 hits after 50 misses
    assert cal.hits.shape == (N_CELLS,)


def test_static_automaton_and_dynamic_sources_combine():
    corpus = random_doc(7, 500)
    store = SuffixAutomaton.build(corpus.astype(np.int32), np.array([0, len(corpus)]))
    prompt = np.concatenate((random_doc(8, 20), corpus[100:110]))
    m = replay(drafter(static=store), make_trace(prompt, corpus[110:300]))
    assert m.mean_accepted > 6, m.to_dict()


@pytest.mark.parametrize("bad", [dict(max_nodes=-1), dict(min_prob=1.0), dict(memory=-2), dict(width=0)])
def test_bad_settings_are_refused(bad):
    from samctl.index.errors import UserError
    with pytest.raises(UserError):
        AdaptiveConfig(**bad)


@pytest.mark.parametrize("seed", range(15))
def test_automaton_candidates_are_continuations_in_the_documents(seed):
    # Every candidate path, after the pending token, occurs in one document; probabilities never
    # rise along a path; parents come first.
    from samctl.decode.drafters.candidates import N_CELLS, automaton_candidates

    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 5, int(rng.integers(5, 40))).astype(np.int32) for _ in range(3)]
    sam = SuffixAutomaton.build(np.concatenate(docs), np.concatenate(([0], np.cumsum([len(d) for d in docs]))))
    query = rng.integers(0, 5, 6).astype(np.int32)
    state, length = sam.match(query[:-1])
    a = sam.kernel_arrays
    out = [np.empty(128, np.int32), np.empty(128, np.int32), np.empty(128, np.float64), np.empty(128, np.int32)]
    means = np.random.default_rng(seed).uniform(0.2, 1.0, N_CELLS)
    m = automaton_candidates(a.states, a.edges, a.slots, state, length, int(query[-1]), 0, means, 1, 6, 40, 3, 0.0,
                             *out, 0)
    tok, par, prob = out[0][:m], out[1][:m], out[2][:m]
    texts = [" " + " ".join(map(str, d)) + " " for d in docs]
    for i in range(m):
        assert -1 <= par[i] < i and (par[i] < 0 or prob[i] <= prob[par[i]] + 1e-12)
        path, v = [], i
        while v >= 0:
            path.insert(0, int(tok[v]))
            v = par[v]
        needle = " " + " ".join(map(str, [int(query[-1])] + path)) + " "
        assert any(needle in t for t in texts), (needle, texts)
