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

    Measured once per model, device, dtype, thread count and graph mode (seconds), after 256 and
    after 1024 committed tokens (fewer where the model's context is shorter), then cached ($SAMCTL_CACHE or ~/.cache/samctl); a draft is
    priced at its request's own context length, between and beyond the two. On a CPU t(n) grows
    with n, and faster after a long context, so drafts stay narrow; on a GPU it is nearly flat, so
    drafts grow wide. On CUDA it is measured under CUDA graphs, as generate and bench run (a step
    function of the graph widths), unless --no-compile.

    \b
    samctl calibrate --model ./my-model
    samctl calibrate --model ./my-model --json > curve.json    # for simulate --cost-curve
    """
    from samctl.costs import curve_key, verify_cost
    from samctl.decode.engine.cost import relative_cost
    from samctl.session import Session

    # The curve is measured on the engine every command runs (CUDA graphs included), under ar.
    engine = Session(replace(config, method="ar")).engine
    cost = verify_cost(engine, refresh=refresh)
    t_ms = [float(t) for t in cost.short_ms]
    if as_json:  # t_ms after the first context: what simulate --cost-curve reads
        click.echo(json.dumps({"key": curve_key(engine), "contexts": list(cost.contexts),
                               "t_ms": [round(t, 4) for t in t_ms],
                               "t_ms_long": [round(float(t), 4) for t in cost.long_ms]}))
        return
    short, long = cost.contexts
    rel, rel_long = relative_cost(t_ms, len(t_ms)), relative_cost(cost.long_ms, len(t_ms))
    click.echo(f"verify cost of {engine.name} ({curve_key(engine)['device']}, {curve_key(engine)['dtype']})")
    click.echo(f"| tokens n | t(n) ms after {short} | t(n) / t(1) | t(n) ms after {long} | t(n) / t(1) |\n"
               "|---:|---:|---:|---:|---:|")
    for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)[: 12 if len(t_ms) <= 64 else 14]:
        click.echo(f"| {n} | {t_ms[n - 1]:.2f} | {rel[n - 1]:.2f} | "
                   f"{cost.long_ms[n - 1]:.2f} | {rel_long[n - 1]:.2f} |")
