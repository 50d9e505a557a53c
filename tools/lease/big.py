"""GPU lease, call 2: a random-weight Llama-3-8B-shaped model in bf16 (random weights cost what real
ones do; nothing to download).

    python3 tools/lease/big.py OUT.json            # on the GPU
    python3 tools/lease/big.py OUT.json --dry-run  # rehearsal on a CPU: a tiny shape, every step

In order, each result written to OUT.json as it lands: the device-to-device copy bandwidth and the
bandwidth floor (weight + KV bytes read per token / bandwidth: a copy's rate counts bytes read and
written, and reads alone run at about that rate); per backend (native, then hf): `ar` with CUDA
graphs (tokens/s, forward and host ms per step: under graphs the forward is the replay's launch and
the host part includes the accept step, which waits on the GPU at the step's one sync: the host's
own work is host - accept) and the verify-cost curve t(n), n = 1..128, at a 2048-token context;
`ar` eagerly and transformers' eager `generate`; t(n) for 8 rows (graphs, n = 8 x 1..16); the
kernels of one replay at 1 and at 8 rows (torch.profiler, the 12 longest), to tell where a step's
time goes against the floor. (An oracle drafter is no ceiling here: random bf16 weights give
near-tied logits, so a wider verify flips the argmax and the oracle's drafts fail.)
"""
import json
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from samctl.decode.drafters.base import NoDraft
from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.cost import measure_cost
from samctl.decode.engine.graphs import enable_batch_graphs, enable_cuda_graphs
from samctl.decode.engine.native import use_backend
from samctl.decode.engine.target import TargetModel, room
from samctl.decode.loop import GenerationConfig as GC, generate
from samctl.decode.tree import DraftTree

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
PROMPT, NEW, CONTEXT = 512, 256, 2048


def main(path: str, dry: bool) -> None:
    device = torch.device("cpu" if dry else "cuda")
    shape = TINY if dry else LLAMA3_8B
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict = {"shape": "tiny (dry run)" if dry else "llama3-8b", "dtype": "bfloat16", "device": str(device)}

    def save(key, value):
        out[key] = value
        print(key, value if not isinstance(value, list) else [value[n - 1] for n in (1, 2, 4, 8, 16, 32, 64, 128)
                                                                if n <= len(value)], flush=True)
        json.dump(out, open(path, "w"), indent=1)

    if device.type == "cuda":
        x = torch.empty(2**30, dtype=torch.uint8, device=device)  # 1 GiB
        y = torch.empty_like(x)
        y.copy_(x)
        sync()
        tic = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        sync()
        save("copy_GBps_read_plus_write", round(2 * 10 * x.numel() / (time.perf_counter() - tic) / 1e9, 1))
        save("gpu", torch.cuda.get_device_name())
        del x, y
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **shape)).eval()
    torch.set_default_dtype(torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layers, kv, head = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    kv_bytes = 2 * layers * kv * head * 2 * (PROMPT + NEW // 2)  # K and V, bf16, at the mean context
    save("weight_GB", round(weight_bytes / 1e9, 2))
    if "copy_GBps_read_plus_write" in out:  # a token reads every weight and the KV once
        save("floor_tok_s", round(out["copy_GBps_read_plus_write"] * 1e9 / (weight_bytes + kv_bytes), 1))

    prompt = np.random.default_rng(0).integers(0, shape["vocab_size"], PROMPT).tolist()
    for backend in ("native", "hf"):
        use_backend(model, backend)
        t = TargetModel(model)
        enable_cuda_graphs(t, True, reserve=PROMPT + NEW + 300)
        generate(t, NoDraft(), prompt, GC(max_new_tokens=16))
        m = generate(t, NoDraft(), prompt, GC(max_new_tokens=NEW)).metrics
        save(f"ar_graphs,{backend}", dict(tok_s=round(m.tokens_per_s, 1), **{
            k: m.to_dict()[k] for k in ("forward_ms_per_step", "host_ms_per_step", "accept_ms_per_step",
                                        "eager_verifies")}))
        enable_cuda_graphs(t, True, reserve=CONTEXT + 400)
        save(f"t_ms_1row@{CONTEXT},graphs,{backend}", [round(float(x), 3) for x in measure_cost(t.rows, 1, 128, context=CONTEXT)])
        if backend == "native":
            save("kernels_1row", kernels(t.rows, 1, device))
        del t
    use_backend(model, "native")
    t = TargetModel(model)
    enable_cuda_graphs(t, False)
    generate(t, NoDraft(), prompt, GC(max_new_tokens=8))
    m = generate(t, NoDraft(), prompt, GC(max_new_tokens=64)).metrics
    save("ar_eager,native", dict(tok_s=round(m.tokens_per_s, 1), forward_ms_per_step=m.to_dict()["forward_ms_per_step"]))
    del t
    ids = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    use_backend(model, "hf")
    model.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
    sync()
    tic = time.perf_counter()
    model.generate(ids, max_new_tokens=NEW // 4, min_new_tokens=NEW // 4, **kw)
    sync()
    save("hf_generate_eager_tok_s", round(NEW // 4 / (time.perf_counter() - tic), 1))
    use_backend(model, "native")
    rows = BatchedTarget(model, 8, room(CONTEXT, 16))
    enable_batch_graphs(rows, 16)
    save(f"t_ms_8rows@{CONTEXT},graphs,native", [round(float(x), 3) for x in measure_cost(rows, 8, 16, context=CONTEXT)])
    save("kernels_8rows", kernels(rows, 8, device))
    if device.type == "cuda":
        save("max_mem_GiB", round(torch.cuda.max_memory_allocated() / 2**30, 1))


def kernels(target: BatchedTarget, rows: int, device: torch.device) -> list:
    """The 12 longest kernels (name, total ms) of one verify of `rows` rows x 1 token at CONTEXT."""
    from torch.profiler import ProfilerActivity, profile

    target.reserve(room(CONTEXT, 16))
    target.prefill(list(range(rows)), [np.array([1], dtype=np.int64)] * rows, [False] * rows)
    target.lengths[:rows] = CONTEXT
    inputs = [torch.ones(1, dtype=torch.int64, device=device) for _ in range(rows)]
    trees = [DraftTree.chain(np.zeros(0, dtype=np.int64)) for _ in range(rows)]
    target.verify(inputs, trees)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        target.verify(inputs, trees)
        if device.type == "cuda":
            torch.cuda.synchronize()
    target.lengths[:] = 0
    attr = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr))[:12]
    return [(e.key[:80], round(getattr(e, attr) / 1e3, 3), e.count) for e in events]


if __name__ == "__main__":
    main(sys.argv[1], "--dry-run" in sys.argv)
