"""CUDA checks of GPU.md section 2 (T1-T11): CUDA graphs against eager, every method lossless on the
GPU, static against DynamicCache, half precision, storage growth, pinned buffers, host syncs,
EAGLE without recaptures, capture fallback, the graph cost curve and the CLI; T12-T13: the batched
verify as CUDA graphs, both backends. Skipped without CUDA; the same bookkeeping runs on the CPU
in tests/test_graphs_cpu.py and tests/test_syncs_cpu.py."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from samctl.decode.engine.kv_cache import with_cache
from samctl.decode.drafters.adaptive import _Recycle
from samctl.decode.eagle_head import EagleHead
from samctl.decode.engine.graphs import WIDTHS, enable_cuda_graphs, enable_row_graphs
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import EAGLE_METHODS, METHODS, make_drafter, method as method_entry, uses_store
from samctl.decode.sampling import SamplingConfig
from samctl.decode.tree import DraftTree
from samctl.index.automaton import SuffixAutomaton
from samctl.tokenizer import DEFAULT_MODEL_DIR
from tests.test_decode_greedy import EAGER, hf_greedy, prompts
from tests.test_engine import tiny
from tests.test_graphs_cpu import bucket_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def drafter(name: str, model=None, target=None, **kw):
    eagle = EagleHead(model).to(CUDA).eval() if method_entry(name).needs_eagle else None
    return make_drafter(name, vocab_size=96, device=CUDA, config=EAGER, eagle=eagle, target=target, **kw)


def random_tree(rng: np.random.Generator, k: int) -> DraftTree:
    return DraftTree(tokens=rng.integers(0, 96, k), parents=np.array([rng.integers(-1, i) for i in range(k)], np.int32))


def accept_random_path(rng, tree: DraftTree, targets) -> None:
    k = len(tree)
    node, path = (int(rng.integers(-1, k)) if k else -1), []
    while node >= 0:
        path, node = path + [node + 1], int(tree.parents[node])
    for t in targets:
        t.keep(np.array([0] + path[::-1], np.int64))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_t1_graphs_equal_eager_per_step(dtype, tol):
    model = tiny().to(CUDA, dtype)
    eager, graphed = TargetModel(model), TargetModel(model)
    enable_cuda_graphs(graphed, reserve=800)
    graphs = graphed.graphs
    assert graphs is not None and graphs.failed is None and graphs.captures > 0
    captures = graphs.captures
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 96, 40)).to(CUDA)
    for t in (eager, graphed):
        t.prefill(prompt, reserve=600)
    steps = 0
    for k in [0, 1, 63, 64, 100, 127] + list(rng.integers(0, 128, 34)):
        tree, t0 = random_tree(rng, int(k)), int(rng.integers(0, 96))
        a = eager.verify(eager.verify_input(t0, tree), tree).float()
        b = graphed.verify(graphed.verify_input(t0, tree), tree).float()
        steps += 1
        assert ((a - b).abs().max() / a.abs().max()).item() < tol, k
        accept_random_path(rng, tree, (eager, graphed))
    assert graphs.replays == steps and graphed.eager_fallbacks == 0 and graphs.captures == captures


def _store_for(expected: list[int]) -> SuffixAutomaton:
    corpus = np.asarray(expected[:40], dtype=np.int32)
    return SuffixAutomaton.build(corpus, np.array([0, 40]))


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("name", METHODS + EAGLE_METHODS + ("sdsat",))
def test_t2_every_method_greedy_equals_generate(name, graphs):
    model = tiny(sdsat={"sat_token_id": 95, "sat_count": 4})
    for prompt in prompts(96):
        expected = hf_greedy(model, prompt, 60, eos=None)
        model.cuda()
        target = TargetModel(model)
        enable_cuda_graphs(target, graphs, reserve=256)
        static = _store_for(expected) if uses_store(name) else None
        result = generate(target, drafter(name, model, target, static=static), prompt, GenerationConfig(max_new_tokens=60))
        model.cpu()
        assert result.tokens == expected, (name, graphs, prompt)
        if graphs:
            assert result.metrics.eager_verifies == 0, (name, result.metrics.eager_verifies)


@pytest.mark.parametrize("arch,kv_heads", [("llama", 4), ("llama", 2), ("llama", 1), ("qwen2", 2)])
def test_t3_static_cache_equals_dynamic_cache_on_cuda(arch, kv_heads):
    model = tiny(arch, kv_heads).to(CUDA)
    target = TargetModel(model)  # on CUDA: grouped heads folded (decode/engine/attention.py)
    ids = torch.randint(0, 96, (30,), device=CUDA)
    dynamic = DynamicCache(config=model.config)
    with torch.inference_mode():
        target.prefill(ids[:10], reserve=40)
        model(input_ids=ids[None, :10], **with_cache(model, dynamic))
        for start, stop in ((10, 11), (11, 17), (17, 30)):
            chain = DraftTree.chain(ids[start + 1 : stop].cpu().numpy())
            got = target.verify(ids[start:stop], chain)
            target.keep(np.arange(stop - start))
            want = model(input_ids=ids[None, start:stop], **with_cache(model, dynamic)).logits[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("graphs", [False, True])
def test_t3_folded_groups_equal_repeat_kv_on_tree_verifies(kv_heads, graphs):
    plain, folded = tiny("llama", kv_heads).to(CUDA), tiny("llama", kv_heads).to(CUDA)
    a, b = TargetModel(plain, fold_groups=False), TargetModel(folded, fold_groups=True)
    enable_cuda_graphs(a, graphs, reserve=400)
    enable_cuda_graphs(b, graphs, reserve=400)
    rng = np.random.default_rng(kv_heads)
    prompt = torch.from_numpy(rng.integers(0, 96, 30)).to(CUDA)
    for t in (a, b):
        t.prefill(prompt)
    for k in (3, 12, 40, 100):
        tree = random_tree(rng, k)
        la, lb = (t.verify(t.verify_input(5, tree), tree) for t in (a, b))
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
        accept_random_path(rng, tree, (a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_t4_half_precision_logits_are_finite_eager_and_graphs(dtype, capsys):
    model = tiny().to(CUDA, dtype)
    prompt = prompts(96)[0]
    reference = hf_greedy(tiny(), prompt, 40, eos=None)
    for graphs in (False, True):
        target = TargetModel(model)
        enable_cuda_graphs(target, graphs, reserve=256)
        target.prefill(torch.tensor(prompt, device=CUDA))
        tree = DraftTree(tokens=np.arange(10), parents=np.array([-1, 0, 0, 1, 1, 2, 2, 3, -1, 8], np.int32))
        assert torch.isfinite(target.verify(target.verify_input(3, tree), tree)).all()
        out = generate(target, drafter("recycle"), prompt, GenerationConfig(max_new_tokens=40)).tokens
        same = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), len(reference))
        with capsys.disabled():
            print(f"\nT4 {dtype} graphs={graphs}: agrees with float32 HF greedy for {same}/{len(reference)} tokens")


def test_t5_storage_growth_mid_request_under_graphs():
    model = tiny().to(CUDA)
    target = TargetModel(model)
    enable_cuda_graphs(target, reserve=64)
    prompt = prompts(96)[1] * 12  # 360 tokens: the cache grows at the prefill
    expected = generate(TargetModel(model), drafter("recycle"), prompt, GenerationConfig(max_new_tokens=60)).tokens
    assert generate(target, drafter("recycle"), prompt, GenerationConfig(max_new_tokens=60)).tokens == expected
    assert target.graphs.prepares == 2
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        generate(target, drafter("recycle"), prompt, GenerationConfig(max_new_tokens=60))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20), (before, torch.cuda.memory_allocated())
    assert target.graphs.prepares == 2


def test_t6_pinned_recycle_equals_host_path_without_syncs_between():
    gen = torch.Generator().manual_seed(0)
    host, device = _Recycle(96, 8, torch.device("cpu")), _Recycle(96, 8, CUDA)
    for _ in range(4):
        ids = torch.randint(-1, 96, (20,), generator=gen)
        logits = torch.randn(20, 96, generator=gen)
        host.learn(ids, logits)
        device.learn(ids.to(CUDA), logits.to(CUDA))  # two learns with no sync between: the event orders them
    device.learn(torch.full((1,), -1, device=CUDA), torch.zeros(1, 96, device=CUDA))  # flushes the last copy
    assert np.array_equal(host.table, device.table)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", ["ar", "pld", "recycle", "adaptive", "lookahead"])
def test_t7_one_host_sync_per_step(name, temperature, graphs):
    model = tiny().to(CUDA)
    prompt = prompts(96)[0]
    sampling = SamplingConfig(temperature, seed=0)
    target = TargetModel(model)
    enable_cuda_graphs(target, graphs, reserve=256)
    generate(target, drafter(name), prompt, GenerationConfig(max_new_tokens=8, sampling=sampling))  # warm-up
    d = drafter(name)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            result = generate(target, d, prompt, GenerationConfig(max_new_tokens=40, sampling=sampling))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("ynchroniz" in str(w.message) for w in record)
    assert syncs <= result.metrics.steps + 1, (name, graphs, temperature, syncs, result.metrics.steps)


def test_t8_alternating_eagle_and_ar_capture_nothing_after_the_first():
    model = tiny().to(CUDA)
    target = TargetModel(model)
    enable_cuda_graphs(target, reserve=256)
    captures = target.graphs.captures
    head = EagleHead(model).to(CUDA).eval()
    for name in ("eagle", "ar", "eagle", "ar", "eagle"):
        d = make_drafter(name, vocab_size=96, device=CUDA, eagle=head if name == "eagle" else None)
        generate(target, d, prompts(96)[0], GenerationConfig(max_new_tokens=40))
        assert target.graphs.captures == captures, name


class _Failing:
    def new_pool(self):
        return None

    def capture(self, forward, pool):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_t9_capture_failure_falls_back_to_eager():
    model = tiny().to(CUDA)
    target = TargetModel(model)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        enable_cuda_graphs(target, True, 256, _Failing())
    prompt = prompts(96)[0]
    result = generate(target, drafter("pld"), prompt, GenerationConfig(max_new_tokens=30))
    assert result.tokens == generate(TargetModel(model), drafter("pld"), prompt, GenerationConfig(max_new_tokens=30)).tokens
    assert result.metrics.eager_verifies == result.metrics.steps
    # a model whose forward reads a device value on the host (dynamic RoPE) either captures or falls back
    dynamic = tiny(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)).to(CUDA)
    target = TargetModel(dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        enable_cuda_graphs(target, reserve=256)
    out = generate(target, drafter("pld"), prompt, GenerationConfig(max_new_tokens=30)).tokens
    assert out == generate(TargetModel(dynamic), drafter("pld"), prompt, GenerationConfig(max_new_tokens=30)).tokens


def test_t10_graph_cost_curve_is_step_shaped_and_cached_apart(tmp_path, monkeypatch):
    from samctl.costs import cost_curve, curve_key
    from samctl.models import engine_for

    monkeypatch.setenv("SAMCTL_CACHE", str(tmp_path))
    engine = engine_for(tiny().to(CUDA), None, name="tiny")
    eager = cost_curve(engine)
    eager_key = curve_key(engine)
    enable_cuda_graphs(engine.target, reserve=512)
    graphs = cost_curve(engine)
    assert curve_key(engine) != eager_key and len(eager) == 64 and len(graphs) == WIDTHS[-1]
    for lo, hi in [(3, 4), (5, 8), (33, 64), (65, 128)]:
        assert len(set(graphs[lo - 1 : hi])) == 1, (lo, hi)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


@pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="no embedded model")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_t11_cli_generate_compare_on_cuda(dtype):
    proc = subprocess.run([sys.executable, "-m", "samctl", "generate", "--device", "cuda", "--dtype", dtype, "--compare",
                           "--max-new-tokens", "32", "--json", "--prompt", "def fibonacci(n):"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["metrics"]["eager_verifies"] == 0, out["metrics"]
    if dtype == "float32":
        assert out["compare"]["identical"] is True, out["compare"]
    else:
        print(f"\nT11 bfloat16: identical={out['compare']['identical']} first_difference={out['compare']['first_difference']}")


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_t12_batched_graphs_equal_eager_across_buckets(backend, dtype, tol):
    # the batched verify replayed as CUDA graphs at (rows, width, key length) buckets against the
    # same steps run eagerly: random trees of ragged widths, 1..3 rows, rows past the first key bucket
    from samctl.decode.engine.batched import BatchedTarget
    from samctl.decode.engine.graphs import enable_batch_graphs
    from samctl.decode.engine.native import use_backend

    model = tiny().to(CUDA, dtype)
    use_backend(model, backend)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 96, n) for n in (3, 280, 40)]
    eager, graphed = BatchedTarget(model, 3, 320), BatchedTarget(model, 3, 320)
    for target in (eager, graphed):
        target.prefill([0, 1, 2], prompts, [False] * 3)
    enable_batch_graphs(graphed, 8)
    graphs = graphed.graphs
    assert graphs is not None and graphs.failed is None and len(graphs.buckets) > 1
    def check(got, want):
        assert torch.isfinite(got).all() and (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()

    bucket_steps(eager, graphed, rng, check)
    assert graphs.replays == 6 and graphed.eager_fallbacks == 0 and graphs.prepares == 1


@pytest.mark.parametrize("method", ["adaptive", "eagle", "sd", "ouroboros"])
def test_t13_batched_run_with_graphs_equals_batch1_on_cuda(method):
    # BatchRun with graphs on (as the server and --input batches run on a GPU): every record's
    # greedy output equals its batch-1 output in float32, native backend; a draft model's own
    # batch drafts under graphs as it does eagerly (its padding rows may be live forks' caches)
    from samctl.decode.loop import generate_batch
    from samctl.decode.draft_model import DraftModel
    from samctl.decode.engine.native import use_backend
    from tests.test_draft_model import near_draft

    model = tiny().to(CUDA)
    use_backend(model, "native")
    eagle = EagleHead(model).to(CUDA).eval() if method_entry(method).needs_eagle else None
    ps = [p for p in prompts(96) if len(p) > 1] * 3
    config = GenerationConfig(max_new_tokens=40)

    def run(graphs: bool, batch: bool):
        draft = DraftModel(near_draft(tiny()).to(CUDA)) if method_entry(method).needs_draft else None
        if draft is not None and graphs:  # as load_draft does beside a graphed target
            enable_row_graphs(draft.rows.target)

        def make():
            return make_drafter(method, vocab_size=96, device=CUDA, config=EAGER, eagle=eagle,
                                draft=None if draft is None else draft.fork())

        if not batch:
            return [generate(TargetModel(model), make(), p, config) for p in ps], draft
        return generate_batch(model, make, ps, config, 4, cost=1.0 + 0.02 * np.arange(1, 513), graphs=graphs), draft

    alone, _ = run(False, False)
    batched, draft = run(True, True)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    if draft is not None:
        assert draft.rows.target.graphs.replays > 0
        eager, _ = run(False, True)
        drafts = [(r.metrics.drafted, r.metrics.accept_hist) for r in batched]
        assert drafts == [(r.metrics.drafted, r.metrics.accept_hist) for r in eager]
        assert 0 < sum(r.metrics.accepted for r in batched) < sum(r.metrics.drafted for r in batched)
