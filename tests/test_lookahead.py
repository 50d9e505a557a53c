"""lookahead and ouroboros: the pool against a naive LRU, the window's mask against the lookahead
paper's (Fu et al. 2024), context rows never accepted, cross-request memory, and lossless decoding on the copy
mock (which fails loudly on a wrong mask, position or KV rollback)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from samctl.decode.draft_model import DraftModel
from samctl.decode.drafters.lookahead import (JacobiWindow, LookaheadConfig, LookaheadDrafter, NgramPool, trie_of,
                                       window_parents)
from samctl.decode.drafters.ouroboros import OuroborosConfig
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import MethodConfig, make_drafter
from samctl.decode.engine.target import TargetModel
from samctl.decode.tree import ancestor_matrix, tree_depths, walk_tree
from tests.mock_lm import CopyLM
from tests.test_decode_greedy import hf_greedy, prompts


class NaivePool:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.rows = capacity, {}

    def insert(self, key: int, gram: tuple) -> None:
        row = self.rows.setdefault(key, OrderedDict())
        row.pop(gram, None)
        row[gram] = None
        if len(row) > self.capacity:
            row.popitem(last=False)

    def newest(self, key: int, k: int) -> list[tuple]:
        return list(reversed(self.rows.get(key, {})))[:k]


@pytest.mark.parametrize("seed", range(6))
def test_pool_is_an_lru_per_key(seed):
    rng = np.random.default_rng(seed)
    n, capacity = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    pool, naive = NgramPool(n, capacity, vocab_size=3), NaivePool(capacity)
    for _ in range(30):  # batches over a small alphabet: many repeats, evictions, new keys past V
        keys = rng.integers(0, 6, int(rng.integers(0, 8)))
        grams = rng.integers(0, 3, (len(keys), n))
        pool.insert(keys, grams)
        for key, gram in zip(keys, grams):
            naive.insert(int(key), tuple(int(t) for t in gram))
        for key in range(7):
            assert [tuple(g) for g in pool.newest(key, capacity).tolist()] == naive.newest(key, capacity)
            assert [tuple(g) for g in pool.newest(key, 2).tolist()] == naive.newest(key, 2)


def test_pool_learns_text_and_restores_a_snapshot():
    pool = NgramPool(2, 4, vocab_size=10)
    pool.learn_text(np.array([5, 1, 2, 5, 1, 3]))
    assert pool.newest(5, 4).tolist() == [[1, 3], [1, 2]] and pool.newest(1, 4).tolist() == [[2, 5]]
    state = pool.snapshot()
    pool.learn_text(np.array([7, 8, 9, 5, 9, 9]))
    assert len(pool) == 4 + 4
    pool.restore(state)
    assert len(pool) == 4 and pool.newest(7, 4).shape == (0, 2) and pool.newest(5, 4).tolist() == [[1, 3], [1, 2]]


def test_trie_merges_prefixes_and_the_walk_finds_the_longest_tuple():
    tuples = np.array([[4, 5, 6], [4, 5, 7], [4, 8, 1], [2, 2, 2]], dtype=np.int32)
    tokens, parents = trie_of(tuples)
    assert len(tokens) == 9  # 4 -> 5 -> {6, 7}, 4 -> 8 -> 1, 2 -> 2 -> 2
    for gram in tuples:  # each tuple is a root path: a target choosing it accepts all of it
        choices = np.full(len(tokens) + 1, -1, dtype=np.int64)
        path = [0]
        for token in gram:
            choices[path[-1]] = token
            nxt = [i for i in range(len(tokens)) if parents[i] == path[-1] - 1 and tokens[i] == token]
            path.append(nxt[0] + 1)
        assert walk_tree(parents, tokens, choices).tolist() == path


@pytest.mark.parametrize("n,w,fill", [(5, 4, 3), (5, 4, 1), (5, 4, 0), (3, 6, 1), (2, 3, 0)])
def test_window_mask_and_positions_follow_section_8(n, w, fill):
    """Row 0 token i (after lst) sits at p+1+i and sees lst and row0[..i]; row l column i at p+l+i
    sees lst, row0 tokens 1..i and rows 1..l of column i."""
    m = w + (n - 2 - fill)
    parents = window_parents(m, fill)
    visible, depth = ancestor_matrix(parents), tree_depths(parents)
    where = {(0, 0): 0}  # (row, column) -> input index, lst at 0
    for i in range(1, m):
        where[(0, i)] = i
    for level in range(1, fill + 1):
        for i in range(m):
            where[(level, i)] = m + (level - 1) * m + i
    for (level, i), row in where.items():
        if row:
            assert depth[row - 1] == level + i, (level, i)
        expected = {0} | {where[(0, j)] for j in range(1, i + 1)} | {where[(l, i)] for l in range(1, level + 1)}
        assert set(np.flatnonzero(visible[row]).tolist()) == expected, (level, i)


def test_context_rows_are_never_accepted():
    parents = np.array([-1, 0, -1, 2], dtype=np.int32)  # a draft 6 -> 8, then a context chain 7 -> 9
    tokens = np.array([6, 8, 7, 9])
    choices = np.array([7, 8, 8, 9, 9])  # the target wants 7 then 9: only the context row has it
    assert walk_tree(parents, tokens, choices).tolist() == [0, 3, 4]
    assert walk_tree(parents, tokens, choices, 2).tolist() == [0]
    assert walk_tree(parents, tokens, choices, 0).tolist() == [0]
    # a known chain before the walk (ouroboros feeding uncached tokens first): node 0 taken unchecked
    assert walk_tree(parents, tokens, choices, 2, 0).tolist() == [0, 1, 2]


def test_window_update_pools_columns_and_shifts():
    window = JacobiWindow(ngram=4, width=3, device=torch.device("cpu"))
    window.seed(np.array([10, 11, 12, 13]), np.random.default_rng(0))
    for fill in range(2):  # warm-up: one level per step, one column fewer
        assert window.fill == fill and window.columns == 3 + 2 - fill
        assert window.update(torch.arange(window.columns) + 100 * (fill + 1)) is None
    window.layout(50, -1, 0)
    before = window.grid[:, :3].clone()
    keys, grams = window.update(torch.tensor([7, 8, 9]))
    assert keys.tolist() == before[0].tolist() and keys[0] == 50
    assert grams.tolist() == torch.cat((before[1:].T, torch.tensor([[7], [8], [9]])), 1).tolist()
    assert window.grid[:2, :3].tolist() == before[1:].tolist() and window.grid[2, :3].tolist() == [7, 8, 9]


def copy_run(drafter, prompt, n, model=None):
    model = model or CopyLM(vocab=32)
    return generate(TargetModel(model), drafter, prompt, GenerationConfig(max_new_tokens=n))


def test_the_window_alone_finds_ngrams(tiny_llama):
    """No text n-grams: whatever the pool guesses came from the Jacobi window. (Not on the copy
    mock: its fallback rule is a bijection, so a window seeded off the output's cycle never
    reaches it.)"""
    prompt = prompts(96)[1]
    drafter = LookaheadDrafter(LookaheadConfig(ngram=4, window=6, guesses=6, pool_text=False), 96)
    result = generate(TargetModel(tiny_llama), drafter, prompt, GenerationConfig(max_new_tokens=80))
    assert result.tokens == hf_greedy(tiny_llama, prompt, 80, eos=None)
    assert result.metrics.accepted > 20 and result.metrics.mean_accepted > 1.3, result.metrics.to_dict()


def test_pool_persists_across_requests_unless_remember_is_off():
    model = CopyLM(vocab=32)
    prompt = np.random.default_rng(1).integers(0, 32, 10).tolist()
    drafter = LookaheadDrafter(LookaheadConfig(ngram=4, window=4, guesses=4, pool_text=False), 32)
    first = copy_run(drafter, prompt, 60, model).metrics
    drafter.remember = False
    size = len(drafter.pool)
    second = copy_run(drafter, prompt, 60, model).metrics
    assert len(drafter.pool) == size and len(drafter.memory_documents()) == 1  # undone, not remembered
    assert second.mean_accepted > first.mean_accepted  # it drafted from what the first request learnt
    fresh = LookaheadDrafter(LookaheadConfig(ngram=4, window=4, guesses=4, pool_text=False), 32)
    fresh.load_memory(drafter.memory_documents())
    assert copy_run(fresh, prompt, 60, model).metrics.mean_accepted > first.mean_accepted


def test_simulate_replays_the_pool_without_a_window():
    from samctl.decode.simulate import make_trace, replay

    drafter = LookaheadDrafter(LookaheadConfig(ngram=3, guesses=4), 50)
    trace = make_trace([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 1, 2, 3], max_new_tokens=9)
    metrics = replay(drafter, trace)
    assert not drafter.window.active and metrics.accepted >= 4, metrics.to_dict()


@pytest.mark.parametrize("method", ["lookahead", "ouroboros"])
def test_greedy_equals_generate_with_eos_and_limits(tiny_llama, method):
    from tests.test_draft_model import near_draft

    # a draft that agrees with the target often: an unrelated one has every draft rejected
    draft = DraftModel(near_draft(tiny_llama), 96) if method == "ouroboros" else None
    config = MethodConfig(lookahead=LookaheadConfig(ngram=4, window=5, guesses=5),
                          ouroboros=OuroborosConfig(ngram=4, window=5))
    prompt = prompts(96)[0]
    expected = hf_greedy(tiny_llama, prompt, 60, eos=None)
    eos = expected[17]
    for limit, stop in ((60, (eos,)), (1, ()), (2, ()), (33, ())):
        drafter = make_drafter(method, vocab_size=96, device=torch.device("cpu"), eos_token_ids=stop,
                               config=config, draft=draft)
        result = generate(TargetModel(tiny_llama), drafter, prompt,
                          GenerationConfig(max_new_tokens=limit, eos_token_ids=stop))
        want = expected[: expected.index(eos) + 1] if stop else expected[:limit]
        assert result.tokens == want, (method, limit)
        if limit == 33:
            assert 0 < result.metrics.accepted < result.metrics.drafted, (method, result.metrics.to_dict())


def test_ouroboros_self_draft_accepts_phrases_and_keeps_its_cache_right(tiny_llama):
    """The target as its own draft: a stale or wrongly cropped draft cache would show as rejected
    drafts; the draft's lookahead accepts pool phrases, so it needs fewer forwards than tokens."""
    prompt = prompts(96)[1]
    drafter = make_drafter("ouroboros", vocab_size=96, device=torch.device("cpu"), draft=DraftModel(tiny_llama, 96))
    result = generate(TargetModel(tiny_llama), drafter, prompt, GenerationConfig(max_new_tokens=100))
    m = result.metrics
    assert result.tokens == hf_greedy(tiny_llama, prompt, 100, eos=None)
    assert m.mean_accepted > 4.5, m.to_dict()  # gamma 4 plus the bonus, and suffixes beyond
    assert drafter.forwards < m.new_tokens, drafter.report()
    assert drafter.draft.cached <= len(prompt) + len(result.tokens)
