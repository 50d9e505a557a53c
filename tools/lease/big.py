"""GPU.md section 3, call 2: random bf16 weights shaped like SmolLM2-135M and Llama-3-8B.

    python3 tools/lease/big.py OUT.json

Per shape: verify-cost curves t(n), eager and CUDA graphs, at contexts 256 and 2048, with grouped
heads folded (the CUDA default) and not (B3: `repeat_kv`), and at context 256 in a cache of 8192
(B3: key-length buckets keep a long capacity from slowing short contexts); ar tokens/s with graphs,
eagerly and with HF `generate`; an oracle drafter whose every draft is right, at k = 3, 15, 63, 127
(the engine's ceiling, against (k+1)/t(k+1)); peak memory. No weights to download.
"""
import json
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from samctl.decode.drafters.base import NoDraft
from samctl.decode.drafters.oracle import OracleDrafter
from samctl.decode.engine.cost import measure_verify_cost
from samctl.decode.engine.graphs import enable_cuda_graphs
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig as GC, generate

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
NEW, NS = 256, (1, 2, 4, 8, 16, 32, 33, 48, 64, 65, 128)


def curve(t: TargetModel, graphs: bool, ctx: int, reserve: int | None = None) -> list[float]:
    enable_cuda_graphs(t, graphs, reserve=reserve or ctx + 512)
    return [round(x, 3) for x in measure_verify_cost(t, 128 if graphs else 64, context=ctx)]


def main(path: str) -> None:
    out = {}
    for name, shape in SHAPES.items():
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **shape)).eval()
        torch.set_default_dtype(torch.float32)
        r = {}
        t = TargetModel(model, fold_groups=False)
        for ctx in (256, 2048):
            r[f"graphs@{ctx},nofold"], r[f"eager@{ctx},nofold"] = curve(t, True, ctx), curve(t, False, ctx)
        t = TargetModel(model)  # folds grouped heads (the CUDA default)
        for ctx in (256, 2048):
            r[f"graphs@{ctx}"], r[f"eager@{ctx}"] = curve(t, True, ctx), curve(t, False, ctx)
        r["graphs@256,cap8192"] = curve(t, True, 256, reserve=8192)
        prompt = np.random.default_rng(0).integers(0, shape["vocab_size"], 512).tolist()
        ref = None
        for graphs in (True, False):
            enable_cuda_graphs(t, graphs, reserve=1024)
            generate(t, NoDraft(), prompt, GC(max_new_tokens=32))
            res = generate(t, NoDraft(), prompt, GC(max_new_tokens=NEW))
            r[f"ar_graphs={graphs}"] = round(res.metrics.tokens_per_s, 1)
            ref = np.asarray(res.tokens) if graphs else ref
        ids = torch.tensor([prompt], device="cuda")
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        model.generate(ids, max_new_tokens=16, **kw)
        torch.cuda.synchronize()
        tic = time.perf_counter()
        model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, **kw)
        torch.cuda.synchronize()
        r["hf_generate_eager"] = round(NEW / (time.perf_counter() - tic), 1)
        enable_cuda_graphs(t, True, reserve=1024)
        for k in (3, 15, 63, 127):  # every draft right: the engine's ceiling against (k+1)/t(k+1)
            m = generate(t, OracleDrafter(ref, k), prompt, GC(max_new_tokens=NEW)).metrics
            r[f"oracle{k}"] = (round(m.tokens_per_s, 1), round(m.mean_accepted, 2), m.eager_verifies)
        r["captures"] = t.graphs.captures
        r["max_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        out[name] = r
        print(name, {k: v for k, v in r.items() if not isinstance(v, list)},
              *(f"\n  {k:24s} {[v[n - 1] for n in NS if n <= len(v)]}" for k, v in r.items() if isinstance(v, list)),
              flush=True)
        del model, t
        torch.cuda.empty_cache()
        json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
