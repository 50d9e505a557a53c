"""`samctl calibrate`: measure (or show the cached) verify-cost curve of a model on this machine."""
from __future__ import annotations

import json
from typing import Any

import click

from samctl.decode.engine.cost import relative_cost
from samctl.costs import cost_curve, curve_key
from samctl.options import set_threads, weight_options
from samctl.runtime import load_engine


@click.command("calibrate")
@click.option("--model", "model_path", metavar="PATH", help="Local model folder (default: the embedded model).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True)
@weight_options
@click.option("--threads", type=int, default=None, help="torch CPU threads (the curve is kept per thread count).")
@click.option("--refresh", is_flag=True, help="Measure again even when a cached curve exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the curve as JSON (input for simulate --cost-curve).")
@click.option("--quiet", is_flag=True, help="No notes on stderr.")
def calibrate(**opts: Any) -> None:
    """Verify cost t(n) for n = 1..64 input tokens: what `adaptive` sizes its drafts by.

    Measured once per model, device, dtype and thread count (a second or two), then cached
    ($SAMCTL_CACHE or ~/.cache/samctl). On a CPU t(n) grows with n, so drafts stay narrow; on a
    GPU it is nearly flat, so drafts grow wide.

    \b
    samctl calibrate --model ./my-model
    samctl calibrate --model ./my-model --json > curve.json    # for simulate --cost-curve
    """
    set_threads(opts["threads"])
    engine = load_engine(opts["model_path"], opts["device"], opts["dtype"], quiet=opts["quiet"],
                         quantize=opts["quantize"], prepack=opts["prepack"])
    t_ms = cost_curve(engine, quiet=opts["quiet"], refresh=opts["refresh"])
    if opts["as_json"]:
        click.echo(json.dumps({"key": curve_key(engine), "t_ms": [round(t, 4) for t in t_ms]}))
        return
    rel = relative_cost(t_ms, len(t_ms))
    click.echo(f"verify cost of {engine.name} ({curve_key(engine)['device']}, {curve_key(engine)['dtype']})")
    click.echo("| tokens n | t(n) ms | t(n) / t(1) |\n|---:|---:|---:|")
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        click.echo(f"| {n} | {t_ms[n - 1]:.2f} | {rel[n - 1]:.2f} |")
