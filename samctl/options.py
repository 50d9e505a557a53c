"""Command-line options shared by the commands that run or compare methods.

`method_options` adds the drafters' settings as options, `method_config` turns the parsed values
into a `MethodConfig`, `sampling_options` adds the sampling and device flags of every command that
generates, `weight_options` how a CPU model's linear layers run, and `parse_methods` reads a
comma-separated method list.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import click

import torch

from samctl.decode.methods import MethodConfig
from samctl.index.errors import UserError

# On a CPU a verify of q tokens costs about q times a small fixed cost once q passes a handful
# (tools/bench_draft.py: 4.4 ms at 1 token, 10 ms at 16, 28 ms at 81 for the embedded model), so
# the GPU-sized 80-node Token Recycle tree costs more than it saves there.
CPU_RECYCLE_NODES = 16


def _cli_fields() -> list[tuple[str, dataclasses.Field]]:
    """(config section, field) of every drafter setting that has a command-line option: the
    fields of MethodConfig's sections whose metadata names a `cli` flag."""
    out = []
    for section in dataclasses.fields(MethodConfig):
        for f in dataclasses.fields(section.default_factory):
            if "cli" in f.metadata:
                out.append((section.name, f))
    return out


def _dest(f: dataclasses.Field) -> str:
    """The parsed option's key: click's name for the (first) flag."""
    return f.metadata["cli"].split("/")[0].lstrip("-").replace("-", "_")


def setting_names() -> list[str]:
    """The parsed-option keys of every drafter setting (`max_nodes`, `sam_threshold`, ...), which
    `method_config` reads; the Python API takes them as keyword arguments."""
    return sorted(_dest(f) for _, f in _cli_fields())


def _option(f: dataclasses.Field) -> Callable:
    meta = f.metadata
    if isinstance(f.default, bool):
        return click.option(meta["cli"], _dest(f), default=f.default, show_default=True, help=meta["help"])
    if meta.get("device_default") or "cpu_default" in meta:
        return click.option(meta["cli"], _dest(f), type=type(f.default), default=None, help=meta["help"])
    kind = click.Choice(meta["choices"]) if "choices" in meta else type(f.default)
    return click.option(meta["cli"], _dest(f), type=kind, default=f.default, show_default=True, help=meta["help"])


def method_options(command: Callable) -> Callable:
    """Add every drafter setting that has a `cli` flag in its config's field metadata."""
    for _, f in reversed(_cli_fields()):
        command = _option(f)(command)
    return command


def sampling_options(command: Callable) -> Callable:
    """--temperature, --top-k, --top-p, --seed and --device, as `generate`, `chat` and `distill` take them."""
    for option in reversed((
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1.0 = off."),
        click.option("--seed", type=int, default=None, help="Sampling seed (default: random)."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
    )):
        command = option(command)
    return command


# Measured on SmolLM2-135M-Instruct (BENCHMARKS.md, "CPU int8 and prepacked weights").
QUANTIZE_HELP = (
    "CPU only. int8: int8 weights (a scale per output channel) times int8 activations (a scale per "
    "token) with integer sums, in every linear layer and the output head, and attention one token at "
    "a time, so each token's result is exact and independent of the others verified with it: every "
    "method's greedy output equals the int8 model's own plain greedy decoding, bit for bit. A different "
    "model from float32: on SmolLM2-135M (two runs, 9 and 3 prompts) it picks float32's greedy token at 92% "
    "and 99% of the first 128 positions, next-token loss +0.07% and +0.7%."
)


def weight_options(command: Callable) -> Callable:
    """--quantize and --prepack/--no-prepack: how a CPU model's linear layers run (decode/engine/cpu_linear.py)."""
    for option in reversed((
        click.option("--quantize", type=click.Choice(["none", "int8"]), default="none", show_default=True,
                     help=QUANTIZE_HELP),
        click.option("--prepack/--no-prepack", default=True, show_default=True,
                     help="CPU, float32: reorder the weights once at load for oneDNN, so verifying a few tokens "
                          "costs little more than one (results differ from unpacked weights in the last bits)."),
    )):
        command = option(command)
    return command


def method_config(opts: dict[str, Any], device: torch.device | None = None) -> MethodConfig:
    """The drafters' settings from parsed options; `device` sizes the defaults that depend on it
    (a device default left unset: the CPU value on a CPU, the config's own default elsewhere)."""
    sections: dict[str, dict[str, Any]] = {}
    for section, f in _cli_fields():
        value = opts.get(_dest(f))
        on_cpu = device is not None and device.type == "cpu"
        if value is None and f.metadata.get("device_default"):
            value = CPU_RECYCLE_NODES if on_cpu else f.default
        if value is None and "cpu_default" in f.metadata:  # a field's own CPU value (lookahead widths)
            value = f.metadata["cpu_default"] if on_cpu else f.default
        if value is not None:
            sections.setdefault(section, {})[f.name] = value
    base = MethodConfig()
    return dataclasses.replace(base, **{name: dataclasses.replace(getattr(base, name), **values)
                                        for name, values in sections.items()})


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
