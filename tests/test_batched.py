"""The batched engine is lossless per record: greedy equals batch-1 greedy token for token (ragged
acceptance, mixed prompt lengths, early EOS, refills), a row's logits do not depend on the other
rows, sampling follows the model's distribution per row (chi-square), also through trees verified
three deep where every planted acceptance bug of tests/planted.py is rejected, and methods without a
batched form are refused with a clear error. The bookkeeping too: each row verifies a prefix of
its own drafter's proposal and tells the drafter how much, and int8 prefills each prompt alone."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from samctl.decode.engine.native import use_backend
from samctl.decode.loop import BatchRun, BatchStats, DrafterPool, batch_refusal, generate_batch, require_batchable
from samctl.decode.budget import TreeCalibration, choose_width, path_probs
from samctl.decode.drafters.adaptive import AdaptiveDrafter
from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.cost import VerifyCost
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import ALL_METHODS, make_drafter
from samctl.decode.sampling import SamplingConfig
from samctl.decode.tree import DraftTree
from samctl.index.automaton import SuffixAutomaton
from samctl.index.errors import UserError
from tests.mock_lm import CopyLM, copy_rule
from tests.test_decode_greedy import EAGER
from tests.planted import BUGS, acceptance
from tests.test_decode_sampling import (ALPHA, CONFIG as SAMPLING_METHODS, LOOKS, NEW as DEEP, PEAK, POWER, PROMPT,
                                        VOCAB, Case, copy_views, exact_distribution, fits)
from tests.test_engine import tiny

BATCHED = ("ar", "pld", "sam", "adaptive", "rest", "recycle", "lookahead", "sam+recycle")
CHEAP = 1.0 + 0.02 * np.arange(1, 513)  # drafting nearly free: wide trees, ragged acceptance
STEEP = 1.0 * np.arange(1, 513)  # every input costs a row: the budget drafts (almost) nothing


def mixed_prompts(vocab: int, n: int = 6) -> list[list[int]]:
    """Mixed lengths; most repeat a span, so retrieval drafts are accepted in some rows and not others."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        base = rng.integers(3, vocab, 4 + 5 * (i % 4)).tolist()
        out.append(base + base[: 3 + i % 3] if i % 3 else base)
    return out


def batch1(model, method: str, prompt: list[int], config: GenerationConfig, static=None) -> list[int]:
    drafter = make_drafter(method, vocab_size=model.config.vocab_size, device=torch.device("cpu"),
                           eos_token_ids=config.eos_token_ids, static=static, config=EAGER)
    return generate(TargetModel(model), drafter, prompt, config).tokens


NEW = 32
_REFERENCES: dict[str, tuple] = {}


def _references(key: str, model, prompts: list[list[int]]) -> tuple[list[list[int]], int, list[list[int]]]:
    """Plain batch-1 greedy outputs, an EOS that ends some records early (mid-output) and not
    others, and the outputs under that EOS; once per model."""
    if key not in _REFERENCES:
        plain = [batch1(model, "ar", p, GenerationConfig(max_new_tokens=NEW)) for p in prompts]
        eos = plain[1][len(plain[1]) // 2]
        expected = [batch1(model, "ar", p, GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,))) for p in prompts]
        assert any(r[-1] == eos and len(r) < NEW for r in expected) and any(len(r) == NEW for r in expected)
        _REFERENCES[key] = plain, eos, expected
    return _REFERENCES[key]


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("method", BATCHED)
def test_batched_greedy_equals_batch1_greedy(tiny_model_dir, method, backend):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    use_backend(model, backend)
    vocab = model.config.vocab_size
    prompts = mixed_prompts(vocab)
    plain, eos, expected = _references(f"{tiny_model_dir}-{backend}", model, prompts)
    config = GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,))
    corpus = np.concatenate([np.asarray(r, dtype=np.int32) for r in plain])
    static = SuffixAutomaton.build(corpus, np.concatenate(([0], np.cumsum([len(r) for r in plain]))))

    def make():
        return make_drafter(method, vocab_size=vocab, device=torch.device("cpu"), eos_token_ids=(eos,),
                            static=static, config=EAGER)

    for cost, batch_size in ((CHEAP, 3), (STEEP, 16)):
        stats = BatchStats()
        results = generate_batch(model, make, prompts, config, batch_size, cost=cost, stats=stats)
        assert [r.index for r in results] == list(range(len(prompts)))
        for r, want in zip(results, expected):
            assert r.tokens == want, (method, batch_size, r.index)
            assert r.finish_reason == ("eos" if want[-1] == eos and len(want) < NEW else "length")
        if method != "ar" and cost is CHEAP and batch_size == 3:
            accepted = [r.metrics.accepted for r in results]
            assert max(accepted) > 0 and len(set(accepted)) > 1, accepted  # ragged acceptance
            assert stats.prefills >= 2  # refills happened
        assert 0 < stats.accept_s <= stats.host_s  # the accept step (a GPU's one sync) is host time


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_row_logits_do_not_depend_on_other_rows(backend):
    """A row's prefill and tree-verify logits equal the batch-1 engine's within fp32 tolerance,
    whatever the other rows hold (lengths, trees, padding)."""
    model = tiny("qwen2", 2)
    use_backend(model, backend)
    rng = np.random.default_rng(0)
    mine = rng.integers(0, 96, 9)
    tokens = rng.integers(0, 96, 6)
    parents = np.array([-1, 0, -1, 2, 3, 2], dtype=np.int32)
    tree = DraftTree(tokens=tokens, parents=parents)
    single = TargetModel(model)
    want_prefill = single.prefill(torch.from_numpy(mine))
    want = single.verify(single.verify_input(int(mine[-1]), tree), tree)
    single.keep(np.array([0, 3, 4]))
    want_next = single.verify(torch.tensor([5]), DraftTree.empty())
    for others in ([rng.integers(0, 96, 20)], [rng.integers(0, 96, 3), rng.integers(0, 96, 15)]):
        target = BatchedTarget(model, 1 + len(others), 64)
        prompts = [mine] + others
        first = target.prefill(list(range(len(prompts))), prompts, [False] * len(prompts))
        torch.testing.assert_close(first[0], want_prefill, atol=1e-5, rtol=1e-5)
        other_trees = [DraftTree.chain(rng.integers(0, 96, 2 + 5 * i)) for i in range(len(others))]
        trees = [tree] + other_trees
        inputs = [torch.from_numpy(np.concatenate(([p[-1]], t.tokens)).astype(np.int64)) for p, t in zip(prompts, trees)]
        logits, offsets = target.verify(inputs, trees)
        torch.testing.assert_close(logits[offsets[0]: offsets[1]], want, atol=1e-5, rtol=1e-5)
        target.keep([np.array([0, 3, 4])] + [np.array([0, 1]) for _ in others])
        assert target.lengths[0] == len(mine) + 3
        nxt, offsets = target.verify([torch.tensor([5])] + [torch.tensor([7, 8, 9])] * len(others),
                                     [DraftTree.empty()] + [DraftTree.chain(np.array([8, 9]))] * len(others))
        torch.testing.assert_close(nxt[offsets[0]: offsets[1]], want_next, atol=1e-5, rtol=1e-5)


def test_copy_model_greedy_with_trees_and_refills():
    model = CopyLM(vocab=32)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 32, n).tolist() * 2 for n in (3, 7, 5, 11, 2, 9)]
    config = GenerationConfig(max_new_tokens=25)
    for method in ("adaptive", "recycle", "lookahead"):
        def make():
            return make_drafter(method, vocab_size=32, device=torch.device("cpu"))
        results = generate_batch(model, make, prompts, config, 4, cost=CHEAP)
        for r, p in zip(results, prompts):
            assert r.tokens == model.reference(p, 25), (method, r.index)


def test_a_batch_run_takes_records_between_steps_and_lets_cancelled_ones_leave():
    model = CopyLM(vocab=32)
    rng = np.random.default_rng(5)
    prompts = {k: rng.integers(0, 32, n).tolist() * 2 for k, n in zip("abcd", (5, 7, 3, 6))}
    pool = DrafterPool(lambda: make_drafter("adaptive", vocab_size=32, device=torch.device("cpu")))
    run = BatchRun(model, 2, cost=CHEAP)
    run.submit("a", prompts["a"], GenerationConfig(max_new_tokens=20), pool)
    results = run.step()
    assert run.running == 1 and not results
    streamed: list[list[int]] = []
    run.submit("b", prompts["b"], GenerationConfig(max_new_tokens=5), pool)  # joins at the next step
    run.submit("c", prompts["c"], GenerationConfig(max_new_tokens=20), pool)  # waits for a free slot
    run.submit("d", prompts["d"], GenerationConfig(max_new_tokens=20), pool,
               on_tokens=lambda tokens: streamed.append(tokens) or len(streamed) == 2)  # stops after 2 calls
    run.cancel("c")
    results += run.step()
    assert run.waiting == 1 and results[0].index == "c"  # c left before the step; b joined a; d waits
    results += list(run.drain())
    by_key = {r.index: r for r in results}
    assert sorted(by_key) == list("abcd") and len(results) == 4 and run.idle
    assert by_key["a"].tokens == model.reference(prompts["a"], 20)
    assert by_key["b"].tokens == model.reference(prompts["b"], 5) and by_key["b"].finish_reason == "length"
    assert by_key["c"].finish_reason == "cancelled" and by_key["c"].tokens == []
    d = by_key["d"]
    assert d.finish_reason == "stop" and d.tokens == sum(streamed, [])
    assert d.tokens == model.reference(prompts["d"], 20)[:len(d.tokens)]


@pytest.mark.parametrize("method", ["ar", "sam", "adaptive"])
def test_batched_sampling_follows_the_model_per_row(method):
    """Two prompts interleaved in one batched run; each prompt's samples fit its exact distribution."""
    model = CopyLM(vocab=VOCAB, peak=1.5)
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=7)
    first = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    second = [3, 1, 0, 2, 3, 1, 0, 2, 3]
    samples = 700
    prompts = [first if i % 2 == 0 else second for i in range(2 * samples)]

    def make():
        return make_drafter(method, vocab_size=VOCAB, device=torch.device("cpu"), config=SAMPLING_METHODS,
                            sampling=sampling)

    config = GenerationConfig(max_new_tokens=3, sampling=sampling)
    results = generate_batch(model, make, prompts, config, 8, cost=CHEAP)
    if method != "ar":
        assert sum(r.metrics.accepted for r in results) > samples // 10
    for parity, prompt in ((0, first), (1, second)):
        counts: dict[tuple[int, ...], int] = {}
        for r in results[parity::2]:
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        exact = _exact(model, prompt, sampling)
        assert fits(counts, exact, samples) > 1e-3, (method, parity, counts)


def test_rows_of_one_batch_keep_their_own_sampling():
    """Greedy and sampled records interleaved in one BatchRun: each greedy row is the model's
    greedy answer, and the sampled rows fit their exact distribution."""
    model = CopyLM(vocab=VOCAB, peak=1.5)
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=3)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    samples = 500
    pool = DrafterPool(lambda: make_drafter("adaptive", vocab_size=VOCAB, device=torch.device("cpu"),
                                            config=SAMPLING_METHODS))
    run = BatchRun(model, 8, cost=CHEAP)
    generator = torch.Generator().manual_seed(3)  # the sampled rows share one stream of draws
    for i in range(2 * samples):
        greedy = i % 2 == 0
        run.submit(i, prompt, GenerationConfig(max_new_tokens=3, sampling=SamplingConfig() if greedy else sampling),
                   pool, generator=None if greedy else generator)
    results = sorted(run.drain(), key=lambda r: r.index)
    reference = model.reference(prompt, 3)
    assert all(r.tokens == reference for r in results[0::2])
    counts: dict[tuple[int, ...], int] = {}
    for r in results[1::2]:
        counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
    assert len(counts) > 1 and fits(counts, _exact(model, prompt, sampling), samples) > 1e-3, counts


FLAT = np.ones(512)  # every verify costs the same: the budget keeps whole trees, so they go deep


def _deep_samples(bug: str | None, exact: dict, case: Case) -> tuple[float, Counter, object]:
    """Outputs of `case.prompt` from batched runs (8 rows, adaptive trees, DEEP new tokens) under the
    true rules or a planted bug -> (p-value over copy_views, counts, what acceptance saw). As in
    test_decode_sampling, a bug stops at the first look in LOOKS that rejects it."""
    model = CopyLM(vocab=VOCAB, peak=PEAK)

    def make():
        return make_drafter("adaptive", vocab_size=VOCAB, device=torch.device("cpu"), config=SAMPLING_METHODS)

    counts: Counter = Counter()
    with acceptance(bug) as seen:
        for look in ([case.samples] if bug is None else LOOKS):
            # a seed per look: each look's records draw afresh, not the last look's draws again
            config = GenerationConfig(max_new_tokens=DEEP, sampling=replace(case.sampling, seed=look))
            more = look - sum(counts.values())
            results = generate_batch(model, make, [case.prompt] * more, config, 8, cost=FLAT)
            counts.update(tuple(r.tokens) for r in results)
            p_value = fits(counts, exact, views=copy_views(case))
            if bug is not None and p_value < POWER:
                break
    return p_value, counts, seen


def test_batched_sampling_verifies_deep_trees_and_catches_planted_bugs():
    """Six new tokens at a flat cost: batched rows verify adaptive trees three deep and more, their
    outputs fit the exact distribution (whole outputs and per-position views), and every planted
    acceptance bug in place of `batch_accept` is rejected, the redraw from p instead of the
    residual after a partial accept included."""
    case = Case("adaptive", prompt=PROMPT)
    exact = exact_distribution(case)
    p_value, counts, seen = _deep_samples(None, exact, case)
    assert p_value > ALPHA, (p_value, counts.most_common(8))
    assert seen.rejections_at_every_depth(3) and seen.accepted[3] > 0, \
        f"drafts rejected {dict(seen.rejected)}, accepted {dict(seen.accepted)}: not verified 3 deep"
    caught = {bug: _deep_samples(bug, exact, case)[0] for bug in (*BUGS, "partial")}
    assert all(p < POWER for p in caught.values()), f"planted bugs not caught (p-values): {caught}"


def _exact(model, prompt, sampling):
    # The batched copy model follows tests/mock_lm.copy_rule at test_decode_sampling's PEAK.
    assert model.peak == PEAK
    return exact_distribution(Case("ar", sampling, prompt=tuple(prompt), turns=(3,)))


def test_only_methods_drafting_with_the_target_itself_are_refused():
    from samctl.decode.loop import _check_drafter
    from samctl.decode.methods import SELF_DRAFT_METHODS

    for name in SELF_DRAFT_METHODS:
        with pytest.raises(UserError, match="batch size 1"):
            require_batchable(name)
    assert [m for m in ALL_METHODS if batch_refusal(m)] == list(SELF_DRAFT_METHODS)

    class Hidden:
        name, needs_hidden = "custom", True

    no_hidden = SimpleNamespace(gives_hidden=False, model=SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))
    with pytest.raises(UserError, match="hidden states.*gpt2.*another method"):
        _check_drafter(Hidden(), no_hidden)


def test_bad_records_and_out_of_memory_do_not_stall_the_batch(monkeypatch):
    model = tiny("llama", 2)
    prompts = mixed_prompts(96, 6)
    records = prompts[:2] + [[]] + prompts[2:] + [[5] * 600]  # empty; longer than the context (512)
    config = GenerationConfig(max_new_tokens=12)
    expected = [batch1(model, "pld", p, config) for p in prompts]
    verify, calls = BatchedTarget.verify, []

    def flaky(self, inputs, trees):
        calls.append(len(inputs))
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return verify(self, inputs, trees)

    monkeypatch.setattr(BatchedTarget, "verify", flaky)
    stats = BatchStats()
    results = generate_batch(model, lambda: make_drafter("pld", vocab_size=96, device=torch.device("cpu")),
                             records, config, 4, cost=CHEAP, stats=stats)
    assert [r.finish_reason for r in results].count("error") == 2
    assert "empty" in results[2].error and "context" in results[-1].error
    assert [r.tokens for r in results if r.finish_reason != "error"] == expected
    assert stats.batch_size == 2 and "out of memory at batch size 4" in stats.notes[0]
    assert max(calls[3:]) <= 2


def test_budget_width_follows_the_cost_curve():
    probs = [np.array([0.9, 0.8, 0.7, 0.1]), np.array([0.5]), np.zeros(0)]
    assert choose_width(probs, STEEP, 8) == 0  # one more input per row costs a whole row
    assert choose_width(probs, np.ones(64), 8) == 4  # free: every node
    assert choose_width(probs, CHEAP, 8, min_width=6) == 6
    mid = 1.0 + 0.3 * np.arange(1, 64)
    rates = [(3 + sum(p[:w].sum() for p in probs)) / mid[3 * (1 + w) - 1] for w in range(5)]
    assert choose_width(probs, mid, 8) == int(np.argmax(rates))


def test_the_budget_prices_a_step_at_its_rows_mean_context():
    """The batch's curve after 256 and after 1024 entries a row (linear between, a shorter context
    priced as the first): here drafts are nearly free on short rows and each extra input costs a
    row on long ones, so a step over short rows verifies wide and one over long rows plain."""
    n = np.arange(1, 513)
    cost = VerifyCost.measured(list(1.0 + 0.001 * n), list(1.0 * n), (256, 1024))
    probs = [np.array([0.9, 0.8, 0.7, 0.1])] * 2
    assert choose_width(probs, cost.at(100), 8) == 4
    assert choose_width(probs, cost.at(1100), 8) == 0
    model = CopyLM(vocab=32)
    rng = np.random.default_rng(5)
    config = GenerationConfig(max_new_tokens=12)
    for length, wide in ((40, True), (1100, False)):
        prompts = [(rng.integers(0, 32, 9).tolist() * length)[:length] for _ in range(2)]
        stats = BatchStats()
        results = generate_batch(model, lambda: make_drafter("pld", vocab_size=32, device=torch.device("cpu")),
                                 prompts, config, 2, cost=cost, stats=stats)
        assert [r.tokens for r in results] == [model.reference(p, 12) for p in prompts]
        assert (max(stats.width_per_step) > 0) == wide, (length, stats.width_per_step)


def test_tree_calibration_learns_by_depth_and_rank():
    cal = TreeCalibration()
    parents = np.array([-1, 0, -1, 1], dtype=np.int32)  # a -> b -> d ; c (rank 1 at depth 1)
    for _ in range(200):
        cal.learn(parents, 4, np.array([0, 1, 2]))  # a and b accepted, d tried and missed, c tried
    means = cal.means
    assert means[0] > 0.9 and means[1] < 0.05  # depth 1: rank 0 always, rank 1 never
    assert means[4] > 0.9 and means[8] < 0.05  # depth 2 rank 0 hit; depth 3 rank 0 missed
    p = cal.score(parents)
    np.testing.assert_allclose(p, path_probs(parents, means[[0, 4, 1, 8]]))


def test_adaptive_scored_proposal_is_prefix_closed():
    drafter = AdaptiveDrafter(vocab_size=0)
    prompt = np.array([5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 10, 5, 6], dtype=np.int64)
    drafter.start(prompt, None)
    tree, probs = drafter.propose_scored(6)
    assert len(tree) >= 2 and len(probs) == len(tree)
    assert np.all(tree.parents < np.arange(len(tree)))
    assert np.all((probs > 0) & (probs <= 1))
    drafter.keep_first(1)
    assert len(drafter.last[0]) == 1


class _Told:
    """Wraps a drafter's propose_scored, keep_first and observe: per step what it proposed, the
    prefix length it was told was kept (None: not told), and the inputs the step verified."""

    def __init__(self, drafter) -> None:
        self.steps: list[list] = []  # [proposed tokens, kept or None, verified draft tokens or None]
        propose, keep, learn = drafter.propose_scored, drafter.keep_first, drafter.observe

        def propose_scored(t0):
            tree, probs = propose(t0)
            self.steps.append([tree.tokens.tolist(), None, None])
            return tree, probs

        def keep_first(k):
            assert self.steps[-1][1] is None, "told twice in one step"
            self.steps[-1][1] = k
            keep(k)

        def observe(committed, input_ids, logits):
            self.steps[-1][2] = input_ids[1:].tolist()
            learn(committed, input_ids, logits)

        drafter.propose_scored, drafter.keep_first, drafter.observe = propose_scored, keep_first, observe


def test_each_row_verifies_a_prefix_of_its_own_draft_and_tells_its_drafter():
    """Every row verifies the first k nodes of its own drafter's proposal, and a drafter whose
    proposal was cut (by the step's width or the tokens still wanted) is told k (`keep_first`),
    so that it learns from the nodes verified and no others."""
    model = CopyLM(vocab=32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 32, n).tolist() * 3 for n in (3, 7, 5, 11, 2, 9)]
    told: list[_Told] = []

    def make():
        drafter = make_drafter("adaptive", vocab_size=32, device=torch.device("cpu"))
        told.append(_Told(drafter))
        return drafter

    mid = 1.0 + 0.1 * np.arange(1, 513)  # a few nodes per row: most proposals are cut
    results = generate_batch(model, make, prompts, GenerationConfig(max_new_tokens=20), 3, cost=mid, max_width=6)
    assert [r.tokens for r in results] == [model.reference(p, 20) for p in prompts]
    steps = [s for t in told for s in t.steps if s[2] is not None]  # the last step of a record observes nothing
    cut = 0
    for proposed, kept, verified in steps:
        assert verified == proposed[:len(verified)], (proposed, verified)
        if len(verified) < len(proposed):
            cut += 1
            assert kept == len(verified), (proposed, kept, verified)
        else:
            assert kept in (None, len(proposed)), (proposed, kept)
    assert cut > len(steps) // 4 and any(len(v) for _, _, v in steps), (cut, len(steps))


def test_int8_batched_prefill_is_one_forward_per_prompt(monkeypatch):
    """int8 attends exactly per row only as batch 1 sums: the batched engine prefills each prompt
    alone, unpadded, in one forward of its own, and each row's greedy output is batch 1's."""
    from samctl.decode.engine.attention import exact_rows
    from samctl.decode.engine.cpu_linear import apply_cpu_linear

    model = tiny("llama", 2)
    try:
        apply_cpu_linear(model, "int8")
    except UserError as err:  # a CPU whose int8 kernels do not sum exactly
        pytest.skip(str(err))
    assert exact_rows(model)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 96, n).tolist() for n in (9, 11, 8, 10, 9)]  # one padded group of 5 otherwise
    config = GenerationConfig(max_new_tokens=4)
    expected = [batch1(model, "pld", p, config) for p in prompts]
    run, prefills = BatchedTarget.forward, []

    def spy(self, input_ids, position_ids, mask, keep, upto=None):
        if self.cache.prefill_rows is not None:
            prefills.append(tuple(input_ids.shape))
        return run(self, input_ids, position_ids, mask, keep, upto)

    monkeypatch.setattr(BatchedTarget, "forward", spy)
    results = generate_batch(model, lambda: make_drafter("pld", vocab_size=96, device=torch.device("cpu")),
                             prompts, config, len(prompts), cost=CHEAP)
    assert sorted(prefills) == sorted((1, len(p)) for p in prompts)
    assert [r.tokens for r in results] == expected


@pytest.mark.parametrize("method", ["sd", "specdec++", "sam+draft", "ouroboros"])
def test_rows_draft_together_one_draft_forward_a_round(method):
    """The rows drafting with one draft model are rows of its own batch: each round of drafting is
    one draft forward over all of them, where rows drafting alone take one each; outputs equal."""
    from samctl.decode.acceptance_head import AcceptanceHead, HeadConfig
    from samctl.decode.draft_model import DraftModel

    model, draft_model = tiny("llama", 2), tiny("llama", 2, seed=1)
    forwards = []
    draft_model.get_input_embeddings().register_forward_pre_hook(lambda module, args: forwards.append(1))
    draft = DraftModel(draft_model)
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(draft.hidden_size, num_blocks=1)).eval() if method == "specdec++" else None
    prompts = mixed_prompts(96)[:4]
    config = GenerationConfig(max_new_tokens=NEW)

    def make():
        return make_drafter(method, vocab_size=96, device=torch.device("cpu"), config=EAGER, draft=draft.fork(),
                            head=head)

    alone = [generate_batch(model, make, [p], config, 1, cost=CHEAP)[0].tokens for p in prompts]  # a row at a time
    one_by_one, forwards[:] = len(forwards), []
    stats = BatchStats()
    together = [r.tokens for r in generate_batch(model, make, prompts, config, 4, cost=CHEAP, stats=stats)]
    assert together == alone
    assert max(stats.rows_per_step) == 4 and 0 < len(forwards) < 0.6 * one_by_one, (len(forwards), one_by_one)


@pytest.mark.parametrize("method", ["sd", "specdec++", "sam+draft", "ouroboros", "eagle", "sam+eagle", "adaptive+eagle"])
def test_draft_model_and_eagle_methods_batched_equal_batch1(method):
    # each row its own drafter (a draft model's cache, an EAGLE head's state and features of its
    # own), verified beside other rows; greedy outputs equal batch 1's, EOS and refills included
    from samctl.decode.acceptance_head import AcceptanceHead, HeadConfig
    from samctl.decode.draft_model import DraftModel
    from samctl.decode.eagle_head import EagleHead
    from samctl.decode.methods import method as method_entry

    from tests.test_draft_model import near_draft

    model = tiny("llama", 2)
    entry = method_entry(method)
    # a draft that agrees with the target often: an unrelated one has every draft rejected
    draft = DraftModel(near_draft(model)) if entry.needs_draft else None
    torch.manual_seed(0)
    head = AcceptanceHead(HeadConfig(draft.hidden_size, num_blocks=1)).eval() if entry.needs_head else None
    eagle = EagleHead(model).eval() if entry.needs_eagle else None
    prompts = mixed_prompts(96)
    plain, eos, expected = _references("draft-eagle", model, prompts)
    config = GenerationConfig(max_new_tokens=NEW, eos_token_ids=(eos,))
    corpus = np.concatenate([np.asarray(r, dtype=np.int32) for r in plain])
    static = SuffixAutomaton.build(corpus, np.concatenate(([0], np.cumsum([len(r) for r in plain]))))

    def make():
        return make_drafter(method, vocab_size=96, device=torch.device("cpu"), eos_token_ids=(eos,), static=static,
                            config=EAGER, draft=None if draft is None else draft.fork(), head=head, eagle=eagle)

    target = TargetModel(model)
    alone = [generate(target, make(), p, config).tokens for p in prompts]
    assert alone == expected
    stats = BatchStats()
    results = generate_batch(model, make, prompts, config, 3, cost=CHEAP, stats=stats)
    assert [r.tokens for r in results] == expected, method
    assert stats.prefills >= 2 and max(stats.rows_per_step) == 3
    accepted = [r.metrics.accepted for r in results]
    assert sum(accepted) > 0, (method, accepted)  # drafts accepted beside other rows, not only rejected


def test_batched_speculative_sampling_rows_fit_the_model():
    """`sd` batched: sampled chains carrying q are accepted by speculative sampling row by row,
    beside other rows; each prompt's samples fit the model's exact distribution."""
    from samctl.decode.draft_model import DraftModel
    from tests.test_decode_sampling import DraftCopyLM

    model = CopyLM(vocab=VOCAB, peak=1.5)
    draft = DraftModel(DraftCopyLM(vocab=VOCAB, peak=1.0))
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=7)
    first, second = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [3, 1, 0, 2, 3, 1, 0, 2, 3]
    samples = 600
    prompts = [first if i % 2 == 0 else second for i in range(2 * samples)]
    def make():  # each slot's draft draws from a stream of its own, unseeded: not restarted per record
        return make_drafter("sd", vocab_size=VOCAB, device=torch.device("cpu"), config=SAMPLING_METHODS,
                            draft=draft.fork(), sampling=replace(sampling, seed=None))

    results = generate_batch(model, make, prompts, GenerationConfig(max_new_tokens=3, sampling=sampling), 8,
                             cost=CHEAP)
    assert sum(r.metrics.accepted for r in results) > samples // 10
    assert sum(r.metrics.drafted - r.metrics.accepted for r in results) > samples // 10  # rejections happened
    for parity, prompt in ((0, first), (1, second)):
        counts: dict[tuple[int, ...], int] = {}
        for r in results[parity::2]:
            counts[tuple(r.tokens)] = counts.get(tuple(r.tokens), 0) + 1
        assert fits(counts, _exact(model, prompt, sampling), samples) > 1e-3, (parity, counts)


@pytest.mark.parametrize("bug", ["residual"])
def test_batched_speculative_sampling_rejects_planted_q_rules(bug):
    """The same run under a planted q rule (the residual norm(|p - q|)) must fail the fit: the q rows
    really go through the rule the planted bugs replace."""
    from samctl.decode.draft_model import DraftModel
    from tests.test_decode_sampling import DraftCopyLM

    model = CopyLM(vocab=VOCAB, peak=1.5)
    draft = DraftModel(DraftCopyLM(vocab=VOCAB, peak=1.0))
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, seed=7)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]

    def make():
        return make_drafter("sd", vocab_size=VOCAB, device=torch.device("cpu"), config=SAMPLING_METHODS,
                            draft=draft.fork(), sampling=replace(sampling, seed=None))

    with acceptance(bug) as seen:
        results = generate_batch(model, make, [prompt] * 600, GenerationConfig(max_new_tokens=3, sampling=sampling), 8,
                                 cost=CHEAP)
    assert seen.q_steps > 100
    counts = Counter(tuple(r.tokens) for r in results)
    assert fits(counts, _exact(model, prompt, sampling), 600) < 1e-6, bug


@pytest.mark.parametrize("method", ["ar", "pld", "adaptive"])
def test_every_method_fills_the_context_to_its_last_position(method):
    # A prompt of n tokens in a context of C leaves C - n + 1 new tokens (the last is never fed back).
    # Plain decoding stopped one short, a step before the last position, while a drafter whose draft
    # reached that position in one verify got the token more: outputs of different lengths.
    model = tiny()
    model.config.max_position_embeddings = 48  # the context samctl runs to (the rotary tables stay longer)
    prompt = [3, 4, 5, 6, 7, 8] * 7  # 42 tokens: 7 new ones fit
    drafter = make_drafter(method, vocab_size=model.config.vocab_size, device=torch.device("cpu"))
    result = generate(TargetModel(model), drafter, prompt, GenerationConfig(max_new_tokens=20))
    plain = generate(TargetModel(model), make_drafter("ar", vocab_size=96, device=torch.device("cpu")), prompt,
                     GenerationConfig(max_new_tokens=20))
    assert len(result.tokens) == 48 - len(prompt) + 1 and result.tokens == plain.tokens
