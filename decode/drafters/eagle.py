"""`eagle`: EAGLE-2 dynamic draft trees from a trained head (Li et al. 2024).

The head (decode/eagle_head.py) reads pairs (f_i, x_{i+1}) of the target's feature at position i
and the token after it. Each step (t0 = the pending token, N = committed tokens):
    1) catch up  one head forward over every pair not yet in its KV cache, the last (f_{N-1}, t0)
    2) expand    the top-k tokens of the predicted feature are level 1, scored by log q; then
                 `depth` times each of the k frontier nodes gets its top-k children, scored
                 score(parent) + log q, and the best k of the k^2 become the next frontier
    3) rerank    best-first by score, the prefix of n nodes that maximises
                 (1 + sum of exp(score) x calibration) / cost[n], at most `max_nodes`
    4) observe   the head's cache drops the draft entries; the committed positions' features
                 (from the verify forward) wait for the next catch-up.
The tree is deterministic (top-k, not sampled), so the loop's rule keeps sampling lossless.
`calibration` scales exp(score) per depth by how often the head's nodes are really accepted.
On the CPU the expansion stops once no frontier node reaches `min_prob`; on a GPU every level
runs and the one host read is the final tree.
"""
from __future__ import annotations


import numba
import numpy as np
import torch

from samctl.decode.engine.cost import VerifyCost
from samctl.decode.drafters.adaptive import AdaptiveDrafter
from samctl.decode.drafters.candidates import N_CELLS
from samctl.decode.eagle_head import EagleHead
from samctl.decode.engine.kv_cache import StaticKVCache
from samctl.decode.drafters.base import Drafter, TokenHistory
from samctl.decode.tree import DraftTree, kept_parents, tree_depths
from samctl.index.errors import UserError
from samctl.decode.configs import EagleConfig
from samctl.decode.engine.transfer import to_device

MAX_DEPTH = 32  # calibration cells (depth of a node, 1-based); deeper nodes share the last


@numba.njit(cache=True)
def rerank(scores: np.ndarray, parents: np.ndarray, depths: np.ndarray, scale: np.ndarray, cost: np.ndarray,
           max_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    # scores: [c] float64 path log-probs; parents: [c] int64 candidate index (-1 = root), parents[i] < i;
    # depths: [c] int64 (1 = root child); scale: [MAX_DEPTH + 1] float64 calibration per depth;
    # cost: [n + 1] float64 relative verify cost -> (keep [n] int64 candidate indices in creation order,
    # tree parents [n] int32 into keep). Best-first by score, ties by creation, skipping a candidate
    # whose parent is not kept; the kept prefix maximises (1 + sum p) / cost[n],
    # p = min(1, exp(score) * scale[depth]).
    order = np.argsort(-scores, kind="mergesort")
    taken = np.full(len(scores), -1, dtype=np.int64)  # position in `chosen`, -1 = not taken
    chosen = np.empty(len(scores), dtype=np.int64)
    n, best_n, expected = 0, 0, 1.0
    best = 1.0 / cost[0]
    limit = min(max_nodes, len(cost) - 1)
    for idx in order:
        if n >= limit:
            break
        if parents[idx] >= 0 and taken[parents[idx]] < 0:
            continue
        taken[idx] = n
        chosen[n] = idx
        n += 1
        expected += min(1.0, np.exp(scores[idx]) * scale[min(depths[idx], len(scale) - 1)])
        value = expected / cost[n]
        if value > best:
            best, best_n = value, n
    keep = np.sort(chosen[:best_n])
    slot = np.full(len(scores), -1, dtype=np.int64)
    for i in range(best_n):
        slot[keep[i]] = i
    tree_parents = np.empty(best_n, dtype=np.int32)
    for i in range(best_n):
        p = parents[keep[i]]
        tree_parents[i] = -1 if p < 0 else slot[p]
    return keep, tree_parents


class AdaptiveEagleDrafter(AdaptiveDrafter):
    """`adaptive+eagle`: adaptive's candidates and the EAGLE head's best `offer` nodes in one trie,
    each priced by its own calibrated estimate and cut by the verify-cost curve. The head's rows
    take one extra calibration cell (N_CELLS) for bookkeeping; their probabilities come from the
    head's own per-depth calibration."""

    name = "adaptive+eagle"
    needs_hidden = True

    def __init__(self, eagle: EagleDrafter, offer: int = 32, **adaptive) -> None:
        self.eagle, self.n_offer = eagle, offer
        self._eagle_on = False
        super().__init__(**adaptive)
        c = self.calibration  # one more cell, for the head's rows
        c.prior, c.hits, c.trials = np.append(c.prior, 1.0), np.append(c.hits, 0.0), np.append(c.trials, 0.0)
        c.means = np.append(c.means, 1.0)

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor | None, hidden: torch.Tensor | None = None) -> None:
        super().start(prompt, prompt_logits)
        self._eagle_on = hidden is not None  # adaptive's own warm-up runs without the head
        if self._eagle_on:
            self.eagle.start(prompt, prompt_logits, hidden=hidden)

    def propose(self, t0: int) -> DraftTree:
        tree = super().propose(t0)
        if self._eagle_on:  # which offered rows made it into the verified tree
            self.eagle.offered(_rows_in_tree(self._offer_rows, tree.tokens, tree.parents))
        return tree

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor | None, logits: torch.Tensor | None,
                hidden: torch.Tensor | None = None) -> None:
        super().observe(committed, input_ids, logits)
        if self._eagle_on:
            self.eagle.observe(committed, input_ids, logits, hidden=hidden)

    def _first_candidates(self, t0: int) -> int:
        n = super()._first_candidates(t0)
        if not self._eagle_on:
            return n
        tokens, parents, probs = self.eagle.offer(t0, min(self.n_offer, len(self._buffer[0]) // 2))
        tok, par, prob, cell = self._buffer
        m = len(tokens)
        tok[n : n + m] = tokens
        par[n : n + m] = np.where(parents >= 0, parents + n, -1)
        prob[n : n + m] = probs
        cell[n : n + m] = N_CELLS
        self._offer_rows = (tokens, parents)
        return n + m


def _rows_in_tree(rows: tuple[np.ndarray, np.ndarray], tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
    # rows: (tokens [m], parents [m] into rows) of an offered tree; tokens/parents: the final tree
    # -> [m] bool: the row's token path exists in the final tree
    where = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(parents, tokens))}
    row_tokens, row_parents = rows
    node = np.full(len(row_tokens), -2, dtype=np.int64)  # -2: not in the tree
    for i in range(len(row_tokens)):
        up = -1 if row_parents[i] < 0 else node[row_parents[i]]
        node[i] = where.get((int(up), int(row_tokens[i])), -2) if up != -2 else -2
    return node >= 0


class EagleDrafter(Drafter):
    name = "eagle"
    needs_hidden = True  # the loop passes the target's features of every committed position

    def __init__(self, head: EagleHead, config: EagleConfig = EagleConfig(),
                 cost: VerifyCost | np.ndarray | None = None) -> None:
        self.head, self.config = head.eval(), config
        self.cost = VerifyCost.fixed(cost)  # priced at the context the head has seen
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache = StaticKVCache(1, self.dtype, self.device)
        self.history = TokenHistory()
        self.processed = 0  # pairs in the head's cache: positions [0, processed)
        self.pending: list[torch.Tensor] = []  # features of positions >= processed, [*, H] each
        # calibration: accepted nodes and summed predicted probabilities per depth
        self.hits = np.zeros(MAX_DEPTH + 1)
        self.predicted = np.zeros(MAX_DEPTH + 1)
        self.scale = np.ones(MAX_DEPTH + 1)
        self.last: tuple[np.ndarray, ...] | None = None  # tokens, parents, depths, probs of the last tree
        rerank(np.zeros(1), np.full(1, -1, dtype=np.int64), np.ones(1, dtype=np.int64), self.scale,
               self.cost.relative, 1)  # compile (or load the numba cache) now, not in the first timed step

    # -- requests ----------------------------------------------------------------------------

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        # hidden: [n, H] the target's features at every prompt position (the loop's needs_hidden)
        if hidden is None:
            raise UserError("eagle needs the target's hidden states: run it through decode.loop.generate")
        self.history.reset(np.asarray(prompt, dtype=np.int64))
        self.processed = 0
        self.cache.set_length(0)
        self.pending = [hidden.to(self.dtype).clone()]
        self.last = None

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        # committed: [1+a] host ids; hidden: [1+a, H] the target's features at those positions
        if self.last is not None:
            self._learn(np.asarray(committed[1:], dtype=np.int64))
            self.last = None
        self.cache.set_length(self.processed)  # drop the draft entries; the real pairs stay
        self.history.extend(np.asarray(committed, dtype=np.int64))
        self.pending.append(hidden.to(self.dtype))

    # -- steps -------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, t0: int) -> DraftTree:
        cfg = self.config
        root = self._catch_up(t0)  # [H]
        if cfg.max_nodes == 0:
            return DraftTree.empty()
        tokens, scores, parents, depths = _to_host(*self._expand(root, cfg.top_k))  # the one host read
        keep, tree_parents = rerank(scores, parents, depths, self.scale, self.cost.at(self.processed), cfg.max_nodes)
        self.last = (tokens[keep], tree_parents, depths[keep], np.exp(scores[keep]))
        return DraftTree(tokens=tokens[keep].astype(np.int64), parents=tree_parents)

    def keep_first(self, k: int) -> None:
        if self.last is not None:
            self.last = tuple(part[:k] for part in self.last)

    @torch.inference_mode()
    def offer(self, t0: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The head's best `n` candidates for a caller that merges them with other drafts:
        -> (tokens [m] int64, parents [m] int32 into these rows, p [m] float64 calibrated path
        probabilities, never above the parent's). Call `offered` with what was kept."""
        root = self._catch_up(t0)
        tokens, scores, parents, depths = _to_host(*self._expand(root, self.config.top_k))
        keep, tree_parents = rerank(scores, parents, depths, self.scale, np.ones(n + 1), n)
        probs = np.minimum(1.0, np.exp(scores[keep]) * self.scale[np.minimum(depths[keep], MAX_DEPTH)])
        for i, parent in enumerate(tree_parents):  # parents come first: a child never outranks its parent
            if parent >= 0:
                probs[i] = min(probs[i], probs[parent])
        self._offered = (tokens[keep].astype(np.int64), tree_parents, depths[keep], np.exp(scores[keep]))
        return self._offered[0], tree_parents, probs

    def offered(self, verified: np.ndarray) -> None:
        """verified: [m] bool over the last `offer`'s rows, true where the row reached the verified
        tree (a row's parent then did too): the head's calibration learns from those."""
        tokens, parents, depths, probs = self._offered
        keep = np.flatnonzero(verified)
        self.last = (tokens[keep], kept_parents(parents, keep), depths[keep], probs[keep])

    def _catch_up(self, t0: int) -> torch.Tensor:
        # -> [H] the head's predicted feature after the pair (f_{N-1}, t0)
        n_committed, start = self.history.n, self.processed
        features = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]  # [N - start, H]
        next_tokens = np.append(self.history.ids[start + 1 : n_committed], t0)
        assert features.shape[0] == len(next_tokens) == n_committed - start, (features.shape, len(next_tokens), start)
        cfg = self.config
        self.cache.reserve(n_committed + cfg.top_k * (cfg.depth + 1) + 1)
        q = n_committed - start
        mask = None  # no past, or one query: sdpa's own causal rule is exact
        if start > 0 and q > 1:
            mask = torch.zeros(q, n_committed, dtype=self.dtype, device=self.device)
            mask[:, start:] = torch.full((q, q), torch.finfo(self.dtype).min, dtype=self.dtype,
                                         device=self.device).triu(1)
            mask = mask[None, None]
        ids = to_device(next_tokens, self.device)
        positions = torch.arange(start, n_committed, device=self.device)
        out = self.head(features[None], ids[None], positions[None], self.cache, mask)[0]
        self.processed = n_committed
        self.pending = []
        return out[-1]

    def _expand(self, root: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # root: [H] -> candidate tokens [c] int64, scores [c] float32, parents [c] int64 (device)
        cfg, head, device = self.config, self.head, self.device
        blocked = torch.finfo(self.dtype).min
        logq = torch.log_softmax(head.logits(root).float(), dim=-1)  # [V]
        k = min(k, logq.shape[-1])
        scores, index = logq.topk(k)
        tokens = head.token_ids(index)
        cand_tokens, cand_scores = [tokens], [scores]
        cand_parents = [torch.full((k,), -1, dtype=torch.int64, device=device)]
        count = k
        frontier_ids = torch.arange(k, device=device)
        frontier_tokens, frontier_scores = tokens, scores
        frontier_features = root.expand(k, -1)
        ancestors = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, forwarded] draft ancestry
        position = self.processed  # the pair (f_{N-1}, t0) sits at N - 1; its children at N
        on_cpu = device.type == "cpu"
        for _ in range(cfg.depth):
            if on_cpu and cfg.min_prob > 0 and float(frontier_scores.max()) < np.log(cfg.min_prob):
                break
            past = self.cache.get_seq_length()
            visible = torch.cat((ancestors, torch.eye(k, dtype=torch.bool, device=device)), dim=1)
            mask = torch.zeros(k, past + k, dtype=self.dtype, device=device)  # every real pair is visible
            mask[:, self.processed :] = torch.where(visible, 0.0, blocked).to(self.dtype)
            positions = torch.full((1, k), position, device=device)
            out = head(frontier_features[None], frontier_tokens[None], positions, self.cache, mask[None, None])[0]
            logq = torch.log_softmax(head.logits(out).float(), dim=-1)  # [k, V]
            top_scores, top_index = logq.topk(k, dim=-1)  # [k, k]
            top_tokens = head.token_ids(top_index)
            child_scores = (frontier_scores[:, None] + top_scores).flatten()
            cand_tokens.append(top_tokens.flatten())
            cand_scores.append(child_scores)
            cand_parents.append(frontier_ids.repeat_interleave(k))
            best_scores, best = child_scores.topk(k)
            rows = best // k
            frontier_ids = count + best
            count += k * k
            frontier_tokens, frontier_scores = top_tokens.flatten()[best], best_scores
            frontier_features = out[rows]
            ancestors = visible[rows]
            position += 1
        return torch.cat(cand_tokens), torch.cat(cand_scores), torch.cat(cand_parents)

    def _learn(self, accepted: np.ndarray) -> None:
        # accepted: [a] the draft tokens the step committed. The last tree's nodes at depth d were
        # worth sum(p) by the head; a hit at depth d when the accepted path runs through one of
        # its nodes there. scale[d] = (hits + w) / (predicted + w), a prior of 1.
        tokens, parents, depths, probs = self.last
        if len(tokens) == 0:
            return
        np.add.at(self.predicted, np.minimum(depths, MAX_DEPTH), probs)
        current = -1
        for depth, token in enumerate(accepted, start=1):
            nxt = np.flatnonzero((parents == current) & (tokens == token))
            if len(nxt) == 0:
                break
            self.hits[min(depth, MAX_DEPTH)] += 1.0
            current = int(nxt[0])
        w = self.config.prior_weight
        self.scale = (self.hits + w) / (self.predicted + w)


def _to_host(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> tuple[np.ndarray, ...]:
    # tokens [c] int64, scores [c] float32, parents [c] int64 on the device -> the same on the host in
    # one copy (one sync, not three; float64 holds each id and score exactly), and depths [c] int64
    packed = torch.stack((tokens.double(), scores.double(), parents.double())).cpu().numpy()
    parents = packed[2].astype(np.int64)
    return packed[0].astype(np.int64), packed[1], parents, tree_depths(parents.astype(np.int32)).astype(np.int64)
