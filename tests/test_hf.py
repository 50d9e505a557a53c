"""samctl.hf: `model.generate(custom_generate=...)` is plain `generate`, only faster.

Greedy output equals plain `generate` token for token; sampled sequences fit the model's exact
distribution (chi-square, as tests/test_decode_sampling.py, which also rejects every planted
acceptance bug); what samctl cannot honour exactly is refused with a UserError.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.generation.streamers import BaseStreamer

import samctl.hf
from samctl.decode.sampling import SamplingConfig, warp_probs
from samctl.index.automaton import SuffixAutomaton
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
from samctl.index.errors import ConfigError, UserError
from tests.planted import BUGS, acceptance
from tests.test_decode_sampling import fits


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models on a busy machine: one thread avoids contention (the cost curve measured
    # here times ~200 verify forwards).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    base = rng.integers(3, vocab, 10).tolist()
    return [base + base[:6] + rng.integers(3, vocab, 4).tolist(), rng.integers(3, vocab, 25).tolist(), [5]]


def plain(model, prompt: list[int], **kw) -> torch.Tensor:
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kw)


def fast(model, prompt: list[int], custom, **kw):
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, custom_generate=custom, **kw)


def test_greedy_equals_plain_generate(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    custom = samctl.hf.make_generate(method="adaptive")  # fresh: no memory from other tests
    accepted = 0
    for prompt in prompts(model.config.vocab_size):
        for eos in (None, 2):
            expected = plain(model, prompt, do_sample=False, max_new_tokens=60, eos_token_id=eos)
            got = fast(model, prompt, custom, do_sample=False, max_new_tokens=60, eos_token_id=eos)
            assert torch.equal(got, expected), (prompt, eos)
            accepted += custom.last_metrics.accepted
    assert accepted > 0, "no draft was accepted: the test would prove nothing"


@pytest.mark.parametrize("method", ["sam", "pld", "recycle"])
def test_greedy_equals_plain_generate_other_methods(tiny_llama, tmp_path, method):
    prompt = prompts(96)[0]
    expected = plain(tiny_llama, prompt, do_sample=False, max_new_tokens=50)
    store = None
    if method == "sam":  # a store holding the answer itself, so its drafts are long and accepted
        answer = expected[0, len(prompt):].numpy().astype(np.int32)
        store = tmp_path / "s.sam"
        _save_store(store, answer)
    custom = samctl.hf.make_generate(store, method=method, tokenizer=_FakeTokenizer())
    got = fast(tiny_llama, prompt, custom, do_sample=False, max_new_tokens=50)
    assert torch.equal(got, expected)
    assert custom.last_metrics.accepted > 0, f"{method}: no draft was accepted: the test would prove nothing"
    if method == "sam":
        assert custom.last_metrics.mean_accepted > 3


def test_streamer_and_dict_output(tiny_llama):
    prompt = prompts(96)[0]
    expected = plain(tiny_llama, prompt, do_sample=False, max_new_tokens=30)
    streamer = Collect()
    out = fast(tiny_llama, prompt, samctl.hf.custom_generate, do_sample=False, max_new_tokens=30,
               streamer=streamer, return_dict_in_generate=True)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(out.sequences, expected)
    # generate itself sends the prompt first; samctl sends the new tokens, then ends
    assert streamer.puts[0] == prompt
    assert sum(streamer.puts[1:], []) == expected[0, len(prompt):].tolist()
    assert streamer.ended


@pytest.mark.parametrize("kw,what", [
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(num_beams=2), "beam search"),
    (dict(do_sample=True, num_return_sequences=2), "one prompt at a time"),
    (dict(min_new_tokens=5), "MinLength"),
    (dict(max_time=10.0), "MaxTimeCriteria"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
])
def test_refuses_what_it_cannot_honour(tiny_llama, kw, what):
    with pytest.raises(UserError, match=what):
        fast(tiny_llama, [5, 6, 7], samctl.hf.custom_generate, max_new_tokens=5, **kw)


def test_refuses_batches_and_padding(tiny_llama):
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(UserError, match="one prompt at a time"):
        tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=samctl.hf.custom_generate,
                            max_new_tokens=4, pad_token_id=0)
    ids = torch.tensor([[0, 6, 7]])
    with pytest.raises(UserError, match="padded"):
        tiny_llama.generate(ids, attention_mask=torch.tensor([[0, 1, 1]]), custom_generate=samctl.hf.custom_generate,
                            max_new_tokens=4, pad_token_id=0)


def test_sessions_do_not_keep_models_alive(tiny_model_dir):
    import gc
    import weakref

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    custom = samctl.hf.make_generate(method="pld")
    fast(model, [5, 6, 7], custom, do_sample=False, max_new_tokens=3)
    fast(model, [5, 6, 7], custom, do_sample=False, max_new_tokens=3)  # the same session again
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_bad_settings_are_one_line_errors():
    with pytest.raises(UserError, match="unknown setting 'max_node'"):
        samctl.hf.make_generate(max_node=3)
    with pytest.raises(UserError, match="unknown method"):
        samctl.hf.make_generate(method="nope")
    with pytest.raises(UserError, match="does not draft from a store"):
        samctl.hf.make_generate("x.sam", method="pld")
    assert "max_nodes" in samctl.hf.setting_names()
    # a bad value is refused by make_generate itself, as SessionConfig does, not at the first generate
    with pytest.raises(ConfigError, match=re.escape("max_nodes= must be >= 0, got -1")):
        samctl.hf.make_generate(max_nodes=-1)
    with pytest.raises(ConfigError, match=re.escape("min_prob= must be a number, got '0.1'")):
        samctl.hf.make_generate(min_prob="0.1")


# -- sampling: the exact distribution of 5-token continuations of a tiny model ------------------

VOCAB, NEW, SAMPLES = 5, 5, 1000
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


def _small_model():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    return model


def _exact(model, sampling: SamplingConfig) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], int]]:
    """-> (probability of every continuation, the model's argmax after every shorter one)."""
    probs, argmax = {(): 1.0}, {}
    with torch.no_grad():
        for length in range(NEW):
            prefixes = [seq for seq in probs if len(seq) == length]
            logits = model(torch.tensor([PROMPT + list(seq) for seq in prefixes])).logits[:, -1]
            rows = warp_probs(logits, sampling).double().numpy()
            for seq, row, best in zip(prefixes, rows, logits.argmax(-1).tolist()):
                argmax[seq] = best
                for token in range(VOCAB):
                    probs[seq + (token,)] = probs[seq] * row[token]
    return {seq: p for seq, p in probs.items() if len(seq) == NEW}, argmax


@pytest.mark.slow
def test_sampling_matches_model_distribution_and_catches_planted_bugs(monkeypatch):
    # A flat verify-cost curve: adaptive drafts its widest trees whatever this machine's timing.
    monkeypatch.setattr("samctl.costs.cost_curve", lambda engine, *_, **__: [1.0] * 64)
    model = _small_model()
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    exact, argmax = _exact(model, sampling)
    views = (lambda out: tuple(t == argmax[out[:i]] for i, t in enumerate(out)),  # hits of the model's argmax
             *(lambda out, i=i: out[i] for i in range(NEW)))

    def draw(bug: str | None, looks: tuple[int, ...]) -> tuple[float, int]:
        custom = samctl.hf.make_generate(method="adaptive")  # fresh: no memory from other runs
        torch.manual_seed(11)
        counts: dict[tuple[int, ...], int] = {}
        accepted = 0
        with acceptance(bug):
            for look in looks:
                while sum(counts.values()) < look:
                    out = fast(model, PROMPT, custom, do_sample=True, temperature=0.9, top_p=0.95, top_k=0,
                               max_new_tokens=NEW)
                    key = tuple(out[0, len(PROMPT):].tolist())
                    counts[key] = counts.get(key, 0) + 1
                    accepted += custom.last_metrics.accepted
                p_value = fits(counts, exact, views=views)
                if bug is not None and p_value < 1e-6:
                    break
        return p_value, accepted

    p_value, accepted = draw(None, (SAMPLES,))
    assert accepted > SAMPLES, f"only {accepted} drafts accepted: the test would prove nothing"
    assert p_value > 1e-3, p_value
    caught = {bug: draw(bug, (250, 500, 1000, 2000))[0] for bug in BUGS}
    assert all(p < 1e-6 for p in caught.values()), f"planted bugs not caught (p-values): {caught}"


class _FakeTokenizer:
    """Stands in for the model's tokenizer when checking a test store's fingerprint."""

    eos_token_id = None

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(96)}


def _save_store(path, tokens: np.ndarray) -> None:
    from samctl.tokenizer import tokenizer_fingerprint

    automaton = SuffixAutomaton.build(tokens, np.array([0, len(tokens)], dtype=np.int64))
    meta = StoreMeta(tokenizer_name="test", tokenizer_fingerprint=tokenizer_fingerprint(_FakeTokenizer()),
                     vocab_size=96, eos_token_id=None, build=BuildConfig(kind="sam", append_eos=False),
                     corpus=CorpusStats(documents=1, tokens=len(tokens), inputs=("test",)))
    save_datastore(str(path), automaton, meta)
