"""GPU.md section 3, call 1: probes of the CUDA paths, one JSON line per case.

    python3 tools/lease/probe.py [widths logits syncs eagle sdpa rope ...]   (all when none named)

widths: graph steps / steps and captured (width, key bucket) pairs per method (B2); logits: graphs
against eager on random trees with compaction, fp32 and bf16 (T1); syncs: host syncs against steps,
greedy and sampled, graphs off and on (B7); eagle: captures per alternating eagle/ar run (B1);
sdpa: the attention kernels of a bf16 tree verify, folded or not (B3, B9); rope: dynamic RoPE under
graphs (B6). Random-weight tiny models only: nothing to download.
"""
import json
import sys
import traceback
import warnings

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from samctl.decode.eagle_head import EagleHead
from samctl.decode.engine.graphs import enable_cuda_graphs
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, generate
from samctl.decode.methods import make_drafter
from samctl.decode.sampling import SamplingConfig as SC
from samctl.decode.tree import DraftTree
from tests.test_decode_greedy import prompts
from tests.test_engine import tiny

CUDA = torch.device("cuda")
WIDE = ("ar", "pld", "recycle", "adaptive", "lookahead", "rest")


def drafter(name, **kw):
    return make_drafter(name, vocab_size=96, device=CUDA, **kw)


def gen(t, d, n=40, s=SC()):
    return generate(t, d, prompts(96)[0], GenerationConfig(max_new_tokens=n, sampling=s))


def widths():  # B2: every step on a graph
    from samctl.index.automaton import SuffixAutomaton

    corpus = np.asarray(prompts(96)[0] * 4, dtype=np.int32)
    static = SuffixAutomaton.build(corpus, np.array([0, len(corpus)]))
    for name in WIDE:
        t = TargetModel(tiny().cuda())
        enable_cuda_graphs(t, reserve=512)
        replays = t.graphs.replays
        r = gen(t, drafter(name, static=static if name in ("adaptive", "rest") else None, cost=np.ones(257)))
        yield name, dict(steps=r.metrics.steps, graph_steps=t.graphs.replays - replays,
                         eager_verifies=r.metrics.eager_verifies, captures=t.graphs.captures,
                         buckets=list(t.graphs.buckets))


def logits():  # T1 sketch: graphs vs eager on random trees, with compaction
    for dtype in (torch.float32, torch.bfloat16):
        m = tiny().to(CUDA, dtype)
        a, b = TargetModel(m), TargetModel(m)
        enable_cuda_graphs(b, reserve=700)
        rng = np.random.default_rng(0)
        p = torch.from_numpy(rng.integers(0, 96, 40)).to(CUDA)
        a.prefill(p, reserve=600)
        b.prefill(p, reserve=600)
        worst = 0.0
        for _ in range(40):
            k = int(rng.integers(0, 128))
            par = np.array([rng.integers(-1, i) for i in range(k)], np.int32)
            tree, t0 = DraftTree(tokens=rng.integers(0, 96, k), parents=par), int(rng.integers(0, 96))
            la, lb = [x.verify(x.verify_input(t0, tree), tree).float() for x in (a, b)]
            worst = max(worst, ((la - lb).abs().max() / la.abs().max()).item())
            node, path = int(rng.integers(-1, k)) if k else -1, []
            while node >= 0:
                path, node = path + [node + 1], int(par[node])
            for x in (a, b):
                x.keep(np.array([0] + path[::-1], np.int64))
        yield str(dtype), dict(max_rel_diff=worst, replays=b.graphs.replays, eager=b.eager_fallbacks)


def syncs():  # B7: compare with steps (+1 for the prefill)
    for name in WIDE[:5]:
        for graphs in (False, True):
            for s in (SC(), SC(0.8, seed=0)):
                t = TargetModel(tiny().cuda())
                enable_cuda_graphs(t, graphs, reserve=256)
                gen(t, drafter(name), 8, s)
                d = drafter(name)
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    r = gen(t, d, 40, s)
                torch.cuda.set_sync_debug_mode("default")
                yield f"{name}/graphs={graphs}/T={s.temperature}", dict(
                    syncs=sum("ynchroniz" in str(x.message) for x in w), steps=r.metrics.steps)


def eagle():  # B1: no capture after enable_cuda_graphs
    m = tiny().cuda()
    t = TargetModel(m)
    enable_cuda_graphs(t, reserve=256)
    head = EagleHead(m).to(CUDA).eval()
    for name in ("eagle", "ar", "eagle", "ar", "eagle"):
        before = t.graphs.captures
        gen(t, drafter(name, eagle=head if name == "eagle" else None))
        yield name, dict(captures=t.graphs.captures - before)


def sdpa():  # attention kernels of a bf16 tree verify (capacity 1024 + slack, aligned), folded and not
    from torch.profiler import ProfilerActivity, profile

    cfg = LlamaConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3)
    for fold in (False, True):
        t = TargetModel(LlamaForCausalLM(cfg).to(CUDA, torch.bfloat16).eval(), fold_groups=fold)
        t.prefill(torch.arange(3, 50, device=CUDA), reserve=1001)
        tree = DraftTree(tokens=np.arange(8), parents=np.array([-1, 0, 0, 1, 1, 2, 2, 3], np.int32))
        t.verify(t.verify_input(1, tree), tree)
        t.keep(np.zeros(1, np.int64))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t.verify(t.verify_input(1, tree), tree)
            torch.cuda.synchronize()
        yield f"bf16 tree verify fold={fold}", dict(capacity=t.cache.capacity,
                                                     kernels=sorted({e.key[:90] for e in prof.key_averages()}))


def rope():  # B6: capture or fall back, never crash
    t = TargetModel(tiny(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)).cuda())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        enable_cuda_graphs(t, reserve=256)
    try:
        r = gen(t, drafter("pld"))
        yield "dynamic", dict(ok=True, steps=r.metrics.steps, eager_verifies=r.metrics.eager_verifies,
                              failed=t.graphs.failed, notes=[str(x.message)[:200] for x in w])
    except Exception as e:  # noqa: BLE001 - the probe reports it
        yield "dynamic", dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")


CHECKS = dict(widths=widths, logits=logits, syncs=syncs, eagle=eagle, sdpa=sdpa, rope=rope)
for check in sys.argv[1:] or CHECKS:
    try:
        for case, value in CHECKS[check]():
            print(json.dumps({"check": check, "case": case, **value}), flush=True)
    except Exception:  # noqa: BLE001 - one failing probe must not hide the others
        print(json.dumps({"check": check, "error": traceback.format_exc()[-800:]}), flush=True)
