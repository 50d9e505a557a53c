"""`ouroboros` (Dual Decoding, Zhao et al. 2024): a draft model running lookahead, one shared pool.

Each target step (t0 = the pending token):
    1) draft   the draft model runs lookahead decoding (decode/drafters/lookahead.py) until it has
               gamma new tokens: each of its forwards verifies the pool's guesses for its last token
               plus its own Jacobi window, so one forward can accept a whole phrase, and its window's
               n-grams go into the shared pool. Its window persists across steps.
    2) verify  the target's tree is the chain t0, x_1..x_gamma, then a trie of the pool's newest
               top-k tuples for x_gamma below x_gamma: one forward checks drafts and suffixes, a
               full match continues into a suffix and keeps its bonus
    3) harvest from the last accepted chain input c (key: its token) along every path through the
               rest of the chain and a suffix, the target's argmax at each input, N-1 of them, is a
               pool tuple: the target's own continuation at rejected positions, or the suffixes
               as corrected by the target after a full match (inserted newest, not overwritten in
               place: the wrong tuple ages out of the LRU row)
    4) crop    the draft's cache is cut to the committed text it holds; its window is kept

Drafts are deterministic (the draft's argmax), so the engine's rule is lossless for greedy and
sampling alike. Fixed from the reference code: the draft's rollback works for any layer count
(the engine's own cache), the rejection harvest really inserts, and a full match keeps its bonus.
The draft model runs through a second `TargetModel` (static cache, tree mask); the pool and its
cross-request memory behave as lookahead's.
"""
from __future__ import annotations


import numpy as np
import torch

from samctl.decode.draft_model import DraftModel
from samctl.decode.drafters.lookahead import JacobiWindow, NgramPool, PoolMemory, RemembersPool, DeferredPool, guess_trie
from samctl.decode.engine.target import TargetModel
from samctl.decode.engine.transfer import to_device
from samctl.decode.tree import DraftTree, walk_tree
from samctl.decode.configs import OuroborosConfig


class OuroborosDrafter(RemembersPool):
    name = "ouroboros"

    def __init__(self, draft: DraftModel, config: OuroborosConfig = OuroborosConfig(), gamma: int = 4,
                 pool_text: bool = True, vocab_size: int = 0) -> None:
        self.config, self.gamma, self.pool_text = config, gamma, pool_text
        self.engine = TargetModel(draft.model)
        self.vocab = min(draft.vocab, vocab_size) if vocab_size else draft.vocab
        self.pool = NgramPool(config.ngram - 1, config.window, self.vocab)
        self.memory = PoolMemory(self.pool, config.memory)
        self.window = JacobiWindow(config.ngram, config.window, self.engine.device)
        self.deferred = DeferredPool(self.engine.device)
        self.rng = np.random.default_rng(config.seed)
        self.history = np.zeros(0, dtype=np.int64)  # prompt + committed text
        self.produced = np.zeros(0, dtype=np.int64)  # the draft's tokens after t0 in the last propose
        self.tree: DraftTree | None = None
        self.chain = 0  # drafts in the last proposed tree's chain
        self.forwards = 0  # draft forwards, for reports

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None) -> None:
        self.memory.begin()
        self.history = np.asarray(prompt, dtype=np.int64).copy()
        if self.pool_text:
            self.pool.learn_text(self.history)
        self.window.seed(self.history, self.rng)
        n = len(self.history)
        self.engine.prefill(to_device(self.history[: self.engine.max_positions - 1], self.engine.device),
                            reserve=n + 256)
        self.produced = np.zeros(0, dtype=np.int64)

    def propose(self, t0: int) -> DraftTree:
        # 1) draft: the draft's cache holds history[:c]; feed history[c:] + t0 with the first step
        feed = np.append(self.history[self.engine.cached:], t0)
        produced: list[int] = []
        while len(produced) < self.gamma:
            step = self._lookahead_step(feed)
            if not step:
                break
            produced += step
            feed = np.asarray(step[-1:], dtype=np.int64)
        self.produced = np.asarray(produced, dtype=np.int64)
        drafts = self.produced[: self.gamma]
        # 2) the target's tree: the chain, then the pool's suffixes for its last token
        key = int(drafts[-1]) if len(drafts) else t0
        tokens, parents = guess_trie(self.pool, key, self.config.topk)
        parents = np.where(parents < 0, len(drafts) - 1, parents + len(drafts)).astype(np.int32)
        self.chain = len(drafts)
        tree = DraftTree(tokens=np.concatenate((drafts, tokens)),
                         parents=np.concatenate((np.arange(-1, len(drafts) - 1, dtype=np.int32), parents)),
                         is_chain=len(tokens) == 0)
        self.tree = tree
        return tree

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        committed = np.asarray(committed, dtype=np.int64)
        before = len(self.history)
        self.history = np.concatenate((self.history, committed))
        if self.pool_text:
            self.pool.learn_text(self.history[-(len(committed) + self.pool.n):], self.pool.n)
        # 4) crop: the cache holds history[:before] + t0 + produced[:-1]; keep what was committed
        if self.engine.cached > before:
            held = self.engine.cached - before - 1
            ours, theirs = self.produced[:held], committed[1 : 1 + held]
            same = len(theirs) if np.array_equal(ours[: len(theirs)], theirs) else int(np.argmax(ours[: len(theirs)] != theirs))
            self.engine.truncate(before + 1 + same)
        if logits is not None and self.tree is not None and logits.shape[0] == 1 + len(self.tree):
            self._harvest(committed, input_ids, logits)

    def report(self) -> dict:
        return {"pool_tuples": len(self.pool), "pool_keys": self.pool.rows, "draft_forwards": self.forwards}

    # -- the draft's lookahead ---------------------------------------------------------------

    def _lookahead_step(self, feed: np.ndarray) -> list[int]:
        # feed: [k] int64, k-1 committed tokens the draft has not cached, then lst.
        # -> the tokens this draft forward commits after lst (accepted guesses, then its argmax)
        engine, window = self.engine, self.window
        k = len(feed)
        lst, anchor = int(feed[-1]), k - 2  # lst's node index (-1: the root)
        guess, guess_parents = guess_trie(self.pool, lst, self.config.window)
        base = k - 1 + len(guess)
        window_tokens, window_parents = window.layout(lst, anchor, base) if window.active else (
            torch.zeros(0, dtype=torch.int64, device=engine.device), np.zeros(0, dtype=np.int32))
        parents = np.concatenate((np.arange(-1, k - 2, dtype=np.int32),
                                  np.where(guess_parents < 0, anchor, guess_parents + k - 1).astype(np.int32),
                                  window_parents))
        if engine.cached + 1 + len(parents) > engine.max_positions:
            return []
        guess_ids = to_device(np.concatenate((feed[1:], guess)), engine.device)
        tree = DraftTree(tokens=torch.cat((guess_ids, window_tokens)), parents=parents, accept_limit=base)
        ids = engine.verify_input(int(feed[0]), tree)
        logits = engine.verify(ids, tree)
        self.forwards += 1
        choices = logits[:, : self.vocab].argmax(dim=-1)
        if window.active:
            grams = window.update(choices[to_device(window.top_rows(anchor + 1, base + 1), choices.device)])
            if grams is not None:
                self.deferred.put(self.pool, *grams)  # on a GPU: reaches the pool one draft forward late, no sync
        host = torch.stack((ids, choices)).cpu().numpy()  # the draft's tokens decide its next input
        path = walk_tree(parents, host[0][1:], host[1], base, anchor)
        engine.keep(path)
        return [int(t) for t in host[0][path[k:]]] + [int(host[1][path[-1]])]

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
        paths = []
        for suffix in suffixes or [[]]:  # chain inputs c..gamma, then the suffix
            path = list(range(c, self.chain + 1)) + suffix
            if len(path) >= n:
                paths.append(path[:n])
        if not paths:
            return
        rows = np.asarray(paths, dtype=np.int64)
        argmax = logits[:, : self.vocab].argmax(dim=-1).cpu().numpy()
        self.pool.insert(np.full(len(rows), committed[c], dtype=np.int32), argmax[rows])
