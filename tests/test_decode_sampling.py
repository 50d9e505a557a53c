"""Sampling is lossless: every method draws sequences from exactly the target's distribution.

A copy-rule model over a 4-token vocabulary gives a known next-token distribution, so the exact
probability of each 3-token continuation is computable; samples from each method must fit it
(chi-square goodness of fit, fixed seeds, significance level 0.001 per method and setting).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from samctl.decode.drafters.lookahead import LookaheadConfig
from samctl.decode.drafters.eagle import EagleConfig
from samctl.decode.drafters.pld import PldConfig
from samctl.decode.drafters.recycle import RecycleConfig
from samctl.decode.drafters.sam import SamConfig
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.eagle_head import EagleHead
from samctl.decode.methods import MethodConfig, make_drafter, method as method_entry
from samctl.decode.sampling import SamplingConfig, warp_probs
from samctl.decode.engine.target import TargetModel
from tests.mock_lm import CopyLM, copy_rule

VOCAB, NEW, SAMPLES, ALPHA = 4, 3, 2500, 1e-3
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
CONFIG = MethodConfig(
    sam=SamConfig(dyn_threshold=1, static_bias=0, alpha=4.0),
    pld=PldConfig(max_ngram=2, num_draft=4),
    recycle=RecycleConfig(k=3, nodes=8, max_depth=3),
    lookahead=LookaheadConfig(ngram=3, window=2, guesses=3),
    eagle=EagleConfig(top_k=VOCAB, depth=2, max_nodes=12, min_prob=0.0),  # top-k = V: every draw is a child
)


def exact_distribution(model: CopyLM, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        text, p = list(PROMPT), 1.0
        for token in seq:
            logits = torch.zeros(1, VOCAB)
            logits[0, copy_rule(text, VOCAB)] = model.peak
            p *= float(warp_probs(logits, sampling)[0, token])
            text.append(token)
        probs[seq] = p
    return probs


def sample_counts(model: CopyLM, method: str, sampling: SamplingConfig) -> tuple[dict, int]:
    target = TargetModel(model)
    eagle = EagleHead(model).eval() if method_entry(method).needs_eagle else None  # untrained: any head is lossless
    drafter = make_drafter(method, vocab_size=VOCAB, device=target.device, config=CONFIG, target=target, eagle=eagle)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for i in range(SAMPLES):
        config = GenerationConfig(max_new_tokens=NEW, sampling=SamplingConfig(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=1000 + i))
        result = generate(target, drafter, PROMPT, config)
        key = tuple(result.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += result.metrics.accepted
    return counts, accepted


def fits(counts: dict, exact: dict, samples: int = SAMPLES) -> float:
    """p-value of the chi-square test; cells expected < 5 are pooled into one."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, p in exact.items():
        e = p * samples
        if e < 5:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += e
        else:
            observed.append(counts.get(seq, 0))
            expected.append(e)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert sum(observed) == samples, "a sample fell outside the enumerated continuations"
    expected = np.asarray(expected) * samples / np.sum(expected)
    return float(chisquare(observed, expected).pvalue)


SETTINGS = [
    pytest.param("ar", SamplingConfig(temperature=1.0), id="ar"),
    pytest.param("pld", SamplingConfig(temperature=1.0), id="pld"),
    pytest.param("sam", SamplingConfig(temperature=1.0), id="sam"),
    pytest.param("recycle", SamplingConfig(temperature=1.0), id="recycle"),
    pytest.param("sam+recycle", SamplingConfig(temperature=1.0), id="sam+recycle"),
    pytest.param("sam", SamplingConfig(temperature=0.7, top_k=3, top_p=0.9), id="sam-warped"),
    pytest.param("sam+recycle", SamplingConfig(temperature=1.3, top_p=0.8), id="sam+recycle-warped"),
    pytest.param("adaptive", SamplingConfig(temperature=0.8, top_p=0.9), id="adaptive-warped"),
    pytest.param("lookahead", SamplingConfig(temperature=0.7, top_k=3, top_p=0.9), id="lookahead-warped"),
    pytest.param("sdsat", SamplingConfig(temperature=1.0), id="sdsat"),
    pytest.param("eagle", SamplingConfig(temperature=1.0), id="eagle"),
    pytest.param("sam+eagle", SamplingConfig(temperature=0.7, top_k=3, top_p=0.9), id="sam+eagle-warped"),
    pytest.param("adaptive+eagle", SamplingConfig(temperature=1.0), id="adaptive+eagle"),
]


@pytest.mark.slow
@pytest.mark.parametrize("method,sampling", SETTINGS)
def test_sampling_matches_target_distribution(method, sampling):
    model = CopyLM(vocab=VOCAB, peak=1.5)
    counts, accepted = sample_counts(model, method, sampling)
    if method != "ar":
        assert accepted > SAMPLES // 10, f"{method} accepted only {accepted} drafts: the test would prove nothing"
    p_value = fits(counts, exact_distribution(model, sampling))
    assert p_value > ALPHA, (method, p_value, counts)


def test_warping_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)]:
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1.0:
            scores = TopPLogitsWarper(p)(None, scores)
        ours = warp_probs(logits, SamplingConfig(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(ours, torch.softmax(scores, -1))


def test_fixed_seed_is_reproducible():
    model = CopyLM(vocab=VOCAB, peak=1.5)
    target = TargetModel(model)
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0, seed=7))
    runs = [generate(target, make_drafter("sam+recycle", vocab_size=VOCAB, device=target.device, config=CONFIG),
                     PROMPT, config).tokens for _ in range(2)]
    assert runs[0] == runs[1]
