"""Sampling configuration and logit warping, in Hugging Face order: temperature, top-k, top-p.

Warping here must match `transformers` exactly so that samctl's plain sampling and
`model.generate(do_sample=True)` draw from the same distribution, and so that every lossless
acceptance rule compares the same p.
"""
from __future__ import annotations

import numpy as np
import torch

from samctl.decode.configs import SamplingConfig

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def warp_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    # logits: [n, V] -> probabilities [n, V] float32 after temperature, top-k, top-p
    scores = logits.float() / config.temperature
    if config.top_k > 0 and config.top_k < scores.shape[-1]:
        kth = torch.topk(scores, config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        # As transformers' TopPLogitsWarper: drop the ascending-sorted prefix whose mass is
        # <= 1 - top_p, always keeping the most likely token.
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - config.top_p)
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.softmax(scores, dim=-1)


def choose_tokens(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    # logits: [n, V] -> [n] int64: the target's choice at every verified position.
    # Greedy: argmax. Sampling: one independent draw per position, which is exactly what the
    # deterministic-draft acceptance rule needs (one draw per node, shared by all paths through it).
    return argmax_rows(logits) if config.greedy else draw(warp_probs(logits, config), generator)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    # [..., V] -> [...] int64: the index of each row's largest value, the first on ties (NaN counts
    # as the largest), as torch.argmax. On a CPU through numpy: torch 2.13's CPU argmax takes about
    # 100 us a row at 49k ids, numpy's 8 (a greedy step argmaxes every verified input).
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    # probs: [..., V] rows summing to 1 -> [...] int64: one draw per row.
    # torch.multinomial(probs, 1)'s own algorithm (argmax of p / Exp(1) noise, the exponentiated
    # Gumbel-max trick), so the same generator state draws the same tokens; without the input
    # checks that some torch builds make on the host (two .item() syncs per call).
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return argmax_rows(probs / noise)
