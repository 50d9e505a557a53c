"""Command-line options shared by the commands that compare methods (`simulate`, `bench`).

`method_options` adds the drafters' settings as options, `method_config` turns the parsed values
into a `MethodConfig`, and `parse_methods` reads a comma-separated method list.
"""
from __future__ import annotations

from typing import Any, Callable

import click

import torch

from decode.drafters.pld import PldConfig
from decode.drafters.recycle import RecycleConfig
from decode.drafters.rest import RestConfig
from decode.drafters.sam import SamConfig
from decode.methods import MethodConfig
from index.errors import UserError

_SAM, _PLD, _REST, _RECYCLE = SamConfig(), PldConfig(), RestConfig(), RecycleConfig()
# On a CPU a verify of q tokens costs about q times a small fixed cost once q passes a handful
# (tools/bench_draft.py: 4.4 ms at 1 token, 10 ms at 16, 28 ms at 81 for the embedded model), so
# the GPU-sized 80-node Token Recycle tree costs more than it saves there.
CPU_RECYCLE_NODES = 16

_METHOD_OPTIONS = (
    click.option("--sam-threshold", type=int, default=_SAM.dyn_threshold, show_default=True,
                 help="SAM: dynamic-automaton match length that triggers a retrieval draft."),
    click.option("--static-bias", type=int, default=_SAM.static_bias, show_default=True,
                 help="SAM: extra match length the static store needs (it triggers at threshold + bias)."),
    click.option("--max-draft", type=int, default=_SAM.max_draft, show_default=True, help="SAM: longest retrieval draft."),
    click.option("--sam-alpha", type=float, default=_SAM.alpha, show_default=True,
                 help="SAM: draft length grows as alpha x match length, up to --max-draft."),
    click.option("--occurrence", type=click.Choice(["first", "latest"]), default=_SAM.occurrence, show_default=True,
                 help="SAM: which earlier occurrence retrieval drafts continue."),
    click.option("--pld-ngram", type=int, default=_PLD.max_ngram, show_default=True, help="Prompt lookup: longest n-gram matched."),
    click.option("--pld-tokens", type=int, default=_PLD.num_draft, show_default=True, help="Prompt lookup: draft tokens."),
    click.option("--recycle-nodes", type=int, default=None,
                 help="Token Recycle: draft tree size (default: 80 on a GPU; 16 on a CPU, where a verify "
                      "costs about linearly in its tokens)."),
    click.option("--rest-nodes", type=int, default=_REST.num_nodes, show_default=True, help="REST: draft tree size."),
    click.option("--rest-depth", type=int, default=_REST.max_depth, show_default=True, help="REST: deepest draft token."),
)


def method_options(command: Callable) -> Callable:
    for option in reversed(_METHOD_OPTIONS):
        command = option(command)
    return command


def method_config(opts: dict[str, Any], device: torch.device | None = None) -> MethodConfig:
    """The drafters' settings from parsed options; `device` sizes the defaults that depend on it."""
    nodes = opts["recycle_nodes"]
    if nodes is None:
        nodes = CPU_RECYCLE_NODES if device is not None and device.type == "cpu" else _RECYCLE.nodes
    return MethodConfig(
        sam=SamConfig(dyn_threshold=opts["sam_threshold"], static_bias=opts["static_bias"],
                      max_draft=opts["max_draft"], alpha=opts["sam_alpha"], occurrence=opts["occurrence"]),
        pld=PldConfig(max_ngram=opts["pld_ngram"], num_draft=opts["pld_tokens"]),
        recycle=RecycleConfig(nodes=nodes),
        rest=RestConfig(num_nodes=opts["rest_nodes"], max_depth=opts["rest_depth"]),
    )


def set_threads(threads: int | None) -> None:
    """--threads: torch's CPU threads; None leaves torch's choice."""
    if threads is None:
        return
    if threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def parse_methods(spec: str, known: tuple[str, ...]) -> list[str]:
    """'ar,pld,sam' -> ['ar', 'pld', 'sam'] in the given order, each known, none twice."""
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in methods if m not in known]
    if not methods or unknown:
        raise UserError(f"--methods {spec!r}: {'unknown method ' + unknown[0] if unknown else 'empty'}; "
                        f"choose from {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise UserError(f"--methods {spec!r} names a method twice: name each once")
    return methods
