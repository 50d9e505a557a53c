"""`sdsat-nucleus-reference`: the SDSAT paper's nucleus-sampling variant, for comparison only.

NOT LOSSLESS when sampling: it reproduces the paper's sampled numbers next to `sdsat`, the one to
use. Each step (ainergy-ml/SDSAT, decoders/):
  1) draft:  peek `[t0, SAT x k]`. t1 is one exact draw (or the argmax) at t0; at SAT j, TOP_K
             distinct candidates are drawn from its warped distribution (greedy: its TOP_K best).
             A static tree (TREES[k]) hangs below t1: a node at depth j whose path ends in v
             carries SAT j's candidate number v.
  2) verify: the tree `[t0, t1, nodes...]` in one forward.
  3) accept (`accept`, the drafter's own rule): t1 is kept; every root-to-leaf path gets its own
             target draw at each position, is accepted as far as the draws equal its tokens, and
             the longest accepted path wins (the first on ties); the next token is a fresh draw.
Why it is biased: best-of-paths favours tokens that several paths offer, and after a mismatch the
fresh draw can return the very token the draw refused. Greedy, it is plain greedy decoding.
Deviation: where fewer than TOP_K tokens survive the warping, the missing candidates are
placeholders that never match (the reference's sampler raises there).
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.drafters.sdsat import SatPeek, SdsatConfig
from samctl.decode.sampling import SamplingConfig, choose_tokens, draw, warp_probs
from samctl.decode.sdsat import SatSettings
from samctl.decode.engine.target import TargetModel
from samctl.decode.engine.transfer import to_device
from samctl.decode.drafters.base import Drafter
from samctl.decode.tree import DraftTree
from samctl.index.errors import ConfigError

TOP_K = 10  # distinct candidates drawn at each SAT (the paper's top_k)

# The paper's static trees below t1, one per SAT count k: each word is a path of candidate numbers
# from t1 down (nodes per depth for k = 5: 4, 8, 8, 5, 3).
TREES = {
    5: "0 1 2 3 00 01 02 10 11 20 21 30 000 001 002 010 011 020 021 100 0000 0001 0002 0010 0011 00000 00001 00002",
    7: "0 1 2 3 00 01 02 10 11 20 21 30 000 001 002 010 011 020 021 100 0000 0001 0002 0010 0011 0020 "
       "00000 00001 00002 00010 00011 000000 000001 000002 0000000 0000001",
    9: "0 1 2 3 00 01 02 10 11 20 21 30 000 001 002 010 011 020 021 100 0000 0001 0002 0010 0011 0020 "
       "00000 00001 00002 00010 00011 00020 000000 000001 000002 000010 000011 0000000 0000001 0000002 "
       "0000010 00000000 00000001 00000002 000000000 000000001",
    11: "0 1 2 3 00 01 02 10 11 20 21 30 000 001 002 010 011 020 021 100 0000 0001 0002 0010 0011 0020 "
        "0021 0100 00000 00001 00002 00010 00011 00020 000000 000001 000002 000010 000011 000020 0000000 "
        "0000001 0000002 0000010 0000011 0000020 00000000 00000001 00000002 00000010 00000011 000000000 "
        "000000001 000000002 000000010 0000000000 0000000001 0000000002 00000000000 00000000001",
    13: "0 1 2 3 00 01 02 10 11 20 21 30 000 001 002 010 011 020 021 100 0000 0001 0002 0010 0011 0020 "
        "0021 0100 00000 00001 00002 00010 00011 00020 00021 00100 000000 000001 000002 000010 000011 "
        "000020 000021 000100 0000000 0000001 0000002 0000010 0000011 0000020 00000000 00000001 00000002 "
        "00000010 00000011 00000020 000000000 000000001 000000002 000000010 000000011 000000020 "
        "0000000000 0000000001 0000000002 0000000010 0000000011 00000000000 00000000001 00000000002 "
        "00000000010 000000000000 000000000001 000000000002 0000000000000 0000000000001",
}


def static_tree(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The tree for k SATs: node 0 is t1, then TREES[k] in (depth, path) order. -> parents [1 + m]
    int32 (-1: child of t0), slot [1 + m] int64 into the flattened [k, TOP_K] candidates (t1: -1)."""
    if k not in TREES:
        raise ConfigError("sdsat-nucleus-reference has the paper's trees for k = {ks} SATs only, not {k}: "
                          "pass {sat_count} with one of them", ks=", ".join(map(str, TREES)), k=k)
    paths = sorted(TREES[k].split(), key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(paths)}
    parents = np.array([-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in paths], dtype=np.int32)
    slot = np.array([-1] + [(len(p) - 1) * TOP_K + int(p[-1]) for p in paths], dtype=np.int64)
    return parents, slot


def leaf_paths(parents: np.ndarray) -> np.ndarray:
    # parents: [m] int32 of a tree whose node 0 is the only root child -> [P, D] int64: for each
    # leaf, its nodes from node 0 down, right-padded with -1
    m = len(parents)
    has_child = np.zeros(m, dtype=bool)
    has_child[parents[parents >= 0]] = True
    paths = []
    for leaf in np.flatnonzero(~has_child):
        chain = [int(leaf)]
        while parents[chain[-1]] >= 0:
            chain.append(int(parents[chain[-1]]))
        paths.append(chain[::-1])
    depth = max(len(p) for p in paths)
    return np.array([p + [-1] * (depth - len(p)) for p in paths], dtype=np.int64)


class SdsatNucleusDrafter(Drafter):
    name = "sdsat-nucleus-reference"

    def __init__(self, target: TargetModel, settings: SatSettings, sampling: SamplingConfig,
                 config: SdsatConfig = SdsatConfig()) -> None:
        self.peek = SatPeek(target, settings, config)
        self.sampling = sampling
        self.parents, slot = static_tree(self.peek.k)
        self._slot = torch.from_numpy(slot[1:]).to(target.device)
        self.generator: torch.Generator | None = None
        if not sampling.greedy:
            self.generator = torch.Generator(device=target.device)
            if sampling.seed is None:
                self.generator.seed()
            else:  # its own stream, reproducible from the run's seed, apart from the loop's draws
                self.generator.manual_seed((sampling.seed * 0x9E3779B1 + 0x2545F491) % (1 << 63))

    def start(self, prompt: np.ndarray, prompt_logits: torch.Tensor) -> None:
        pass

    def propose(self, t0: int) -> DraftTree:
        logits = self.peek(t0)  # [1 + k, V]
        if self.sampling.greedy:
            t1 = logits[:1].argmax(-1)
            candidates = torch.topk(logits[1:], TOP_K, dim=-1).indices  # [k, TOP_K]
        else:
            probs = warp_probs(logits, self.sampling)
            t1 = draw(probs[:1], self.generator)
            candidates = self._distinct_draws(warp_probs(logits[1:], self._candidate_warp()))
        tokens = torch.cat((t1, candidates.reshape(-1)[self._slot]))
        return DraftTree(tokens=tokens, parents=self.parents)

    def _candidate_warp(self) -> SamplingConfig:
        s = self.sampling
        return SamplingConfig(s.temperature, TOP_K if s.top_k == 0 else min(s.top_k, TOP_K), s.top_p)

    def _distinct_draws(self, probs: torch.Tensor) -> torch.Tensor:
        # probs: [k, V] -> [k, TOP_K] int64: TOP_K draws without replacement per row (Gumbel top-k,
        # the same law as drawing one at a time); -1 where fewer tokens have mass
        u = torch.rand(probs.shape, generator=self.generator, device=probs.device).clamp_min(1e-20)
        keys = probs.log() - (-u.log()).log()
        top = torch.topk(keys, TOP_K, dim=-1)
        return torch.where(torch.isfinite(top.values), top.indices, -1)

    def observe(self, committed: np.ndarray, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass

    def accept(self, logits: torch.Tensor, tree: DraftTree, input_ids: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> tuple[np.ndarray, int, np.ndarray]:
        return best_of_paths(logits, tree.parents, input_ids, sampling, generator)


def best_of_paths(logits: torch.Tensor, parents: np.ndarray, input_ids: torch.Tensor, sampling: SamplingConfig,
                  generator: torch.Generator | None) -> tuple[np.ndarray, int, np.ndarray]:
    # logits: [1 + m, V] at [t0, t1, nodes...]; parents: [m] int32 with node 0 = t1 the only root
    # child (the loop may have cut the tree's depth); input_ids: [1 + m]
    # -> (accepted input indices, next token, input_ids on the host): the reference's rule above
    q = len(input_ids)
    if q == 1:  # no room for t1: the next token is drawn at t0
        host = torch.cat((choose_tokens(logits, sampling, generator), input_ids)).cpu().numpy()
        return np.zeros(1, dtype=np.int64), int(host[0]), host[1:]
    paths = leaf_paths(parents)  # [P, D] node indices, node 0 = t1
    rows = to_device(np.where(paths[:, :-1] >= 0, paths[:, :-1] + 1, 0).reshape(-1), logits.device)
    draws = choose_tokens(logits[rows], sampling, generator)  # one per (path, position)
    fresh = choose_tokens(logits, sampling, generator)  # the next token, drawn apart from the test
    host = torch.cat((draws, fresh, input_ids)).cpu().numpy()  # the step's one host sync
    draws, fresh, host_inputs = host[: len(rows)], host[len(rows) : len(rows) + q], host[len(rows) + q :]
    below = paths[:, 1:]  # the node each draw is compared with
    match = (below >= 0) & (host_inputs[np.maximum(below, 0) + 1] == draws.reshape(below.shape))
    accepted = np.cumprod(match, axis=1).sum(axis=1)
    best = int(np.argmax(accepted))  # the first longest
    path = np.concatenate(([0], paths[best, : int(accepted[best]) + 1] + 1)).astype(np.int64)
    return path, int(fresh[path[-1]]), host_inputs
