"""`samctl calibrate`: measure (or show the cached) verify-cost curve of a model on this machine."""
from __future__ import annotations

import json
from dataclasses import replace

import click

from samctl.config import SessionConfig
from samctl.options import ENGINE, session_options


@click.command("calibrate")
@session_options(only=("model", "quiet") + ENGINE)
@click.option("--refresh", is_flag=True, help="Measure again even when a cached curve exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the curve as JSON (input for simulate --cost-curve).")
def calibrate(config: SessionConfig, refresh: bool, as_json: bool) -> None:
    """Verify cost t(n) for n = 1..64 input tokens: what `adaptive` sizes its drafts by.

    Measured once per model, device, dtype, thread count and graph mode (a second or two), then
    cached ($SAMCTL_CACHE or ~/.cache/samctl). On a CPU t(n) grows with n, so drafts stay narrow;
    on a GPU it is nearly flat, so drafts grow wide. On CUDA it is measured under CUDA graphs, as
    generate and bench run (a step function of the graph widths), unless --no-compile.

    \b
    samctl calibrate --model ./my-model
    samctl calibrate --model ./my-model --json > curve.json    # for simulate --cost-curve
    """
    from samctl.costs import cost_curve, curve_key
    from samctl.decode.engine.cost import relative_cost
    from samctl.session import Session

    # The curve is measured on the engine every command runs (CUDA graphs included), under ar.
    engine = Session(replace(config, method="ar")).engine
    t_ms = cost_curve(engine, refresh=refresh)
    if as_json:
        click.echo(json.dumps({"key": curve_key(engine), "t_ms": [round(t, 4) for t in t_ms]}))
        return
    rel = relative_cost(t_ms, len(t_ms))
    click.echo(f"verify cost of {engine.name} ({curve_key(engine)['device']}, {curve_key(engine)['dtype']})")
    click.echo("| tokens n | t(n) ms | t(n) / t(1) |\n|---:|---:|---:|")
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)[: 12 if len(t_ms) <= 64 else 14]:
        click.echo(f"| {n} | {t_ms[n - 1]:.2f} | {rel[n - 1]:.2f} |")
