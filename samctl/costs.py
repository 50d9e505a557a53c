"""Verify-cost curves on disk: measured once per model, device (and which CPU), dtype, thread count,
graph mode and version of the engine's code (`curve_key`), then cached, written atomically, in
`<cache>/costs/<key>.json` ($SAMCTL_CACHE or ~/.cache/samctl). `verify_cost(engine)` is what
`adaptive` and EAGLE size drafts by.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from samctl.decode.engine.cpu_linear import int8_kernels
from samctl.decode.engine.cost import VerifyCost, graph_widths, measurable_context, measure_verify_cost
from samctl.decode.engine.native import backend_name
from samctl.index.errors import UserError
from samctl.gguf_cache import cache_dir, write_text_atomically

log = logging.getLogger(__name__)

CURVE_WIDTH = 64
CONTEXT = 256  # committed entries before the measured verifies (measure_cost's default)
LONG_CONTEXT = 1024  # ... and the second curve's, from which VerifyCost prices longer contexts


@lru_cache(maxsize=1)
def engine_code() -> str:
    """A digest of decode/engine's source: the kernels a curve was measured with."""
    from samctl.decode import engine

    digest = hashlib.sha256()
    for path in sorted(Path(engine.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def cpu_name() -> str:
    """This CPU as /proc/cpuinfo names it (model name, family and model: "AMD EPYC" alone spans
    generations), else as the platform module does."""
    import platform

    try:
        fields = dict(map(str.strip, line.split(":", 1))
                      for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        fields = {}
    if "model name" in fields:
        return f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
    return platform.processor() or platform.machine()


def curve_width(engine: Any) -> int:
    """Tokens the curve covers: 64, or the widest CUDA graph (128) so that a 65-input draft is priced."""
    return max((CURVE_WIDTH, *graph_widths(engine.target)))


def curve_key(engine: Any) -> dict[str, Any]:
    """What a curve depends on. The CPU is named because a cache folder shared by machines, or a disk
    moved, must not lend one CPU's curve to another; the int8 kernels are those this CPU's instruction
    set, or the one ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and NUMBA_CPU_NAME allow, gives."""
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    linear = backend_name(engine.model)
    return {"model": str(Path(engine.name).resolve()) if Path(engine.name).exists() else engine.name,
            "config": hashlib.sha256(engine.model.config.to_json_string().encode()).hexdigest()[:16],
            "device": name, "cpu": cpu_name() if device.type == "cpu" else "",
            "dtype": str(engine.target.dtype).replace("torch.", ""),
            "linear": linear, "int8_kernels": int8_kernels()._asdict() if linear.endswith("int8") else {},
            "threads": torch.get_num_threads() if device.type == "cpu" else 0,
            "graphs": bool(graph_widths(engine.target)), "code": engine_code()}


def cost_curve(engine: Any, refresh: bool = False, context: int = CONTEXT) -> list[float]:
    """t_ms [curve_width]: the engine's verify time for 1..64 tokens (1..128 under CUDA graphs)
    after `context` committed entries, from the cache or measured now."""
    key, width = curve_key(engine), curve_width(engine)
    note = (f"measuring the verify cost of {Path(engine.name).name} on {key['device']} ({key['dtype']}, "
            f"{key['linear']} forward and linear layers{', CUDA graphs' if key['graphs'] else ''}), once per model and device")
    if context != CONTEXT:
        key, note = {**key, "context": context}, ""
    return _cached(key, lambda: measure_verify_cost(engine.target, width, context=context), note, width, refresh)


def verify_cost(engine: Any, refresh: bool = False) -> VerifyCost:
    """What `adaptive` and EAGLE size drafts by: the curves after CONTEXT and LONG_CONTEXT
    committed entries (cached apart), priced at each row's own context length."""
    long = measurable_context(engine.target.rows, LONG_CONTEXT, curve_width(engine))
    return VerifyCost.measured(cost_curve(engine, refresh), cost_curve(engine, refresh, long), (CONTEXT, long))


def batch_cost(engine: Any, rows: int, max_width: int, stop: Callable[[], bool] | None = None) -> VerifyCost:
    """What the batched budget prices a step by: a forward over 1.. total input tokens with `rows` rows
    in flight after CONTEXT entries a row (one curve for every context: VerifyCost says why), from the
    cache or measured now; `stop()` true stops a measurement between two forwards (nothing cached)."""
    from samctl.decode.engine.cost import measure_batch_cost

    note = (f"measuring the batched verify cost of {Path(engine.name).name} at {rows} rows, once per model, "
            "device and batch size")
    return VerifyCost.one_curve(_cached({**curve_key(engine), "batched_rows": rows, "max_width": max_width},
                                        lambda: measure_batch_cost(engine.model, rows, max_width, stop=stop), note))


def _cached(key: dict[str, Any], measure: Callable[[], Any], note: str, width: int | None = None,
            refresh: bool = False) -> list[float]:
    # The curve cached under `key` (of `width` points, when given), else measure() (said in `note`)
    # and cached; a damaged entry is measured again and replaced.
    path = cache_dir() / "costs" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")
    if path.is_file() and not refresh:
        try:
            record = json.loads(path.read_text())
            if record.get("key") == key and (width is None or len(record["t_ms"]) == width):
                return [float(t) for t in record["t_ms"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if note:
        log.info(note)
    t_ms = [float(t) for t in measure()]
    try:
        write_text_atomically(path, json.dumps({"key": key, "t_ms": t_ms}))
    except OSError as err:  # a read-only cache only costs a re-measure next time
        log.warning(f"note: cannot cache the cost curve in {path.parent} ({err.strerror})")
    return t_ms


def read_cost_curve(path: str | os.PathLike) -> list[float]:
    """A curve file written by `samctl calibrate --json` (or a cache entry): its t_ms list."""
    try:
        record = json.loads(Path(path).read_text())
        t_ms = [float(t) for t in record["t_ms"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path} is not a cost curve ({type(err).__name__}): write one with "
                        "`samctl calibrate --json > curve.json`") from err
    if len(t_ms) < 2 or not all(math.isfinite(t) and t > 0 for t in t_ms):
        raise UserError(f"{path}: a cost curve needs at least two positive finite times: re-run samctl calibrate")
    return t_ms
