"""Planted acceptance bugs, and a spy on the acceptance step, for the sampling tests.

A statistical test shows its power in the same run: besides the true rules it runs the decode loop
(one record or a batch) with each wrong rule below swapped in for `decode.accept.batch_accept`'s
row by row, in place of `decode.accept.tree_accept` (deterministic drafts) and
`decode.accept.speculative_accept` (drafts carrying q), and must reject every one of them. Each
bug is the classic slip of its kind, written once for each rule; where a bug cannot change a
rule's output (no rejection ever happens, say), the test says so instead of asserting power.

    redraw      after a rejection, the next token is a fresh draw from p at that input, instead
                of the node's own draw (trees) or the residual norm(max(p - q, 0)) (q rule)
    residual    a wrong residual: trees test each child with its own p(x) and correct from p,
                never removing the rejected drafts' mass; the q rule takes norm(|p - q|)
    shared_u    one uniform for every position of a step (inverse-CDF draws for trees; one
                acceptance threshold r for the whole chain under the q rule)
    bonus       the bonus after a full match comes from the row before (the last draft's own
                row) instead of the row after it
    partial     redraw, only after a partial accept (a rejection below an accepted draft): the
                next token is a fresh draw from p instead of the residual. Depth-1 trees never
                show it, so it is not in BUGS: the tests that verify deeper trees add it
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

import samctl.decode.loop as loop
from samctl.decode.accept import batch_accept, speculative_accept, tree_accept
from samctl.decode.sampling import warp_probs
from samctl.decode.tree import DraftTree, tree_depths, walk_tree

BUGS = ("redraw", "residual", "shared_u", "bonus")


def _children(tree: DraftTree, node: int) -> np.ndarray:
    return np.flatnonzero(tree.parents[: tree.drafts] == node)


def _draw(row: torch.Tensor, generator: torch.Generator) -> int:
    # row: [V] probabilities (any positive mass) -> one token id
    return int(torch.multinomial(row[None], 1, generator=generator)[0, 0])


# -- deterministic drafts ------------------------------------------------------------------------

def tree_redraw(logits, tree, input_ids, sampling, generator):
    path, bonus, host = tree_accept(logits, tree, input_ids, sampling, generator)
    if len(_children(tree, int(path[-1]) - 1)):  # the draw there matched no child: a rejection
        bonus = _draw(warp_probs(logits[int(path[-1])][None], sampling)[0], generator)
    return path, bonus, host


def tree_partial(logits, tree, input_ids, sampling, generator):
    path, bonus, host = tree_accept(logits, tree, input_ids, sampling, generator)
    if len(path) > 1 and len(_children(tree, int(path[-1]) - 1)):  # accepted a draft, then rejected
        bonus = _draw(warp_probs(logits[int(path[-1])][None], sampling)[0], generator)
    return path, bonus, host


def tree_residual(logits, tree, input_ids, sampling, generator):
    p = warp_probs(logits, sampling)
    host = input_ids.cpu().numpy()
    path, current = [0], -1
    while True:
        row = p[current + 1]
        nxt = -1
        for child in _children(tree, current):
            token = int(host[child + 1])
            if token >= 0 and float(torch.rand(1, generator=generator)) < float(row[token]):
                nxt = child
                break
        if nxt < 0:
            return np.asarray(path, dtype=np.int64), _draw(row, generator), host
        path.append(nxt + 1)
        current = nxt


def tree_shared_u(logits, tree, input_ids, sampling, generator):
    p = warp_probs(logits, sampling)
    u = torch.rand(1, generator=generator)
    choices = (p.cumsum(-1) < u * p.sum(-1, keepdim=True)).sum(-1).clamp_max(p.shape[-1] - 1)
    host = torch.stack((input_ids, choices)).cpu().numpy()
    path = walk_tree(tree.parents, host[0][1:], host[1], tree.drafts)
    return path, int(host[1][path[-1]]), host[0]


def tree_bonus(logits, tree, input_ids, sampling, generator):
    path, bonus, host = tree_accept(logits, tree, input_ids, sampling, generator)
    if len(path) > 1 and not len(_children(tree, int(path[-1]) - 1)):  # a full match down to a leaf
        bonus = int(host[path[-1]])  # the parent's draw, which is the leaf's own token
    return path, bonus, host


# -- drafts carrying q ---------------------------------------------------------------------------

def _spec(logits, tree, input_ids, sampling, generator, bug: str):
    g = len(tree)
    p = warp_probs(logits, sampling)
    q = torch.nn.functional.pad(tree.q.to(p.dtype), (0, p.shape[-1] - tree.q.shape[-1]))
    x = input_ids[1:]
    p_x = p[:-1].gather(-1, x[:, None]).squeeze(-1)
    q_x = q.gather(-1, x[:, None]).squeeze(-1)
    r = torch.rand(1 if bug == "shared_u" else g, generator=generator).expand(g)
    accepted = (r * q_x <= p_x).tolist()
    a = accepted.index(False) if False in accepted else g
    host = input_ids.cpu().numpy()
    if a == g:
        row = p[g - 1] if bug == "bonus" and g > 0 else p[g]
        return np.arange(g + 1, dtype=np.int64), _draw(row, generator), host
    wrong = {"redraw": p[a], "residual": (p[a] - q[a]).abs(), "partial": p[a] if a > 0 else None}.get(bug)
    residual = (p[a] - q[a]).clamp_min(0) if wrong is None else wrong
    if float(residual.sum()) <= 0:
        residual = p[a]
    return np.arange(a + 1, dtype=np.int64), _draw(residual, generator), host


def _spec_rule(bug: str):
    return lambda logits, tree, input_ids, sampling, generator: _spec(logits, tree, input_ids, sampling, generator, bug)


RULES = {
    "redraw": (tree_redraw, _spec_rule("redraw")),
    "residual": (tree_residual, _spec_rule("residual")),
    "shared_u": (tree_shared_u, _spec_rule("shared_u")),
    "bonus": (tree_bonus, _spec_rule("bonus")),
    "partial": (tree_partial, _spec_rule("partial")),
}


def _row_by_row(tree_rule, spec_rule):
    """A batched acceptance step (`batch_accept`'s signature) applying `tree_rule` to each
    sampled row on its own, and `spec_rule` to the rows the engine sends to the q rule; greedy
    rows keep the true rule (no bug here is about argmax)."""

    def rule(logits, offsets, input_ids, trees, samplings, generators, rules=None):
        paths, nexts = [], []
        for b, tree in enumerate(trees):
            rows = slice(int(offsets[b]), int(offsets[b + 1]))
            own = None if rules is None else rules[b]
            chosen = tree_accept if samplings[b].greedy else spec_rule if own is speculative_accept else own or tree_rule
            path, token, _ = chosen(logits[rows], tree, input_ids[rows], samplings[b], generators[b])
            paths.append(path)
            nexts.append(token)
        return paths, nexts, input_ids.cpu().numpy()

    return rule


# -- the spy ------------------------------------------------------------------------------------

@dataclass
class Seen:
    """What acceptance saw: per draft depth (root children = 1), nodes rejected and accepted."""

    rejected: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    drafts: Counter = field(default_factory=Counter)  # steps by the number of nodes verified
    steps: int = 0
    q_steps: int = 0  # steps under the q rule

    def deepest_rejection(self) -> int:
        return max(self.rejected, default=0)

    def rejections_at_every_depth(self, depth: int) -> bool:
        return all(self.rejected[d] > 0 for d in range(1, depth + 1))


def _record(seen: Seen, tree: DraftTree, path: np.ndarray) -> None:
    seen.steps += 1
    seen.drafts[tree.drafts] += 1
    if tree.drafts == 0:
        return
    depths = tree_depths(tree.parents[: tree.drafts].astype(np.int32))
    for node in path[1:]:
        seen.accepted[int(depths[node - 1])] += 1
    for child in _children(tree, int(path[-1]) - 1):
        seen.rejected[int(depths[child])] += 1


@contextlib.contextmanager
def acceptance(bug: str | None = None):
    """Run the loop and the batched engine under the true rules (bug None) or a planted bug;
    yields a `Seen` (a batched step counts once per row)."""
    tree_rule, spec_rule = (tree_accept, speculative_accept) if bug is None else RULES[bug]
    batch_rule = batch_accept if bug is None else _row_by_row(tree_rule, spec_rule)
    seen = Seen()

    def spy_batch(logits, offsets, input_ids, trees, samplings, generators, rules=None):
        paths, nexts, host = batch_rule(logits, offsets, input_ids, trees, samplings, generators, rules)
        for b, (tree, path) in enumerate(zip(trees, paths)):
            seen.q_steps += rules is not None and rules[b] is speculative_accept
            _record(seen, tree, path)
        return paths, nexts, host

    saved = loop.batch_accept
    loop.batch_accept = spy_batch
    try:
        yield seen
    finally:
        loop.batch_accept = saved
