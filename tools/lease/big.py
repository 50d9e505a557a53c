"""GPU lease, call 2: a random-weight Llama-3-8B-shaped model in bf16 (random weights cost what real
ones do; nothing to download).

    python3 tools/lease/big.py OUT.json            # on the GPU
    python3 tools/lease/big.py OUT.json --dry-run  # rehearsal on a CPU: a tiny shape, every step

In order, each result written to OUT.json as it lands: the device-to-device copy bandwidth and the
bandwidth floor (weight + KV bytes read per token / bandwidth); `ar` with CUDA graphs, eagerly, and
transformers' eager `generate` (tokens/s, host and forward ms per step); an oracle drafter whose
every draft is right (the engine's ceiling); the verify-cost curve t(n), n = 1..128, at a 2048-token
context for one row (graphs and eager) and for 8 rows (graphs, n = 8 x 1..16).
"""
import json
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from samctl.decode.drafters.base import NoDraft
from samctl.decode.drafters.oracle import OracleDrafter
from samctl.decode.engine.batched import BatchedTarget
from samctl.decode.engine.cost import measure_cost
from samctl.decode.engine.graphs import enable_batch_graphs, enable_cuda_graphs
from samctl.decode.engine.target import TargetModel, room
from samctl.decode.loop import GenerationConfig as GC, generate

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
        save("floor_tok_s", round(out["copy_GBps_read_plus_write"] / 2 * 1e9 / (weight_bytes + kv_bytes), 1))

    t = TargetModel(model)
    prompt = np.random.default_rng(0).integers(0, shape["vocab_size"], PROMPT).tolist()
    ref = None
    for graphs in (True, False):
        enable_cuda_graphs(t, graphs, reserve=PROMPT + NEW + 300)
        generate(t, NoDraft(), prompt, GC(max_new_tokens=16))
        m = generate(t, NoDraft(), prompt, GC(max_new_tokens=NEW))
        save(f"ar_graphs={graphs}", dict(tok_s=round(m.metrics.tokens_per_s, 1), **{
            k: m.metrics.to_dict()[k] for k in ("forward_ms_per_step", "host_ms_per_step", "eager_verifies")}))
        ref = np.asarray(m.tokens) if ref is None else ref
        if graphs and not np.array_equal(ref, m.tokens):
            save("ar_graphs_vs_eager", "DIFFERENT")
    ids = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
    sync()
    tic = time.perf_counter()
    hf = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    sync()
    save("hf_generate_eager_tok_s", round(NEW / (time.perf_counter() - tic), 1))
    save("hf_generate_equals_ar_graphs", bool(np.array_equal(hf[0, PROMPT:].cpu().numpy(), ref[:NEW])))

    enable_cuda_graphs(t, True, reserve=PROMPT + NEW + 300)
    for k in (3, 15, 63):  # every draft right: the engine's ceiling, to set against (k+1)/t(k+1)
        m = generate(t, OracleDrafter(ref, k), prompt, GC(max_new_tokens=NEW)).metrics
        save(f"oracle{k}", dict(tok_s=round(m.tokens_per_s, 1), mean_accepted=round(m.mean_accepted, 2),
                                eager_verifies=m.eager_verifies))

    for graphs in (True, False):
        enable_cuda_graphs(t, graphs, reserve=CONTEXT + 400)
        save(f"t_ms_1row@{CONTEXT},graphs={graphs}",
             [round(float(x), 3) for x in measure_cost(t.rows, 1, 128, context=CONTEXT)])
    del t
    rows = BatchedTarget(model, 8, room(CONTEXT, 16))
    enable_batch_graphs(rows, 16)
    save(f"t_ms_8rows@{CONTEXT},graphs=True", [round(float(x), 3) for x in measure_cost(rows, 8, 16, context=CONTEXT)])
    if device.type == "cuda":
        save("max_mem_GiB", round(torch.cuda.max_memory_allocated() / 2**30, 1))


if __name__ == "__main__":
    main(sys.argv[1], "--dry-run" in sys.argv)
