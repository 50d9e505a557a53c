"""CUDA-graph bookkeeping on the CPU: `BatchVerifyGraphs`, at one row (`enable_cuda_graphs`) and
at many, driven through a stand-in backend whose "replay" reruns the captured forward eagerly, so
the fixed-mode cache, row, width and key-length buckets, capture order, fallback and hidden-state
handling run here as they do on a GPU."""
from __future__ import annotations

import gc
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from samctl.decode.engine.graphs import WIDTHS, BatchVerifyGraphs, enable_cuda_graphs, key_buckets
from samctl.decode.engine.kv_cache import ALIGN, aligned
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import make_drafter
from samctl.decode.tree import DraftTree
from tests.test_decode_greedy import prompts
from tests.test_engine import tiny


class StandIn:
    """Capture = run once; replay = run again. Records what was captured, in order."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.captured: list[int] = []
        self.pools = 0
        self.fail_at = fail_at
        self.collector_on = False  # whether Python's cyclic collector was on during any capture

    def new_pool(self) -> object:
        self.pools += 1
        return object()

    def capture(self, forward, pool):
        self.collector_on = self.collector_on or gc.isenabled()
        if self.fail_at is not None and len(self.captured) == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        forward()
        self.captured.append(id(forward))
        return forward


def graphs_on(target: TargetModel, backend: StandIn, reserve: int = 500) -> BatchVerifyGraphs:
    enable_cuda_graphs(target, True, reserve, backend)
    return target.graphs


def random_tree(rng: np.random.Generator, k: int) -> DraftTree:
    parents = np.array([rng.integers(-1, i) for i in range(k)], np.int32)
    return DraftTree(tokens=rng.integers(0, 96, k), parents=parents)


def test_key_buckets_double_up_to_the_capacity():
    assert key_buckets(4352) == (256, 512, 1024, 2048, 4096, 4352)
    assert key_buckets(256) == (256,)
    assert key_buckets(128) == (128,)


def test_prepare_captures_every_width_and_bucket_once_largest_first_into_one_pool():
    target, backend = TargetModel(tiny()), StandIn()
    graphs = graphs_on(target, backend)
    capacity = target.cache.capacity
    assert capacity % ALIGN == 0 and capacity >= 500, capacity
    assert graphs.widths == WIDTHS and graphs.rows == (1,)
    expected = {(1, w, b) for w in WIDTHS for b in key_buckets(capacity) if w <= b}
    assert set(graphs.graphs) == expected and graphs.captures == len(expected)
    assert backend.pools == 1 and graphs.prepares == 1
    sizes = [g.width * g.keys for g in graphs.graphs.values()]  # dict order = capture order
    assert sizes == sorted(sizes, reverse=True), sizes
    assert target.cached == 0  # capturing committed nothing


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_graph_verify_equals_eager_on_random_trees_with_compaction(kv_heads):
    # T1 on the CPU: every width, buckets narrower than the capacity, compaction between steps
    model = tiny("llama", kv_heads)
    eager, graphed = TargetModel(model), TargetModel(model)
    graphs = graphs_on(graphed, StandIn(), reserve=700)
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 96, 40))
    eager.prefill(prompt, reserve=700)
    graphed.prefill(prompt, reserve=700)
    captures, steps = graphs.captures, 0
    for k in [0, 1, 2, 5, 15, 31, 63, 100, 127] + list(rng.integers(0, 128, 10)):
        tree, t0 = random_tree(rng, int(k)), int(rng.integers(0, 96))
        a = eager.verify(eager.verify_input(t0, tree), tree)
        b = graphed.verify(graphed.verify_input(t0, tree), tree)
        steps += 1
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        node, path = int(rng.integers(-1, k)) if k else -1, []
        while node >= 0:
            path, node = path + [node + 1], int(tree.parents[node])
        for t in (eager, graphed):
            t.keep(np.array([0] + path[::-1], np.int64))
    assert graphs.replays == steps and graphed.eager_fallbacks == 0
    assert graphs.captures == captures  # nothing captured after prepare
    assert graphed.cached == eager.cached
    n = eager.cached
    torch.testing.assert_close(graphed.cache.storage[..., :n, :], eager.cache.storage[..., :n, :])


def test_a_verify_reads_only_its_key_bucket(monkeypatch):
    target = TargetModel(tiny())
    graphs_on(target, StandIn(), reserve=2000)
    target.prefill(torch.arange(3, 43), reserve=2000)
    assert target.rows.capacity > 2000
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(k.shape[-2])
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    tree = DraftTree.chain(np.array([5, 6, 7]))
    target.verify(target.verify_input(4, tree), tree)
    assert set(seen) == {256}, seen  # 40 + 4 keys fit the smallest bucket, not the whole capacity


def test_failed_capture_falls_back_to_eager_with_one_warning_and_counts_it():
    model = tiny()
    target = TargetModel(model)
    with pytest.warns(RuntimeWarning, match="capture failed") as record:
        graphs = graphs_on(target, StandIn(fail_at=3))
    assert len(record) == 1 and graphs.failed and not graphs.graphs
    prompt = prompts(96)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second note
        result = generate(target, make_drafter("pld", vocab_size=96, device="cpu"), prompt,
                          GenerationConfig(max_new_tokens=30))
    expected = generate(TargetModel(model), make_drafter("pld", vocab_size=96, device="cpu"), prompt,
                        GenerationConfig(max_new_tokens=30))
    assert result.tokens == expected.tokens
    assert result.metrics.eager_verifies == result.metrics.steps > 0
    assert result.metrics.to_dict()["eager_verifies"] == result.metrics.steps


def test_hidden_states_toggle_without_recapture_and_match_eager():
    # B1: an EAGLE run after an ar run (and back) captures nothing new
    model = tiny()
    eager, graphed = TargetModel(model), TargetModel(model)
    graphs = graphs_on(graphed, StandIn())
    captures = graphs.captures
    rng = np.random.default_rng(1)
    prompt = torch.from_numpy(rng.integers(0, 96, 20))
    for want in (False, True, False, True):
        for t in (eager, graphed):
            t.capture_hidden(want)
            t.prefill(prompt)
        tree = random_tree(rng, 9)
        a = eager.verify(eager.verify_input(3, tree), tree)
        hidden = eager.hidden
        b = graphed.verify(graphed.verify_input(3, tree), tree)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        if want:
            torch.testing.assert_close(graphed.hidden, hidden, rtol=1e-4, atol=1e-4)
        else:
            assert graphed.hidden is None
    assert graphs.captures == captures and graphs.prepares == 1


def test_storage_growth_recaptures_once_and_output_stays_exact():
    model = tiny()
    target = TargetModel(model)
    graphs = graphs_on(target, StandIn(), reserve=64)
    first = graphs.captures
    prompt = prompts(96)[1] * 12  # 360 tokens: past the reserved capacity
    drafter = make_drafter("recycle", vocab_size=96, device="cpu")
    result = generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40))
    expected = generate(TargetModel(model), make_drafter("recycle", vocab_size=96, device="cpu"), prompt,
                        GenerationConfig(max_new_tokens=40))
    assert result.tokens == expected.tokens
    assert graphs.prepares == 2 and graphs.captures > first  # one recapture, at the prefill's growth
    before = graphs.captures
    generate(target, make_drafter("recycle", vocab_size=96, device="cpu"), prompt, GenerationConfig(max_new_tokens=40))
    assert graphs.captures == before  # the grown cache serves the next request as it is


def test_generation_counts_allocations_not_addresses():
    target = TargetModel(tiny())
    target.prefill(torch.arange(3, 13), reserve=10)
    rows = target.rows
    g = rows.cache.generation
    rows.reserve(rows.capacity)  # fits: no allocation
    assert rows.cache.generation == g
    before = rows.capacity
    rows.reserve(before + 1)
    assert rows.cache.generation == g + 1 and rows.capacity % ALIGN == 0
    # growth doubles, so requests of growing length recapture a GPU's graphs log2 times, not
    # at every few dozen tokens (a recapture at a batch's many buckets takes seconds)
    assert rows.capacity == aligned(min(2 * before, rows.max_positions)) > before + 1
    rows.reserve(rows.max_positions + 10)  # past the model's context: what is asked, no more
    assert rows.capacity == aligned(rows.max_positions + 10)


def test_graph_cost_curve_is_a_step_function_and_cached_apart():
    # B4: t(n) = t(width(n)) under graphs, measured at the graph widths, keyed on the graph mode
    from types import SimpleNamespace

    from samctl.costs import curve_key, curve_width
    from samctl.decode.engine.cost import measure_verify_cost

    model = tiny()
    eager, graphed = TargetModel(model), TargetModel(model)
    graphs_on(graphed, StandIn())
    t = measure_verify_cost(graphed, 128, context=32, rounds=1)
    assert len(t) == 128
    for lo, hi in [(3, 4), (5, 8), (33, 64), (65, 128)]:
        assert len(set(t[lo - 1 : hi])) == 1, (lo, hi, t[lo - 1 : hi])
    assert graphed.eager_fallbacks == 0
    engines = [SimpleNamespace(name="tiny", model=model, device=torch.device("cpu"), target=x) for x in (eager, graphed)]
    keys = [curve_key(e) for e in engines]
    assert keys[0]["graphs"] is False and keys[1]["graphs"] is True
    assert keys[0]["cpu"] and keys[0]["cpu"] == keys[1]["cpu"]  # which CPU measured it
    assert [curve_width(e) for e in engines] == [64, 128]


class Widest:
    """A drafter wrapper that records the widest verify (1 + draft nodes) it proposed."""

    def __init__(self, inner) -> None:
        self.inner, self.widest = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, t0: int) -> DraftTree:
        tree = self.inner.propose(t0)
        self.widest = max(self.widest, len(tree) + 1)
        return tree


def test_every_methods_default_gpu_draft_fits_a_captured_width():
    # B2: with the GPU defaults (method_config for a CUDA device) and a flat GPU-like cost curve,
    # no method's draft is wider than the widest graph, so none falls back to eager
    import dataclasses

    from samctl.decode.draft_model import DraftModel
    from samctl.decode.drafters.sam import SamConfig
    from samctl.decode.eagle_head import EagleHead
    from samctl.decode.methods import REGISTRY
    from samctl.index.automaton import SuffixAutomaton
    from samctl.decode.methods import method_config
    from tests.test_draft_model import random_head

    model = tiny(sdsat={"sat_token_id": 95, "sat_count": 13})  # the nucleus reference's widest tree
    config = dataclasses.replace(method_config({}, torch.device("cuda")), sam=SamConfig(dyn_threshold=2, static_bias=1))
    assert config.recycle.nodes == 80 and config.lookahead.window == 15  # the GPU defaults
    prompt = prompts(96)[0] * 3
    expected = generate(TargetModel(model), make_drafter("ar", vocab_size=96, device="cpu"), prompt,
                        GenerationConfig(max_new_tokens=60)).tokens
    corpus = np.asarray((prompt + expected) * 2, dtype=np.int32)
    static = SuffixAutomaton.build(corpus, np.array([0, len(corpus)]))
    draft = DraftModel(tiny(seed=1), vocab_limit=96)
    widest = {}
    for name, entry in REGISTRY.items():
        target = TargetModel(model)
        torch.manual_seed(0)
        drafter = Widest(make_drafter(
            name, vocab_size=96, device="cpu", static=static, config=config, cost=np.ones(257),
            draft=draft, head=random_head(draft.hidden_size) if entry.needs_head else None, target=target,
            eagle=EagleHead(model).eval() if entry.needs_eagle else None))
        generate(target, drafter, prompt, GenerationConfig(max_new_tokens=60))
        widest[name] = drafter.widest
    assert max(widest.values()) <= WIDTHS[-1], widest
    assert widest["recycle"] == 81 and widest["adaptive"] > 33, widest  # the wide drafts really ran


def test_cost_curve_measured_again_when_the_engine_code_changes(monkeypatch):
    # a curve cached by other kernels (another digest of decode/engine) is not reused
    from types import SimpleNamespace

    import samctl.costs as costs

    model = tiny()
    engine = SimpleNamespace(name="tiny-code-key", model=model, device=torch.device("cpu"), target=TargetModel(model))
    measured = []
    monkeypatch.setattr(costs, "measure_verify_cost",
                        lambda target, width, context=256: measured.append((width, context)) or [1.0] * width)
    first = costs.cost_curve(engine)
    assert costs.cost_curve(engine) == first and len(measured) == 1  # cached
    monkeypatch.setattr(costs, "engine_code", lambda: "other-kernels")
    costs.cost_curve(engine)
    assert len(measured) == 2
    # what adaptive sizes drafts by: that curve and one after a long context, cached apart
    cost = costs.verify_cost(engine)
    long = costs.measurable_context(engine.target.rows, costs.LONG_CONTEXT, costs.CURVE_WIDTH)
    assert measured[2:] == [(costs.CURVE_WIDTH, long)] and long > costs.CONTEXT
    assert cost.contexts == (costs.CONTEXT, long)
    costs.verify_cost(engine)
    assert len(measured) == 3


# -- the batched verify's graphs (BatchVerifyGraphs) ---------------------------------------------------

def batch_graphs_on(run, backend: StandIn, max_width: int):
    run.target.graphs = BatchVerifyGraphs(run.target, max_width, backend=backend)
    run.target.graphs.prepare()
    return run.target.graphs


def test_batch_graphs_capture_every_bucket_once_largest_first():
    from samctl.decode.loop import BatchRun
    from samctl.decode.engine.graphs import buckets_upto, ROW_BUCKETS

    run = BatchRun(tiny(), 5, cost=np.full(64, 1.0), max_width=6, capacity=300)
    backend = StandIn()
    graphs = batch_graphs_on(run, backend, 6)
    assert graphs.rows == buckets_upto(ROW_BUCKETS, 5) == (1, 2, 4, 5) and graphs.widths == (1, 2, 4, 7)
    expected = {(r, w, k) for r in graphs.rows for w in graphs.widths for k in key_buckets(run.target.capacity)}
    assert set(graphs.graphs) == expected and graphs.captures == len(expected) and backend.pools == 1
    sizes = [r * g.width * g.keys for (r, _, _), g in graphs.graphs.items()]
    assert sizes == sorted(sizes, reverse=True)
    assert not run.target.lengths.any()  # capturing committed nothing


@pytest.mark.parametrize("backend_name", ["hf", "native"])
def test_batched_graph_verify_equals_eager_with_ragged_rows_refills_and_growth(backend_name):
    # rows join and leave (5 records, 3 slots), trees of every width up to 8, a cache that grows
    # past its first capacity mid-run (a recapture): every record equals its eager batched output
    from samctl.decode.loop import BatchRun, DrafterPool
    from samctl.decode.engine.native import use_backend
    from tests.test_decode_greedy import EAGER

    model = tiny("llama", 2)
    use_backend(model, backend_name)
    rng = np.random.default_rng(5)
    base = rng.integers(3, 96, 10).tolist()
    prompts = [base + base[:6], rng.integers(3, 96, 30).tolist(), base * 3, [7, 8, 9], base[:4] * 4]
    config = GenerationConfig(max_new_tokens=40)

    def outputs(graphed: bool):
        run = BatchRun(model, 3, cost=1.0 + 0.02 * np.arange(1, 513), max_width=8, capacity=64)
        graphs = batch_graphs_on(run, StandIn(), 8) if graphed else None
        prepared = graphs.captures if graphed else 0
        pool = DrafterPool(lambda: make_drafter("adaptive", vocab_size=96, device=torch.device("cpu"), config=EAGER))
        for i, p in enumerate(prompts):
            run.submit(i, p, config, pool)
        results = sorted(run.drain(), key=lambda r: r.index)
        return [r.tokens for r in results], graphs, run, prepared

    eager, _, _, _ = outputs(False)
    graphed, graphs, run, prepared = outputs(True)
    assert graphed == eager
    assert graphs.replays == run.stats.steps and run.target.eager_fallbacks == 0
    assert graphs.prepares >= 2  # the cache grew past 64 entries: every graph captured again
    assert 0 < run.stats.captures == graphs.captures - prepared  # the recaptures, counted in the steps
    assert max(run.stats.width_per_step) > 1  # trees were verified, not only single tokens


@pytest.mark.parametrize("backend_name", ["hf", "native"])
def test_batched_graph_logits_equal_eager_across_row_width_and_key_buckets(backend_name):
    # the same steps on two targets, one replaying graphs: the logits of every real input are
    # equal up to the summation order of the padded shapes, for random trees of ragged widths, rows of 3..280 committed tokens
    # (key buckets 256 and beyond) and 1..3 rows in flight (row buckets 1, 2, 3)
    from samctl.decode.engine.batched import BatchedTarget
    from samctl.decode.engine.native import use_backend

    model = tiny("llama", 2)
    use_backend(model, backend_name)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 96, n) for n in (3, 280, 40)]
    eager, graphed = BatchedTarget(model, 3, 320), BatchedTarget(model, 3, 320)
    for target in (eager, graphed):
        target.prefill([0, 1, 2], prompts, [False] * 3)
    graphs = batch_graphs_on(SimpleNamespace(target=graphed), StandIn(), 8)
    assert len(graphs.buckets) > 1
    bucket_steps(eager, graphed, rng, lambda got, want: torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5))
    assert graphs.replays == 6 and graphed.eager_fallbacks == 0


def bucket_steps(eager, graphed, rng: np.random.Generator, check, steps: int = 6) -> None:
    """The same verify steps on two batched targets of 3 rows: random trees of 0..8 nodes, 1..3
    rows in flight; `check(got, want)` compares each step's logits; a short path is kept after each."""
    device = graphed.device
    for step in range(steps):
        rows = 1 + step % 3
        trees = [random_tree(rng, int(rng.integers(0, 9))) for _ in range(rows)]
        inputs = [torch.from_numpy(np.concatenate(([rng.integers(0, 96)], t.tokens)).astype(np.int64)).to(device)
                  for t in trees]
        want, offsets = eager.verify(inputs, trees)
        got, got_offsets = graphed.verify(inputs, trees)
        assert np.array_equal(offsets, got_offsets)
        check(got, want)
        paths = [np.array([0] + ([1] if len(t) and t.parents[0] == -1 else []), dtype=np.int64) for t in trees]
        for target in (eager, graphed):
            target.keep(paths)


def test_the_cyclic_collector_is_held_during_captures_and_restored_after():
    # On a GPU, a collection in mid-capture that frees an old graph breaks the capture (seen on
    # an H100: the first capture of a test session failed while earlier targets' graphs were freed).
    backend = StandIn()
    target = TargetModel(tiny())
    target.prefill(torch.tensor(prompts(96)[0]), reserve=400)
    graphs_on(target, backend)
    generate(target, make_drafter("pld", vocab_size=96, device="cpu"), prompts(96)[0], GenerationConfig(max_new_tokens=8))
    assert backend.captured and not backend.collector_on
    assert gc.isenabled()


@pytest.mark.parametrize("method", ["sd", "ouroboros"])
def test_a_draft_models_batch_replays_graphs_and_drafts_as_eagerly(method):
    # the draft's own batch under graphs (`enable_row_graphs`): each drafting round's last-token
    # logits come from a replay; four rows forked from one draft (the batch grows: a recapture)
    # give the eager draft's outputs, token for token
    from samctl.decode.draft_model import DraftModel
    from samctl.decode.engine.graphs import enable_row_graphs
    from samctl.decode.loop import generate_batch
    from tests.test_decode_greedy import EAGER

    from tests.test_draft_model import near_draft

    # a draft that agrees with the target often, so what it drafts shows in what is accepted
    model = tiny("llama", 2)
    draft_model = near_draft(model)
    rng = np.random.default_rng(3)
    base = rng.integers(3, 96, 8).tolist()
    prompts = [base * 2, rng.integers(3, 96, 20).tolist(), base + base[:3], [5, 6, 7] * 4]
    config = GenerationConfig(max_new_tokens=24)

    def outputs(graphed: bool):
        draft = DraftModel(draft_model)
        if graphed:
            enable_row_graphs(draft.rows.target, backend=StandIn())
        make = lambda: make_drafter(method, vocab_size=96, device=torch.device("cpu"), config=EAGER,  # noqa: E731
                                    draft=draft.fork())
        results = generate_batch(model, make, prompts, config, 4, cost=np.full(64, 1.0))
        # greedy tokens are the target's whatever the draft proposes: its drafts show in the acceptance
        return [(r.tokens, r.metrics.drafted, r.metrics.accept_hist) for r in results], draft.rows.target

    eager, _ = outputs(False)
    graphed, rows = outputs(True)
    assert graphed == eager
    assert sum(sum(a * n for a, n in enumerate(hist)) for _, _, hist in eager) > 0  # drafts were accepted
    assert rows.graphs.replays > 0 and rows.graphs.prepares >= 2  # forks grew the batch: captured again
