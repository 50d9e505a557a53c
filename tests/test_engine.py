"""The engine: static KV cache against DynamicCache and model.generate, tree compaction, prefill
logits, one host sync per step, Token Recycle's device path, model checks, streaming text."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, Qwen2Config

from samctl.decode.engine.kv_cache import with_cache
from samctl.decode.drafters.oracle import OracleDrafter
from samctl.decode.drafters.recycle import TokenRecycleDrafter
from samctl.decode.loop import BatchRun, DrafterPool, GenerationConfig, generate
from samctl.decode.methods import make_drafter
from samctl.decode.engine.target import TargetModel
from samctl.decode.tree import DraftTree
from samctl.index.errors import UserError
from samctl.detok import IncrementalDetokenizer
from samctl.tokenizer import DEFAULT_MODEL_DIR
from tests.test_decode_greedy import hf_greedy, prompts


def tiny(arch: str = "llama", kv_heads: int = 2, seed: int = 0, **extra):
    # kv_heads 4 = MHA, 2 = GQA, 1 = MQA (4 query heads)
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=kv_heads, max_position_embeddings=512, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("arch,kv_heads", [("llama", 4), ("llama", 2), ("llama", 1), ("qwen2", 2)])
def test_static_cache_greedy_equals_generate(arch, kv_heads):
    model = tiny(arch, kv_heads)
    for prompt in prompts(96):
        expected = hf_greedy(model, prompt, 40, eos=None)
        for method in ("ar", "pld", "recycle"):
            drafter = make_drafter(method, vocab_size=96, device=torch.device("cpu"))
            result = generate(TargetModel(model), drafter, prompt, GenerationConfig(max_new_tokens=40))
            assert result.tokens == expected, (arch, kv_heads, method)


def test_static_cache_logits_equal_dynamic_cache():
    """Same chunked forwards through both caches give bit-identical float32 logits."""
    model = tiny("llama", 2)
    target = TargetModel(model)
    ids = torch.randint(0, 96, (30,))
    dynamic = DynamicCache(config=model.config)
    with torch.inference_mode():
        target.prefill(ids[:10], reserve=40)
        expected = model(input_ids=ids[None, :10], **with_cache(model, dynamic)).logits
        for start, stop in ((10, 11), (11, 17), (17, 30)):
            chain = DraftTree.chain(ids[start + 1 : stop].numpy())
            got = target.verify(ids[start:stop], chain)
            target.keep(np.arange(stop - start))
            want = model(input_ids=ids[None, start:stop], **with_cache(model, dynamic)).logits[0]
            assert torch.equal(got, want), (start, stop)
    assert torch.equal(target.prefill(ids[:10], all_logits=True), expected[0])


def test_tree_compaction_keeps_the_accepted_branch():
    """After accepting an off-chain path, the cache equals one built from the committed text."""
    model = tiny("qwen2", 2)
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 96, 12))
    # tree: root -> a(1) -> b(2); root -> c(3) -> d(4) -> e(5); c -> f(6)
    parents = np.array([-1, 0, -1, 2, 3, 2], dtype=np.int32)
    tokens = rng.integers(0, 96, 6)
    for path in ([0, 1, 2], [0, 3, 4, 5], [0, 3, 6], [0]):
        target = TargetModel(model)
        target.prefill(prompt)
        inputs = target.verify_input(int(prompt[-1]), DraftTree(tokens=tokens, parents=parents))
        target.verify(inputs, DraftTree(tokens=tokens, parents=parents))
        target.keep(np.array(path))
        committed = torch.cat((prompt, inputs[path]))
        assert target.cached == len(committed)
        nxt = torch.tensor([7])
        got = target.verify(nxt, DraftTree.empty())
        with torch.inference_mode():
            want = model(input_ids=torch.cat((committed, nxt))[None]).logits[0, -1:]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_returns_only_the_logits_asked_for():
    model = tiny()
    ids = torch.randint(0, 96, (20,))
    target = TargetModel(model)
    last = target.prefill(ids)
    full = target.prefill(ids, all_logits=True)
    assert last.shape == (1, 96) and full.shape == (20, 96)
    torch.testing.assert_close(last[0], full[-1], rtol=1e-5, atol=1e-5)
    prompt = ids.tolist()
    seen = {}
    for method in ("pld", "recycle"):
        drafter = make_drafter(method, vocab_size=96, device=torch.device("cpu"))
        original = drafter.start
        drafter.start = lambda p, logits, m=method, f=original: (seen.__setitem__(m, logits.shape[0]), f(p, logits))
        generate(TargetModel(model), drafter, prompt, GenerationConfig(max_new_tokens=4))
    assert seen == {"pld": 1, "recycle": 20}


class SyncCounter:
    """Counts the calls that move a device value to the host (each one a sync on CUDA), and the
    indexed writes of a host number (`t[0] = x` copies a host scalar: a sync on CUDA too, seen on
    an H100; `t[:1].fill_(x)` is a kernel)."""

    NAMES = ("cpu", "item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))
        setitem = torch.Tensor.__setitem__

        def counting_setitem(tensor, index, value):
            if isinstance(value, (int, float, bool, np.number)):
                self.count += 1
            return setitem(tensor, index, value)

        monkeypatch.setattr(torch.Tensor, "__setitem__", counting_setitem)

    def _counting(self, original):
        def wrapper(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)
        return wrapper


def device_path_recycle() -> TokenRecycleDrafter:
    # The device (CUDA) code path, run on the CPU: no numba, no host reads.
    drafter = TokenRecycleDrafter(vocab_size=96, device=torch.device("cpu"))
    drafter.on_cpu = False
    drafter._levels = drafter._device_levels()
    return drafter


@pytest.mark.parametrize("method", ["ar", "pld", "sam", "recycle-device", "oracle", "sdsat"])
def test_one_host_sync_per_step(method, monkeypatch):
    model = tiny(sdsat={"sat_token_id": 95, "sat_count": 4})  # the SAT section only matters to sdsat
    prompt = prompts(96)[0]
    expected = hf_greedy(model, prompt, 30, eos=None)
    target = TargetModel(model)
    if method == "recycle-device":
        drafter = device_path_recycle()
    elif method == "oracle":
        drafter = OracleDrafter(np.asarray(expected), 3)
    else:
        drafter = make_drafter(method, vocab_size=96, device=torch.device("cpu"), target=target)
    counter = SyncCounter(monkeypatch)
    result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=30))
    monkeypatch.undo()
    assert result.tokens == expected
    assert counter.count == result.metrics.steps + 1, (counter.count, result.metrics.steps)  # + the prefill's


def test_recycle_device_path_equals_cpu_path():
    model = tiny("llama", 2, seed=3)
    cpu = make_drafter("recycle", vocab_size=96, device=torch.device("cpu"))
    device = device_path_recycle()
    for prompt in prompts(96):
        a = generate(TargetModel(model), cpu, prompt, GenerationConfig(max_new_tokens=50))
        b = generate(TargetModel(model), device, prompt, GenerationConfig(max_new_tokens=50))
        assert a.tokens == b.tokens
        assert a.metrics.accept_hist == b.metrics.accept_hist
        assert torch.equal(cpu.table[:96], device.table[:96])  # row 96 is the device path's sink


def test_learn_rows_writes_what_torch_topk_gives_and_the_last_duplicate_wins():
    from samctl.decode.drafters.recycle import learn_rows

    gen = torch.Generator().manual_seed(0)
    for vocab, k, q in ((96, 8, 1), (1000, 8, 40), (5, 8, 3), (300, 1, 7)):
        logits = torch.randn(q, vocab + 3, generator=gen)  # a padded head: columns past the vocabulary are not ids
        logits[0, :] = 0.0  # all tied: the lowest ids, as torch gives them on CPU
        ids = torch.randint(-1, vocab, (q,), generator=gen)
        ids[-1] = ids[0] if q > 1 else ids[-1]  # a duplicate: the later row is the one kept
        table = np.full((vocab, min(k, vocab)), -7, dtype=np.int32)
        learn_rows(table, ids.numpy(), logits)
        expected = np.full_like(table, -7)
        top = torch.topk(logits[:, :vocab], min(k, vocab), dim=-1, sorted=True)
        for i, token in enumerate(ids.tolist()):
            if token >= 0:
                row = sorted(range(vocab), key=lambda j: (-float(logits[i, j]), j))[: table.shape[1]]
                expected[token] = row
                assert set(row) == set(top.indices[i].tolist()) or i == 0
        assert np.array_equal(table, expected), (vocab, k, q)


def test_sliding_window_caps_the_context():
    model = tiny("qwen2", 2, use_sliding_window=True, sliding_window=24, max_window_layers=0)
    target = TargetModel(model)
    assert target.max_positions == 24
    with pytest.raises(UserError, match="qwen2 uses sliding-window attention"):
        generate(target, make_drafter("ar", vocab_size=96, device=torch.device("cpu")), list(range(3, 40)),
                 GenerationConfig(max_new_tokens=4))
    pool = DrafterPool(lambda: make_drafter("ar", vocab_size=96, device=torch.device("cpu")))
    with pytest.raises(UserError, match="qwen2 uses sliding-window attention"):  # a batch says it alike
        BatchRun(model, 2).submit(0, list(range(3, 40)), GenerationConfig(max_new_tokens=4), pool)
    result = generate(target, make_drafter("pld", vocab_size=96, device=torch.device("cpu")), list(range(3, 13)),
                      GenerationConfig(max_new_tokens=100))
    # 24 positions are computed; the last one predicts one more token
    assert result.finish_reason == "length" and len(result.tokens) == 24 - 10 + 1


def test_attention_that_ignores_masks_is_switched_to_sdpa():
    model = tiny()
    model.config._attn_implementation = "flex_attention"
    TargetModel(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.fixture(scope="module")
def embedded_tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)


def test_incremental_detok_equals_full_decode(embedded_tokenizer):
    tok = embedded_tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = np.random.default_rng(0)
    texts = ["naïve café — 日本語のテキスト 🙂🙂 done.", "def f(x):\n    return x  # ok\n"]
    sequences = [tok(t)["input_ids"] for t in texts]
    sequences += [rng.integers(0, len(tok), rng.integers(1, 60)).tolist() for _ in range(40)]
    for ids in sequences:
        detok = IncrementalDetokenizer(decode)
        pieces, i = [], 0
        while i < len(ids):
            step = int(rng.integers(1, 5))
            pieces.append(detok.push(ids[i : i + step]))
            i += step
        pieces.append(detok.finish())
        assert "".join(pieces) == decode(ids), ids


# ---- CUDA only ---------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_gpu_static_cache_equals_dynamic_cache_and_generate():
    model = tiny("llama", 2).cuda()
    for prompt in prompts(96):
        expected = hf_greedy(model.cpu(), prompt, 40, eos=None)
        model.cuda()
        for method in ("ar", "pld", "recycle"):
            drafter = make_drafter(method, vocab_size=96, device=torch.device("cuda"))
            result = generate(TargetModel(model), drafter, prompt, GenerationConfig(max_new_tokens=40))
            assert result.tokens == expected, method


@pytest.mark.gpu
@cuda
def test_gpu_recycle_device_path_equals_cpu_path():
    # Both paths learn from the same logits: logits computed on each device could flip a top-k tie.
    cpu_drafter = make_drafter("recycle", vocab_size=96, device=torch.device("cpu"))
    gpu_drafter = make_drafter("recycle", vocab_size=96, device=torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        ids = torch.randint(-1, 96, (40,), generator=gen)
        logits = torch.randn(40, 96, generator=gen)
        cpu_drafter._learn(ids, logits)
        gpu_drafter._learn(ids.cuda(), logits.cuda())
    assert torch.equal(cpu_drafter.table[:96], gpu_drafter.table[:96].cpu())


@pytest.mark.gpu
@cuda
def test_gpu_one_host_sync_per_step():
    model = tiny().cuda()
    prompt = prompts(96)[0]
    for method in ("ar", "pld", "recycle"):
        drafter = make_drafter(method, vocab_size=96, device=torch.device("cuda"))
        target = TargetModel(model)
        generate(target, drafter, prompt, GenerationConfig(max_new_tokens=4))  # warm-up: allocations
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning) as record:
                result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=30))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in record if "synchroniz" in str(w.message)]
        assert len(syncs) <= result.metrics.steps + 1, (method, len(syncs), result.metrics.steps)


@pytest.mark.gpu
@cuda
def test_gpu_graphs_equal_eager():
    from samctl.decode.engine.graphs import enable_cuda_graphs

    model = tiny("llama", 2).cuda()
    for prompt in prompts(96):
        outputs = []
        for graphs in (False, True):
            target = TargetModel(model)
            enable_cuda_graphs(target, graphs)
            drafter = make_drafter("recycle", vocab_size=96, device=torch.device("cuda"))
            outputs.append(generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40)).tokens)
        assert outputs[0] == outputs[1]


def test_graphs_stay_off_on_cpu():
    from samctl.decode.engine.graphs import enable_cuda_graphs

    target = TargetModel(tiny())
    enable_cuda_graphs(target, True)
    assert target.graphs is None
