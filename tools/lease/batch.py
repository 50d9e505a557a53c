"""The batched engine on one model: 32 code-edit records (with their predictions) at batch sizes
1, 8 and 32, `ar` and `adaptive`, through samctl's Session (what `generate --input` runs).

    python3 tools/lease/batch.py MODEL RECORDS.jsonl DEVICE DTYPE NEW_TOKENS OUT.json [SIZES...]

Per (method, batch size): new tokens over the wall time of the whole batch (the session keeps one
BatchRun per batch size: the warm-up call at that size, on the two longest records, measures the
cost curve, captures the graphs and grows the cache, so the timed call replays; `captures` counts
any graph captured inside it), and over the steps' and prefills' own time (BatchStats:
`step_tok_s`); how many records' tokens equal the batch-1 run's.
"""
import json
import sys
import time

import torch

from samctl.config import SessionConfig
from samctl.decode.loop import BatchStats
from samctl.session import Session

model, records, device, dtype, new, path, *sizes = sys.argv[1:]
records = [json.loads(line) for line in open(records)]
prompts, predictions = [r["turns"][0] for r in records], [r.get("prediction") for r in records]
out = {}
for method in ("adaptive", "ar"):
    session = Session(SessionConfig(model=model, device=device, dtype=dtype, method=method, chat=True,
                                    max_new_tokens=int(new), quiet=True))
    first = None
    for size in map(int, sizes or (1, 8, 32)):
        # warm: cost curve, JIT, and the cache grown for the longest records (a growth recaptures every graph)
        longest = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))[:2]
        session.generate_batch([prompts[i] for i in longest], batch_size=size, predictions=[predictions[i] for i in longest])
        stats = BatchStats()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        tic = time.perf_counter()
        results = session.generate_batch(prompts, batch_size=size, predictions=predictions, stats=stats)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - tic
        tokens = [r.tokens for r in results]
        first = first or tokens
        s = stats.to_dict()
        out[f"{method}@{size}"] = row = dict(
            records=len(results), new_tokens=sum(map(len, tokens)), wall_s=round(wall, 3),
            tok_s=round(sum(map(len, tokens)) / wall, 1), equal_batch1=sum(a == b for a, b in zip(tokens, first)),
            errors=sum(r.finish_reason == "error" for r in results),
            step_tok_s=round(sum(map(len, tokens)) / (stats.forward_s + stats.host_s + stats.prefill_s), 1),
            **{k: s[k] for k in s if not isinstance(s[k], list) and k not in ("records", "new_tokens")})
        print(method, size, row, flush=True)
        json.dump(out, open(path, "w"), indent=1)
