"""Draft-model methods (sd, specdec++, sam+draft): lossless greedy and sampling, a draft cache
that is never re-fed and always equals a fresh forward, the p/q rule, and the tokenizer check."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

from samctl.decode.engine.kv_cache import with_cache
from samctl.decode.accept import speculative_accept
from samctl.decode.acceptance_head import AcceptanceHead, HeadConfig
from samctl.decode.draft_model import DraftModel
from samctl.decode.drafters.base import Drafter
from samctl.decode.configs import DraftConfig, SpecDecConfig
from samctl.decode.drafters.ouroboros import OuroborosConfig
from samctl.decode.drafters.sam import SamConfig
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import DRAFT_METHODS, MethodConfig, make_drafter
from samctl.decode.sampling import SamplingConfig, warp_probs
from samctl.decode.engine.target import TargetModel
from samctl.decode.tree import DraftTree
from samctl.index.errors import UserError
from tests.conftest import _tiny, save_tiny_model_with_tokenizer
from tests.test_decode_greedy import hf_greedy, prompts

SPECDEC = SpecDecConfig(stop_threshold=0.3, min_draft=1, max_draft=8)


def random_head(hidden_size: int, seed: int = 0, blocks: int = 3) -> AcceptanceHead:
    torch.manual_seed(seed)
    return AcceptanceHead(HeadConfig(hidden_size, num_blocks=blocks)).eval()


def drafter_for(method: str, target_model, draft_model, gamma: int = 4, sampling=SamplingConfig(),
                eos: tuple[int, ...] = (), vocab_limit: int | None = None, sam=SamConfig(dyn_threshold=2, static_bias=1)):
    draft = DraftModel(draft_model, vocab_limit=vocab_limit or target_model.config.vocab_size)
    head = random_head(draft.hidden_size) if method == "specdec++" else None
    config = MethodConfig(sam=sam, draft=DraftConfig(gamma=gamma), specdec=SPECDEC,
                          ouroboros=OuroborosConfig(ngram=4, window=4))
    drafter = make_drafter(method, vocab_size=target_model.config.vocab_size, device=torch.device("cpu"),
                           eos_token_ids=eos, config=config, draft=draft, head=head, sampling=sampling)
    return drafter, draft


def near_draft(model, vocab: int | None = None, scale: float = 0.5, seed: int = 1):
    """A draft that agrees with `model` often, not always: its copy with noise on the head (and,
    given `vocab`, rows added to the vocabulary). An unrelated random draft has every draft
    rejected, and then greedy equality shows nothing of acceptance or the draft cache's rollback."""
    import copy

    draft = copy.deepcopy(model).eval()
    if vocab is not None and vocab != draft.config.vocab_size:
        draft.resize_token_embeddings(vocab, mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=generator) * head.std() * scale)
    return draft


def run(target_model, drafter, prompt, max_new_tokens, eos=(), sampling=SamplingConfig()):
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_ids=eos, sampling=sampling)
    return generate(TargetModel(target_model), drafter, prompt, config)


def assert_cache_is_fresh(draft: DraftModel, history: list[int]) -> None:
    """The draft cache holds exactly the K/V a fresh forward over a prefix of the history computes."""
    n = draft.cached
    assert n <= len(history), (n, len(history))
    if n == 0:
        return
    fresh = DynamicCache(config=draft.model.config)
    with torch.no_grad():
        draft.model(input_ids=torch.tensor([history[:n]]), **with_cache(draft.model, fresh), use_cache=True)
    storage = draft.rows.target.cache.storage  # [2, layers, rows, kv_heads, capacity, head_dim]
    for i, ref in enumerate(fresh.layers):
        torch.testing.assert_close(storage[0, i, draft.row, :, :n], ref.keys[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(storage[1, i, draft.row, :, :n], ref.values[0], rtol=1e-4, atol=1e-5)


class CacheChecked(Drafter):
    """Wraps a drafter; after every observe, checks the draft cache against the committed text."""

    def __init__(self, drafter, draft: DraftModel) -> None:
        self.drafter, self.draft, self.name = drafter, draft, drafter.name
        self.history: list[int] = []
        self.checks = 0

    def start(self, prompt, prompt_logits) -> None:
        self.history = [int(t) for t in prompt]
        self.drafter.start(prompt, prompt_logits)

    def propose(self, t0: int) -> DraftTree:
        return self.drafter.propose(t0)

    def observe(self, committed, input_ids, logits) -> None:
        self.drafter.observe(committed, input_ids, logits)
        self.history += [int(t) for t in committed]
        assert_cache_is_fresh(self.draft, self.history)
        self.checks += 1


# ------------------------------------------------------------------------------------------------
# Greedy: identical to plain greedy, token for token


@pytest.mark.parametrize("method,gamma", [("sd", 1), ("sd", 5), ("specdec++", 4), ("sam+draft", 4)])
def test_greedy_equals_generate(tiny_model_dir, method, gamma):
    target_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    draft_model = near_draft(target_model)
    for prompt in prompts(target_model.config.vocab_size)[:2]:
        expected = hf_greedy(target_model, prompt, 60, eos=None)
        drafter, draft = drafter_for(method, target_model, draft_model, gamma)
        checked = CacheChecked(drafter, draft)
        result = run(target_model, checked, prompt, 60)
        assert result.tokens == expected, (method, gamma, prompt)
        m = result.metrics
        assert m.new_tokens == 60 and checked.checks > 0
        assert 0 < m.accepted < m.drafted, m.to_dict()  # drafts accepted and rejected: both paths checked


@pytest.mark.parametrize("draft_vocab", [96, 112])
def test_greedy_with_another_draft_vocabulary(tiny_llama, draft_vocab):
    draft_model = near_draft(tiny_llama, vocab=draft_vocab)
    prompt = prompts(96)[0]
    expected = hf_greedy(tiny_llama, prompt, 60, eos=None)
    drafter, _ = drafter_for("sd", tiny_llama, draft_model, gamma=4)
    result = run(tiny_llama, drafter, prompt, 60)
    assert result.tokens == expected
    assert 0 < result.metrics.accepted < result.metrics.drafted, result.metrics.to_dict()


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_eos_and_max_tokens_edges(tiny_llama, method):
    draft_model = near_draft(tiny_llama)
    prompt = prompts(96)[0]
    expected = hf_greedy(tiny_llama, prompt, 60, eos=None)
    eos = expected[17]
    first = expected.index(eos)
    drafter, _ = drafter_for(method, tiny_llama, draft_model, eos=(eos,))
    with_eos = run(tiny_llama, drafter, prompt, 60, eos=(eos,))
    assert with_eos.tokens == expected[: first + 1] and with_eos.finish_reason == "eos"
    for limit in (1, 2, 7, 33):
        drafter, _ = drafter_for(method, tiny_llama, draft_model)
        assert run(tiny_llama, drafter, prompt, limit).tokens == expected[:limit], (method, limit)


def test_draft_with_a_shorter_context_stops_drafting_in_time(tiny_llama):
    draft_model = _tiny("llama", vocab=96, seed=1).eval()
    draft_model.config.max_position_embeddings = 40
    prompt = prompts(96)[0]
    expected = hf_greedy(tiny_llama, prompt, 60, eos=None)
    for method in ("sd", "sam+draft"):
        drafter, draft = drafter_for(method, tiny_llama, draft_model, gamma=5)
        result = run(tiny_llama, drafter, prompt, 60)
        assert result.tokens == expected and draft.cached <= 40, (method, draft.cached)
        assert result.metrics.drafted > 0


def test_self_draft_accepts_everything_and_feeds_each_token_once(tiny_llama):
    """The target as its own draft: every greedy draft is accepted, so a wrong cache rollback
    (a stale or re-fed prefix) would show as a rejection; each token is fed exactly once."""
    prompt = prompts(96)[1]
    for gamma in (1, 4):
        drafter, draft = drafter_for("sd", tiny_llama, tiny_llama, gamma=gamma)
        result = run(tiny_llama, drafter, prompt, 61)
        m = result.metrics
        assert m.acceptance_rate == 1.0 and m.accepted == m.drafted, m.to_dict()
        assert m.steps == -(-60 // (gamma + 1))  # full steps of gamma + 1 tokens after the first token
        assert draft.dropped == 0 and draft.fed == draft.cached <= len(prompt) + len(result.tokens)


def test_rejected_drafts_are_the_only_tokens_dropped(tiny_llama):
    draft_model = near_draft(tiny_llama)  # some drafts accepted: rollbacks keep a prefix of the draft
    prompt = prompts(96)[0]
    for method in (m for m in DRAFT_METHODS if m != "ouroboros"):  # it drafts through its own engine
        drafter, draft = drafter_for(method, tiny_llama, draft_model, gamma=5)
        m = run(tiny_llama, drafter, prompt, 70).metrics
        assert draft.fed == draft.cached + draft.dropped, method
        assert 0 < draft.dropped <= m.drafted - m.accepted, (method, draft.dropped, m.to_dict())


def test_sam_draft_uses_both_sources_and_the_draft_catches_up(tiny_llama):
    draft_model = _tiny("llama", vocab=96, seed=1).eval()
    prompt = prompts(96)[0]
    drafter, draft = drafter_for("sam+draft", tiny_llama, draft_model)
    result = run(tiny_llama, drafter, prompt, 80)
    assert drafter.name == "sam+draft"
    assert drafter.sources["fallback"] > 0 and drafter.sources["dynamic"] > 0, drafter.sources
    assert result.tokens == hf_greedy(tiny_llama, prompt, 80, eos=None)
    # Committed during retrieval steps, then fed in one catch-up forward: still never twice.
    assert draft.fed == draft.cached + draft.dropped


def test_forks_are_rows_of_one_batch_and_a_row_is_reused_once_its_holder_is_gone(tiny_llama):
    import gc

    draft = DraftModel(tiny_llama)
    a, b = draft.fork(), draft.fork()
    assert (draft.row, a.row, b.row) == (0, 1, 2) and a.rows is draft.rows
    del a
    gc.collect()
    assert draft.fork().row == 1


def test_missing_draft_or_head_is_a_user_error(tiny_llama):
    with pytest.raises(UserError, match="draft_model="):
        make_drafter("sd", vocab_size=96, device=torch.device("cpu"))
    with pytest.raises(UserError, match="acc_head="):
        make_drafter("specdec++", vocab_size=96, device=torch.device("cpu"), draft=DraftModel(tiny_llama))
    with pytest.raises(UserError, match="hidden size"):
        make_drafter("specdec++", vocab_size=96, device=torch.device("cpu"), draft=DraftModel(tiny_llama),
                     head=random_head(7))


# ------------------------------------------------------------------------------------------------
# The p/q rule itself


@pytest.mark.parametrize("draft_vocab", [5, 3])
def test_speculative_accept_first_token_follows_p(draft_vocab):
    """One drafted token x ~ q: the emitted token (x if accepted, else the residual draw) ~ p,
    also when the draft's vocabulary is smaller than the target's. The same check rejects the
    planted q rules that change the first token (tests/planted.py): it can tell."""
    from tests.planted import _spec_rule

    torch.manual_seed(0)
    vocab = 5
    logits = torch.randn(2, vocab) * 1.5
    sampling = SamplingConfig(temperature=1.0)
    p = warp_probs(logits, sampling)[0]
    q = torch.softmax(torch.randn(1, draft_vocab) * 1.5, -1)

    def fit(rule, n: int) -> tuple[float, int]:
        generator = torch.Generator().manual_seed(1)
        counts = np.zeros(vocab)
        accepted = 0
        for _ in range(n):
            x = torch.multinomial(q, 1, generator=generator)[0]
            tree = DraftTree.chain(x, q=q)
            path, bonus, _ = rule(logits, tree, torch.cat((torch.tensor([0]), x)), sampling, generator)
            first = int(x) if len(path) == 2 else bonus
            counts[first] += 1
            accepted += len(path) - 1
        expected = p.double().numpy() / p.double().sum().item() * n
        return chisquare(counts, expected).pvalue, accepted

    n = 12000
    p_value, accepted = fit(speculative_accept, n)
    assert p_value > 1e-3, p_value
    assert 0 < accepted < n
    for bug in ("redraw", "residual"):  # shared_u and bonus leave a one-token chain's first token alone
        assert fit(_spec_rule(bug), 3000)[0] < 1e-6, bug


def test_speculative_accept_edges():
    sampling = SamplingConfig(temperature=1.0)
    logits = torch.tensor([[0.0, 2.0, -1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    p = warp_probs(logits, sampling)
    generator = torch.Generator().manual_seed(0)
    # q == p at every position: always accepted, then a bonus from the last row.
    tree = DraftTree.chain(torch.tensor([1, 0]), q=p[:2].clone())
    for _ in range(50):
        path, bonus, _ = speculative_accept(logits, tree, torch.tensor([7, 1, 0]), sampling, generator)
        assert path.tolist() == [0, 1, 2] and 0 <= bonus < 3
    # p(x) = 0 after warping: always rejected, and the replacement is never x.
    warped = SamplingConfig(temperature=1.0, top_k=1)
    q = torch.tensor([[0.5, 0.0, 0.5]])
    tree = DraftTree.chain(torch.tensor([2]), q=q)
    for _ in range(50):
        path, bonus, _ = speculative_accept(logits[:2], tree, torch.tensor([7, 2]), warped, generator)
        assert path.tolist() == [0] and bonus == 1


# ------------------------------------------------------------------------------------------------
# Sampling: the target's distribution, exactly, for every draft-model method, and the planted bugs
# it must catch, is tested with every other method in tests/test_decode_sampling.py.


def test_sampling_is_reproducible_and_keeps_the_cache_fresh(tiny_llama):
    draft_model = _tiny("llama", vocab=96, seed=1).eval()
    prompt = prompts(96)[0]
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=11)
    runs = []
    for _ in range(2):
        drafter, draft = drafter_for("sd", tiny_llama, draft_model, sampling=sampling)
        checked = CacheChecked(drafter, draft)
        result = run(tiny_llama, checked, prompt, 50, sampling=sampling)
        runs.append(result.tokens)
        assert checked.checks > 0 and result.metrics.accepted < result.metrics.drafted
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------------
# Loading a draft next to the target, and the CLI


def save_model_with_tokenizer_of(source_dir, path, hidden: int = 16, layers: int = 1, seed: int = 5) -> None:
    """A smaller Llama that shares the tokenizer saved in source_dir."""
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-draft")
    save_model_with_tokenizer_of(model_dir, path)
    return path


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-other-tokenizer")
    save_tiny_model_with_tokenizer(path, seed=3, vocab=280, extra_text="completely different words here")
    return path


def test_load_draft_checks_the_tokenizer(model_dir, draft_dir, other_tokenizer_dir):
    from samctl.models import load_draft, load_engine

    engine = load_engine(str(model_dir), "cpu", "float32")
    draft = load_draft(str(draft_dir), engine)
    assert draft.vocab == engine.vocab_size and draft.dtype == torch.float32
    with pytest.raises(UserError, match="another tokenizer"):
        load_draft(str(other_tokenizer_dir), engine)
    with pytest.raises(UserError, match="tokenizer"):
        load_draft(str(draft_dir / "missing"), engine)


def samctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samctl", *args], capture_output=True, text=True, timeout=300)


PROMPT_TEXT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.mark.slow
def test_cli_sd_reports_acceptance_and_refuses_bad_drafts(model_dir, draft_dir, other_tokenizer_dir):
    common = ("generate", "--model", str(model_dir), "--prompt", PROMPT_TEXT, "--max-new-tokens", "30")
    proc = samctl(*common, "--method", "sd", "--draft-model", str(draft_dir), "--gamma", "3", "--json", "--compare")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["compare"]["identical"] is True and out["draft_model"] == str(draft_dir)
    assert out["metrics"]["drafted"] > 0 and 0.0 <= out["metrics"]["acceptance_rate"] <= 1.0
    assert out["config"]["method"]["draft"]["gamma"] == 3
    bad = samctl(*common, "--method", "sd", "--draft-model", str(other_tokenizer_dir))
    assert bad.returncode == 2 and "another tokenizer" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = samctl(*common, "--method", "sam+draft")
    assert missing.returncode == 2 and "--draft-model" in missing.stderr
    no_head = samctl(*common, "--method", "specdec++", "--draft-model", str(draft_dir))
    assert no_head.returncode == 2 and "--acc-head" in no_head.stderr
    bounds = samctl(*common, "--method", "specdec++", "--draft-model", str(draft_dir), "--bounds", "5", "2")
    assert bounds.returncode == 2 and "--bounds" in bounds.stderr
