"""Every method's greedy output equals plain greedy decoding, token for token (float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.eagle_head import EagleHead
from samctl.decode.methods import EAGLE_METHODS, METHODS, MethodConfig, make_drafter, method as method_entry, uses_store
from samctl.decode.drafters.sam import SamConfig
from samctl.decode.engine.native import use_backend
from samctl.decode.engine.target import TargetModel
from samctl.index.automaton import SuffixAutomaton
from samctl.index.ngram import NgramConfig, NgramTable
from samctl.index.sharded import ShardedAutomaton
from tests.mock_lm import CopyLM

# Low thresholds so that retrieval drafts fire often on tiny random models.
EAGER = MethodConfig(sam=SamConfig(dyn_threshold=2, static_bias=1))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def eagle_head(model) -> EagleHead:
    """An untrained (random) EAGLE head: equality must hold whatever the head drafts."""
    torch.manual_seed(0)
    return EagleHead(model).eval()


def run(model, method: str, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...] = (), static=None,
        spy=None, backend: str = "hf"):
    """spy: called each step with whether a verified draft node carries an EOS id."""
    use_backend(model, backend)
    target = TargetModel(model)
    drafter = make_drafter(
        method, vocab_size=model.config.vocab_size, device=target.device, eos_token_ids=eos,
        static=static, config=EAGER, eagle=eagle_head(model) if method_entry(method).needs_eagle else None,
    )
    if spy is not None:
        verify = target.rows.verify

        def spied(inputs, trees):
            (input_ids,), (tree,) = inputs, trees
            nodes = input_ids[1 : 1 + tree.drafts].cpu().numpy()
            spy(bool(np.isin(nodes, eos).any()))
            return verify(inputs, trees)

        target.rows.verify = spied
    return generate(target, drafter, prompt, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos))


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    base = rng.integers(3, vocab, 12).tolist()
    return [base + base[:7] + rng.integers(3, vocab, 5).tolist(), rng.integers(3, vocab, 30).tolist(), [5]]


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("method", METHODS + EAGLE_METHODS)
def test_greedy_equals_generate(tiny_model_dir, method, backend):
    # hf: equal to transformers' own greedy generate; native: to the native forward's plain
    # decoding (`ar`), the backend's own greedy (native against hf: tests/test_native.py)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    accepted: dict[str, int] = {}  # draft tokens accepted, per store kind over the prompts
    for prompt in prompts(model.config.vocab_size):
        expected = hf_greedy(model, prompt, 80, eos=None) if backend == "hf" else \
            run(model, "ar", prompt, 80, backend="native").tokens
        corpus = np.asarray(expected[:40], dtype=np.int32), np.array([0, 40])
        static = SuffixAutomaton.build(*corpus)
        ngram = NgramTable.build(*corpus, NgramConfig(min_count=1))
        # two shards of 25 and 15 tokens (a sharded store drafts from the shard with the longest match)
        sharded = ShardedAutomaton([SuffixAutomaton.build(corpus[0][:25], np.array([0, 25])),
                                    SuffixAutomaton.build(corpus[0][25:], np.array([0, 15]))])
        stores = (static, sharded) if method == "rest" else (None, static, sharded, ngram) if uses_store(method) \
            else (None,)
        for store in stores:
            result = run(model, method, prompt, 80, static=store, backend=backend)
            assert result.tokens == expected, (method, prompt, store is not None)
            assert result.metrics.new_tokens == 80 and result.finish_reason == "length"
            kind = type(store).__name__
            accepted[kind] = accepted.get(kind, 0) + result.metrics.accepted
    # equality proves nothing of verification if no draft was ever accepted: every method that
    # drafts had drafts accepted, and many from a store holding the answer (ar drafts nothing)
    for kind, count in accepted.items():
        floor = -1 if method == "ar" else 0 if kind == "NoneType" else 60
        assert count > floor and (count == 0) == (method == "ar"), (method, kind, accepted)


@pytest.mark.parametrize("method", METHODS + EAGLE_METHODS)
def test_eos_and_max_tokens_edges(tiny_llama, method):
    # The prompt holds the model's repeating output, so every method drafts from the first step on,
    # and EOS is a token of that output which the continuation first emits 6+ tokens in: drafts
    # carry it (pld alone ends its drafts just before an EOS, leaving it to the target's draw).
    full = hf_greedy(tiny_llama, prompts(tiny_llama.config.vocab_size)[0], 62, eos=None)
    prompt = full[34:]  # two laps of the cycle the output settles in, and no earlier variant of it
    expected = hf_greedy(tiny_llama, prompt, 60, eos=None)
    first = next(j for j in range(6, len(expected)) if expected[j] not in expected[:j])
    eos = expected[first]
    # rest drafts only from a store: give it the continuation, so its drafts run into EOS and limits
    static = SuffixAutomaton.build(np.asarray(prompt + expected, dtype=np.int32), np.array([0, len(prompt) + 60]))
    static = static if method == "rest" else None
    drafted_eos = []  # per step: whether a verified draft node carries EOS
    with_eos = run(tiny_llama, method, prompt, 60, eos=(eos,), static=static, spy=drafted_eos.append)
    assert with_eos.tokens == expected[: first + 1] == hf_greedy(tiny_llama, prompt, 60, eos=eos)
    assert with_eos.finish_reason == "eos"
    if method not in ("ar", "pld", "eagle", "sam+eagle"):  # ar drafts nothing; an untrained EAGLE head guesses
        assert any(drafted_eos), f"{method} never drafted EOS"
    for limit in (1, 2, 7, 33):
        result = run(tiny_llama, method, prompt, limit, static=static)
        assert result.tokens == expected[:limit], (method, limit)


def test_mock_copy_model_accepts_many_tokens_per_step():
    model = CopyLM(vocab=64)
    rng = np.random.default_rng(0)
    doc = rng.permutation(64)[:40].tolist()
    prompt = doc + doc[:3]  # the copy rule continues with doc[3:], doc again, ...
    expected = model.reference(prompt, 120)
    # Token Recycle is not held to the floor: the mock's predictions in a wrong context (rejected
    # tree nodes) are unrelated to the right ones, unlike a real LM's, so its table stays noisy.
    for method, floor in (("pld", 3.0), ("sam", 3.0), ("sam+recycle", 3.0), ("adaptive", 3.0), ("recycle", 1.0)):
        result = run(model, method, prompt, 120)
        assert result.tokens == expected, method
        assert result.metrics.mean_accepted > floor, (method, result.metrics.to_dict())


def test_tree_paths_and_kv_compaction_on_mock():
    """Token Recycle trees accept along non-first branches, which needs K/V compaction."""
    model = CopyLM(vocab=16)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 16, 60).tolist()
    expected = model.reference(prompt, 150)
    target = TargetModel(model)
    drafter = make_drafter("recycle", vocab_size=16, device=target.device)
    kept_paths = []
    original_keep = target.rows.keep
    target.rows.keep = lambda paths: (kept_paths.extend(p.copy() for p in paths), original_keep(paths))[1]
    result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=150))
    assert result.tokens == expected
    assert any(not np.array_equal(p, np.arange(len(p))) for p in kept_paths), "no off-chain path was accepted"
    assert result.metrics.mean_accepted > 1.5


def test_unknown_method_is_a_user_error():
    from samctl.index.errors import UserError

    with pytest.raises(UserError, match="unknown method"):
        make_drafter("nope", vocab_size=10, device=torch.device("cpu"))


def test_sam_drafts_repeated_text_on_past_its_end() -> None:
    """The longest match of repeated text ends at or just before the text's end, so its continuation
    is short or empty: the draft goes on with t0 and itself (it drafted nothing on a constant run)."""
    for text in ([7] * 12, [7, 8] * 6, [7, 8, 9] * 4, [1, 2, 3, 4, 5, 6, 7] * 2):
        drafter = make_drafter("sam", vocab_size=16, device=torch.device("cpu"), config=EAGER)
        drafter.start(np.asarray(text[:-1], dtype=np.int64), torch.zeros(1, 16))
        draft = drafter.propose(text[-1]).tokens.tolist()
        assert len(draft) >= 8 and draft == (text * 9)[len(text):len(text) + len(draft)], (text, draft)
