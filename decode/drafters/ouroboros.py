"""`ouroboros` (Dual Decoding, Zhao et al. 2024): a draft model running lookahead, one shared pool.

Each target step (t0 = the pending token):
    1) draft   the draft model runs lookahead decoding (lookahead.py) until it has gamma new
               tokens; its window persists across steps and its n-grams go into the shared pool
    2) verify  the chain t0, x_1..x_gamma, then a trie of the pool's newest top-k tuples for
               x_gamma: a full match continues into a suffix and keeps its bonus
    3) harvest from the last accepted chain input c along every path through the rest of the
               chain and a suffix, the target's argmax at N-1 inputs is a new pool tuple keyed by
               c's token (inserted newest: a wrong tuple ages out of the LRU row)
    4) crop    the draft's cache is cut to the committed text it holds
Drafts are the draft's argmax, so the engine's rule is lossless for greedy and sampling alike.
Fixed from the reference code: the rollback works for any layer count, the rejection harvest
really inserts, and a full match keeps its bonus.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch

from samctl.decode.draft_model import DraftModel, extend, keep_rows, verify_rows
from samctl.decode.drafters.base import DraftsTogether
from samctl.decode.drafters.lookahead import JacobiWindow, NgramPool, RemembersPool, DeferredPool, guess_trie
from samctl.decode.engine.batched import verify_input
from samctl.decode.engine.transfer import to_device
from samctl.decode.tree import DraftTree, walk_tree
from samctl.decode.configs import OuroborosConfig


class OuroborosDrafter(RemembersPool, DraftsTogether):
    name = "ouroboros"

    def __init__(self, draft: DraftModel, config: OuroborosConfig = OuroborosConfig(), gamma: int = 4,
                 pool_text: bool = True, vocab_size: int = 0) -> None:
        self.config, self.gamma, self.pool_text = config, gamma, pool_text
        self.draft = draft
        self.vocab = min(draft.vocab, vocab_size) if vocab_size else draft.vocab
        self.pool = NgramPool(config.ngram - 1, config.window, self.vocab)
        self.documents = deque(maxlen=config.memory)
        self.window = JacobiWindow(config.ngram, config.window, draft.device)
        self.deferred = DeferredPool(draft.device)
        self.rng = np.random.default_rng(config.seed)
        self.history = np.zeros(0, dtype=np.int64)  # prompt + committed text
        self.produced = np.zeros(0, dtype=np.int64)  # the draft's tokens after t0 in the last propose
        self.tree: DraftTree | None = None
        self.chain = 0  # drafts in the last proposed tree's chain
        self.forwards = 0  # draft forwards, for reports

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        self._begin()
        self.history = np.asarray(prompt, dtype=np.int64).copy()
        if self.pool_text:
            self.pool.learn_text(self.history)
        self.window.seed(self.history, self.rng)
        self.draft.reset()
        extend([self.draft], [self.history[: self.draft.max_positions - 1]])
        self.produced = np.zeros(0, dtype=np.int64)
        self.ready = None

    @staticmethod
    def draft_together(drafters: Sequence["OuroborosDrafter"], t0s: Sequence[int]) -> list[DraftTree]:
        return lookahead(drafters, t0s)

    def _tree(self, t0: int, produced: list[int]) -> DraftTree:
        self.produced = np.asarray(produced, dtype=np.int64)
        drafts = self.produced[: self.gamma]
        # 2) the target's tree: the chain, then the pool's suffixes for its last token
        key = int(drafts[-1]) if len(drafts) else t0
        tokens, parents = guess_trie(self.pool, key, self.config.topk)
        parents = np.where(parents < 0, len(drafts) - 1, parents + len(drafts)).astype(np.int32)
        self.chain = len(drafts)
        self.tree = DraftTree(tokens=np.concatenate((drafts, tokens)),
                              parents=np.concatenate((np.arange(-1, len(drafts) - 1, dtype=np.int32), parents)),
                              is_chain=len(tokens) == 0)
        return self.tree

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        committed = np.asarray(committed, dtype=np.int64)
        before = len(self.history)
        self.history = np.concatenate((self.history, committed))
        if self.pool_text:
            self.pool.learn_text(self.history[-(len(committed) + self.pool.n):], self.pool.n)
        # 4) crop: the cache holds history[:before] + t0 + produced[:-1]; keep what was committed
        if self.draft.cached > before:
            held = self.draft.cached - before - 1
            ours, theirs = self.produced[:held], committed[1 : 1 + held]
            same = len(theirs) if np.array_equal(ours[: len(theirs)], theirs) else int(np.argmax(ours[: len(theirs)] != theirs))
            self.draft.keep(before + 1 + same)
        if logits is not None and self.tree is not None and logits.shape[0] == 1 + len(self.tree):
            self._harvest(committed, input_ids, logits)

    def report(self) -> dict:
        return {"pool_tuples": len(self.pool), "pool_keys": self.pool.rows, "draft_forwards": self.forwards}

    # -- the draft's lookahead ---------------------------------------------------------------

    def _plan(self, feed: np.ndarray) -> tuple | None:
        # feed: [k] int64, k-1 committed tokens the draft has not cached, then lst.
        # -> (input ids, tree, parents, base, anchor) of this row's next draft forward: the feed,
        # the pool's guesses for lst and the Jacobi window; None when the context is full
        window, device = self.window, self.draft.device
        k = len(feed)
        lst, anchor = int(feed[-1]), k - 2  # lst's node index (-1: the root)
        guess, guess_parents = guess_trie(self.pool, lst, self.config.window)
        base = k - 1 + len(guess)
        window_tokens, window_parents = window.layout(lst, anchor, base) if window.active else (
            torch.zeros(0, dtype=torch.int64, device=device), np.zeros(0, dtype=np.int32))
        parents = np.concatenate((np.arange(-1, k - 2, dtype=np.int32),
                                  np.where(guess_parents < 0, anchor, guess_parents + k - 1).astype(np.int32),
                                  window_parents))
        if self.draft.cached + 1 + len(parents) > self.draft.max_positions:
            return None
        guess_ids = to_device(np.concatenate((feed[1:], guess)), device)
        tree = DraftTree(tokens=torch.cat((guess_ids, window_tokens)), parents=parents, accept_limit=base)
        return verify_input(int(feed[0]), tree, device), tree, parents, base, anchor

    # -- 3) harvest --------------------------------------------------------------------------

    def _harvest(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        tree, n = self.tree, self.pool.n
        c = min(len(committed) - 1, self.chain)  # the last accepted chain input (0 = t0)
        leaves = [i for i in range(self.chain, len(tree)) if not np.any(tree.parents == i)]
        suffixes = []
        for leaf in leaves:  # the input indices of the suffix from below x_gamma down to the leaf
            suffix, node = [], leaf
            while node >= self.chain:
                suffix.append(node + 1)
                node = int(tree.parents[node])
            suffixes.append(suffix[::-1])
        chain = list(range(c, self.chain + 1))  # chain inputs c..gamma, then a suffix
        paths = [path[:n] for path in (chain + suffix for suffix in suffixes or [[]]) if len(path) >= n]
        if not paths:
            return
        rows = np.asarray(paths, dtype=np.int64)
        argmax = logits[:, : self.vocab].argmax(dim=-1).cpu().numpy()
        self.pool.insert(np.full(len(rows), committed[c], dtype=np.int32), argmax[rows])


def lookahead(drafters: Sequence[OuroborosDrafter], t0s: Sequence[int]) -> list[DraftTree]:
    """1) draft, for rows of one draft model: each row feeds the history its cache lacks + t0, then
    its last token, until it has gamma new tokens or no room; one draft forward a round."""
    feeds = [np.append(d.history[d.draft.cached:], t0) for d, t0 in zip(drafters, t0s)]
    produced: list[list[int]] = [[] for _ in drafters]
    live = list(range(len(drafters)))
    while live:
        steps = _lookahead_steps([drafters[i] for i in live], [feeds[i] for i in live])
        going = []
        for i, step in zip(live, steps):
            produced[i] += step
            if step and len(produced[i]) < drafters[i].gamma:
                feeds[i] = np.asarray(step[-1:], dtype=np.int64)
                going.append(i)
        live = going
    return [d._tree(t0, p) for d, t0, p in zip(drafters, t0s, produced)]


def _lookahead_steps(drafters: Sequence[OuroborosDrafter], feeds: Sequence[np.ndarray]) -> list[list[int]]:
    # -> per row the tokens its draft forward commits after its feed's last token (accepted
    # guesses, then the draft's argmax); [] for a row whose context is full
    plans = [d._plan(feed) for d, feed in zip(drafters, feeds)]
    going = [j for j, plan in enumerate(plans) if plan is not None]
    out: list[list[int]] = [[] for _ in drafters]
    if not going:
        return out
    logits = verify_rows([drafters[j].draft for j in going], [plans[j][0] for j in going], [plans[j][1] for j in going])
    choices = [row_logits[:, : drafters[j].vocab].argmax(dim=-1) for j, row_logits in zip(going, logits)]
    for j, chosen in zip(going, choices):
        d, (_, _, _, base, anchor) = drafters[j], plans[j]
        d.forwards += 1
        if d.window.active:
            grams = d.window.update(chosen[to_device(d.window.top_rows(anchor + 1, base + 1), chosen.device)])
            if grams is not None:
                d.deferred.put(d.pool, *grams)  # on a GPU: reaches the pool one draft forward late, no sync
    # the draft's tokens decide each row's next input: one transfer for every row
    host = torch.cat([torch.stack((plans[j][0], chosen)) for j, chosen in zip(going, choices)], dim=1).cpu().numpy()
    paths, start = [], 0
    for j in going:
        ids, _, parents, base, anchor = plans[j]
        row = host[:, start: start + len(ids)]
        start += len(ids)
        path = walk_tree(parents, row[0][1:], row[1], base, anchor)
        paths.append(path)
        out[j] = [int(t) for t in row[0][path[len(feeds[j]):]]] + [int(row[1][path[-1]])]
    keep_rows([drafters[j].draft for j in going], paths)
    return out
