"""Command-line options shared by the commands that run or compare methods.

`method_options` adds the drafters' settings as options (their Python names and `method_config`,
which turns them into a `MethodConfig`, are decode/methods.py's), `sampling_options` adds the
sampling and device flags of every command that generates, `engine_options` the device-side ones
(`weight_options`: how a CPU model's linear layers run), `session_config` turns a command's
parsed options into the `SessionConfig` every command runs on, and `parse_methods` reads a
comma-separated method list.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import click

from samctl.decode.methods import DEFAULT_METHOD, cli_fields, setting_name, setting_names
from samctl.index.errors import ConfigError, UserError

if TYPE_CHECKING:
    from samctl.config import SessionConfig

# Upper bounds of the command line's own counts (the drafters' settings have theirs in
# decode/configs.py): far above any useful value, low enough that what they size fits in memory.
MAX_BATCH_SIZE = 4096
MAX_WORKERS = 4096


def check_count(flag: str, value: int | None, high: int, low: int | None = 1) -> None:
    """Refuse a count option outside [low, high] in one line (value None: not given; low None:
    the lower bound is checked elsewhere)."""
    if value is None:
        return
    if low is not None and value < low:
        raise UserError(f"{flag} must be >= {low}, got {value}")
    if value > high:
        raise UserError(f"{flag} must be at most {high}, got {value}: pass a value up to {high}")


def _option(f: dataclasses.Field) -> Callable:
    meta = f.metadata
    if isinstance(f.default, bool):
        return click.option(meta["cli"], setting_name(f), default=f.default, show_default=True, help=meta["help"])
    if meta.get("device_default") or "cpu_default" in meta:
        return click.option(meta["cli"], setting_name(f), type=type(f.default), default=None, help=meta["help"])
    kind = click.Choice(meta["choices"]) if "choices" in meta else type(f.default)
    return click.option(meta["cli"], setting_name(f), type=kind, default=f.default, show_default=True, help=meta["help"])


def method_options(command: Callable) -> Callable:
    """Add every drafter setting that has a `cli` flag in its config's field metadata."""
    for _, f in reversed(cli_fields()):
        command = _option(f)(command)
    return command


def _options(*options: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """One decorator for several options (or groups of them), listed by --help in the order given."""
    def add(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command
    return add


# --temperature, --top-k, --top-p, --seed and --device, as `generate`, `chat` and `distill` take them
sampling_options = _options(
    click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
    click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
    click.option("--top-p", type=float, default=1.0, show_default=True, help="1.0 = off."),
    click.option("--seed", type=int, default=None, help="Sampling seed (default: random)."),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
)


# Measured on SmolLM2-135M-Instruct (BENCHMARKS.md, "CPU int8 and prepacked weights").
QUANTIZE_HELP = (
    "CPU only. int8: int8 weights (a scale per output channel) times int8 activations (a scale per "
    "token) with integer sums, in every linear layer and the output head, and attention one token at "
    "a time, so each token's result is exact and independent of the others verified with it: every "
    "method's greedy output equals the int8 model's own plain greedy decoding, bit for bit, at batch "
    "size 1 and batched. A different "
    "model from float32: on SmolLM2-135M (two runs, 9 and 3 prompts) it picks float32's greedy token at 92% "
    "and 99% of the first 128 positions, next-token loss +0.07% and +0.7%. Weights take half of "
    "float32's memory (held twice in int8: one copy for one-token steps, one for verifies). On x86 "
    "CPUs without VNNI (AVX512-VNNI or AVX-VNNI), whose int8 instructions saturate, a probe at load "
    "makes each token's activations run as two 7-bit halves whose sums are added: the same model, "
    "exact there too."
)


# --quantize and --prepack/--no-prepack: how a CPU model's linear layers run (decode/engine/cpu_linear.py)
weight_options = _options(
    click.option("--quantize", type=click.Choice(["none", "int8"]), default="none", show_default=True,
                 help=QUANTIZE_HELP),
    click.option("--backend", type=click.Choice(["auto", "hf", "native"]), default="auto", show_default=True,
                 help="How the model's forward runs. native: samctl's own forward for Llama, Mistral, Qwen2 and "
                      "Qwen3 models (fused projections, one RoPE table, few ops per layer: much less Python per "
                      "step); hf: transformers' modules (any causal LM). auto: native where the architecture "
                      "is supported. The backend that ran is recorded in every output."),
    click.option("--prepack/--no-prepack", default=True, show_default=True,
                 help="CPU, float32: reorder the weights once at load for oneDNN, so verifying a few tokens "
                      "costs little more than one (results differ from unpacked weights in the last bits)."),
)


# --dtype, --threads, --no-compile and the weight options, as every command that loads a model takes them
engine_options = _options(
    click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
                 show_default=True, help="auto: float32 on CPU; on GPU the model's saved dtype (float32 models run "
                 "in bfloat16). Greedy output equals plain greedy decoding token for token in float32; in half "
                 "precision the distribution is the model's and greedy can differ at near-ties."),
    click.option("--threads", type=int, default=None,
                 help="torch CPU threads (default: torch's choice); 1 is steadier on a busy machine."),
    click.option("--no-compile", is_flag=True, help="CUDA: run the verify forward eagerly instead of as CUDA "
                 "graphs at fixed widths (the CPU never compiles)."),
    weight_options,
)


# The settings of the methods that draft with a second model or a head, declared once
draft_options = _options(
    click.option("--draft-model", "draft_path", metavar="PATH", help="sd, specdec++, sam+draft, ouroboros: a "
                 "small model sharing the target's tokenizer (default: the embedded draft, with the embedded target only)."),
    click.option("--gamma", type=int, default=4, show_default=True, help="sd, sam+draft, ouroboros: draft tokens per step."),
    click.option("--acc-head", "acc_head_path", metavar="PATH", help="specdec++: acceptance head folder for this "
                 "target and draft (default: the embedded one, with the embedded pair only)."),
    click.option("--stop-threshold", type=float, default=0.3, show_default=True, help="specdec++: stop drafting "
                 "once the predicted P(some draft token is rejected) exceeds this."),
    click.option("--bounds", type=(int, int), default=(2, 20), show_default=True, metavar="MIN MAX",
                 help="specdec++: inclusive bounds on the draft length."),
    click.option("--eagle-head", "eagle_path", metavar="PATH", help="eagle, sam+eagle, adaptive+eagle: EAGLE head "
                 "folder for this model (default: the embedded one, with the embedded target only)."),
)
# Every option a SessionConfig reads, as the commands that run a session take them
session_options = _options(sampling_options, engine_options, method_options, draft_options)


batch_size_option = click.option(
    "--batch-size", type=int, default=None,
    help="Records in flight at once on the batched engine, each output still exactly its own batch-1 output in "
         "float32 and with --quantize int8 [default: 8 on a CPU, 32 on a GPU; 1 for the methods without a batched form "
         "(SDSAT's) and --compare; with --ray, per worker].")


def batch_size(opts: dict[str, Any], method: str, on_gpu: bool) -> int:
    """--batch-size, or the default for the device; 1 (said once) where batching does not apply:
    the method has no batched form, or --compare / --memory-file / --memory-save is given."""
    from samctl.decode.loop import BATCH_ONE, batch_blocker

    asked = opts.get("batch_size")
    check_count("--batch-size", asked, MAX_BATCH_SIZE)
    why = batch_blocker(method)
    blocked = (f"method {method} {BATCH_ONE} ({why})" if why else
               "--compare times records one at a time" if opts.get("compare") else
               "--memory-file/--memory-save keep one drafter's memory" if opts.get("memory_file") or opts.get("memory_save")
               else "")
    if blocked:
        if asked is not None and asked > 1 and not opts.get("quiet"):
            click.echo(f"samctl: note: {blocked}: batch size 1", err=True)
        return 1
    if asked is not None:
        return asked
    size = 32 if on_gpu else 8
    if not opts.get("quiet"):
        where = " per Ray worker" if opts.get("ray_address") is not None else ""
        click.echo(f"samctl: up to {size} records in flight{where} on the batched engine (--batch-size to change)",
                   err=True)
    return size


def session_config(opts: dict[str, Any], **changes: Any) -> "SessionConfig":
    """The SessionConfig of a command's parsed options (an option a command lacks keeps its default)."""
    from samctl.config import DRAFT_SETTINGS, SessionConfig
    from samctl.decode.configs import SamplingConfig

    settings = {name: opts[name] for name in (*setting_names(), *DRAFT_SETTINGS) if opts.get(name) is not None}
    sampling = SamplingConfig(opts.get("temperature", 0.0), opts.get("top_k", 0), opts.get("top_p", 1.0),
                              opts.get("seed"))
    config = SessionConfig(
        model=opts.get("model_path"), device=opts.get("device", "auto"), dtype=opts.get("dtype", "auto"),
        threads=opts.get("threads"), graphs=not opts.get("no_compile", False), store=opts.get("store_path"),
        occurrence=opts.get("occurrence", "first"), method=opts.get("method", DEFAULT_METHOD), settings=settings,
        draft_model=opts.get("draft_path"), acc_head=opts.get("acc_head_path"), eagle_head=opts.get("eagle_path"),
        max_new_tokens=opts.get("max_new_tokens", 256), sampling=sampling, chat=opts.get("chat", False),
        memory_file=opts.get("memory_file"), quiet=opts.get("quiet", False),
        quantize=opts.get("quantize", "none"), prepack=opts.get("prepack", True),
        backend=opts.get("backend", "auto"))
    return dataclasses.replace(config, **changes) if changes else config


def ignored_settings(opts: dict[str, Any], method_name: str) -> list[str]:
    """The drafter flags given a value other than their default that `method_name` never reads
    (`--method sam --max-nodes 3`), as the user typed them; `--occurrence` shapes the store, which
    every method that drafts from one reads."""
    from samctl.decode.configs import DraftConfig, SpecDecConfig
    from samctl.decode.methods import method

    entry = method(method_name)
    flags = []
    for section, f in cli_fields():
        if entry.reads(f"{section}.{f.name}") or (f.name == "occurrence" and entry.uses_store):
            continue
        value = opts.get(setting_name(f))
        unset = None if f.metadata.get("device_default") or "cpu_default" in f.metadata else f.default
        if value is None or value == unset:
            continue
        names = f.metadata["cli"].split("/")
        flags.append(names[1] if isinstance(value, bool) and not value and len(names) > 1 else names[0])
    defaults = {"gamma": DraftConfig.gamma, "stop_threshold": SpecDecConfig.stop_threshold,
                "bounds": (SpecDecConfig.min_draft, SpecDecConfig.max_draft)}
    for name, default in defaults.items():
        value = opts.get(name)
        value = tuple(value) if isinstance(value, (list, tuple)) else value
        if value is not None and value != default and not entry.reads(name):
            flags.append(flag(name))
    return flags


# Configuration fields whose flag is not "--" and the field's name with dashes.
_FLAGS = {"store": "--sam", "graphs": "--no-compile", "fields": "--field"}


def flag(field: str) -> str:
    """The command-line flag of a configuration field: a drafter setting's own `cli` flag, else
    the field's name as a flag (`eagle_head` -> `--eagle-head`)."""
    for _, f in cli_fields():
        if setting_name(f) == field:
            return f.metadata["cli"].split("/")[0]
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def cli_message(err: UserError) -> str:
    """An error as the command line says it: the settings a ConfigError names, worded as flags."""
    return err.render(flag) if isinstance(err, ConfigError) else str(err)


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
