"""The two lossless acceptance rules the decode loop applies (step 3 of `decode.loop`).

Deterministic drafts (retrieval, Token Recycle, n-gram pools, argmax drafts) use `tree_accept`:
the target's choice at every verified input (argmax, or one sample per node shared by every path
through it), then a walk down the tree along those choices (`decode.tree.walk_tree`). Drafts
sampled from a draft distribution q use `speculative_accept`, speculative sampling (Leviathan et
al. 2023; Chen et al. 2023):

    accept x_i  iff  r_i <= p_i(x_i) / q_i(x_i),   r_i ~ U(0, 1)
    first rejection at i: emit y ~ norm(max(p_i - q_i, 0))
    all gamma accepted:   emit a bonus y ~ p_{gamma+1}

Valid only if x_i was really sampled from q_i, with p and q warped identically. A draft model
with a smaller vocabulary gives q over the first V' ids: the ids it lacks have q = 0, so p keeps
the target's whole vocabulary and the residual covers them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from samctl.decode.sampling import SamplingConfig, argmax_rows, choose_tokens, draw, warp_probs
from samctl.decode.tree import DraftTree, walk_tree


def tree_accept(
    logits: torch.Tensor,
    tree: DraftTree,
    input_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[np.ndarray, int, np.ndarray]:
    # logits: [m+1, V] target logits at [t0, nodes...]; input_ids: [m+1]
    # -> (accepted input indices, root first; next token; input_ids on the host)
    # The choice at the last accepted input is the next token: the bonus after a full match, the
    # correction after a rejection (a sample that matched no child is a draw from p without them).
    choices = choose_tokens(logits, sampling, generator)
    host = torch.stack((input_ids, choices)).cpu().numpy()  # the step's one host sync
    path = walk_tree(tree.parents, host[0][1:], host[1], tree.drafts)
    return path, int(host[1][path[-1]]), host[0]


def batch_accept(
    logits: torch.Tensor,
    offsets: np.ndarray,
    input_ids: torch.Tensor,
    trees: Sequence[DraftTree],
    samplings: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    rules: Sequence[Callable | None],
) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    # logits: [N, V] and input_ids: [N], A rows' inputs [t0, nodes...] concatenated, row b's at
    # offsets[b]:offsets[b + 1]; trees, samplings, generators: per row; rules: per row None (this
    # rule) or a rule of `tree_accept`'s signature (speculative_accept for sampled chains with q,
    # a drafter's own) that decides that row instead
    # -> (per row its accepted input indices, root first; per row its next token; input_ids on the host)
    # `tree_accept` for every row at once, with one host sync for the whole step; rows with a rule
    # of their own draw nothing here and sync once more each.
    shared = [b for b, rule in enumerate(rules) if rule is None]
    if len(shared) == len(trees):  # the common case: every row by this rule, no gather
        choices = choose_rows(logits, np.asarray(offsets), samplings, generators)
    else:
        choices = torch.zeros_like(input_ids)
        if shared:
            picked = torch.cat([torch.arange(int(offsets[b]), int(offsets[b + 1]), device=logits.device)
                                for b in shared])
            sizes = np.array([offsets[b + 1] - offsets[b] for b in shared])
            part = choose_rows(logits.index_select(0, picked), np.concatenate(([0], np.cumsum(sizes))),
                               [samplings[b] for b in shared], [generators[b] for b in shared])
            choices = choices.index_copy_(0, picked, part)
    host = torch.stack((input_ids, choices)).cpu().numpy()  # the step's one host sync
    paths, nexts = [], []
    for b, tree in enumerate(trees):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        if rules[b] is not None:
            path, bonus, _ = rules[b](logits[lo:hi], tree, input_ids[lo:hi], samplings[b], generators[b])
            paths.append(np.asarray(path, dtype=np.int64))
            nexts.append(int(bonus))
            continue
        ids, chosen = host[0, lo:hi], host[1, lo:hi]
        path = walk_tree(tree.parents, ids[1:], chosen, tree.drafts)
        paths.append(path)
        nexts.append(int(chosen[path[-1]]))
    return paths, nexts, host[0]


def choose_rows(
    logits: torch.Tensor,
    offsets: np.ndarray,
    samplings: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    # logits: [N, V], row b's inputs at offsets[b]:offsets[b + 1] -> [N] int64: the target's choice
    # at every input by each row's own sampling (argmax for greedy rows). Neighbouring rows with
    # the same sampling and generator draw in one call.
    if all(s.greedy for s in samplings):
        return argmax_rows(logits)
    parts, b = [], 0
    while b < len(samplings):
        e = b + 1
        while e < len(samplings) and samplings[e] == samplings[b] and generators[e] is generators[b]:
            e += 1
        parts.append(choose_tokens(logits[offsets[b]: offsets[e]], samplings[b], generators[b]))
        b = e
    return torch.cat(parts)


def speculative_accept(
    logits: torch.Tensor,
    tree: DraftTree,
    input_ids: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[np.ndarray, int, np.ndarray]:
    # logits: [g+1, V] target logits at [t0, x_1..x_g]; tree.q: [g, V'] draft probabilities
    # (warped), V' <= V; input_ids: [g+1]
    # -> (accepted input indices 0..a, next token, input_ids on the host)
    assert tree.is_chain and tree.q is not None, "speculative_accept needs a chain with q"
    g = len(tree)
    p = warp_probs(logits, sampling)
    q = tree.q.to(device=p.device, dtype=p.dtype)
    assert q.shape[-1] <= p.shape[-1], (q.shape, p.shape)
    q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    x = input_ids[1:]
    p_x = p[:-1].gather(-1, x[:, None]).squeeze(-1)
    q_x = q.gather(-1, x[:, None]).squeeze(-1)
    r = torch.rand(g, generator=generator, device=p.device)
    accepted = r * q_x <= p_x  # r <= p/q without dividing by a q that underflowed
    residual = (p[:-1] - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass; rejection then has probability 0, so any row will do.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:-1])
    draws = draw(torch.cat((residual, p[-1:])), generator)
    host = torch.cat((accepted.to(torch.int64), draws, input_ids)).cpu().numpy()  # the step's one host sync
    rejected = np.flatnonzero(host[:g] == 0)
    a = int(rejected[0]) if len(rejected) else g
    return np.arange(a + 1, dtype=np.int64), int(host[g + a]), host[2 * g + 1 :]
