"""Command-line options made from the configuration dataclasses, each declared once.

A field with option metadata (`help`; `cli` where the flag is not `--field-name`) is an option:
SessionConfig's (samctl/config.py), SamplingConfig's and the drafters' settings (decode/configs.py),
and the trainers' settings. `flag` words a field as its flag at the CLI's error boundary.
"""
from __future__ import annotations

import dataclasses
import functools
import shlex
import sys
from typing import TYPE_CHECKING, Any, Callable

import click

from samctl.decode.methods import cli_fields, setting_default, setting_name, setting_names
from samctl.index.errors import ConfigError, UserError

if TYPE_CHECKING:
    from samctl.config import SessionConfig

# Upper bounds of the command line's own counts (the drafters' settings have theirs in
# decode/configs.py): far above any useful value, low enough that what they size fits in memory.
MAX_BATCH_SIZE = 4096
MAX_WORKERS = 4096


def check_count(flag: str, value: int | None, high: int | None = None, low: int | None = 1) -> None:
    """Refuse a count option outside [low, high] in one line (value None: not given; low None:
    the lower bound is checked elsewhere; high None: no upper bound)."""
    if value is None:
        return
    if low is not None and value < low:
        raise UserError(f"{flag} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise UserError(f"{flag} must be at most {high}, got {value}: pass a value up to {high}")


class FieldOption(click.Option):
    """An option made from a configuration field's metadata; `field` names it ("SessionConfig.model")."""

    def __init__(self, *args: Any, field: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.field = field


def _click_type(meta: dict[str, Any], default: Any) -> Any:
    if "choices" in meta:
        return click.Choice(meta["choices"])
    if "path" in meta:
        return click.Path(**meta["path"])
    if isinstance(default, tuple):
        return tuple(type(v) for v in default)
    return meta.get("type", str if default is None else type(default))


def cli(f: dataclasses.Field) -> str:
    return f.metadata.get("cli", "--" + f.name.replace("_", "-"))


def field_option(f: dataclasses.Field, key: str, owner: str, **changes: Any) -> Callable:
    """The option of a configuration field, from its metadata; a field without a default is required.
    `changes` are a command's own click arguments (`default=128`, `help=...`) or flags (`cli`)."""
    meta = f.metadata
    decls = changes.pop("cli", cli(f)).split()
    default = None if f.default is dataclasses.MISSING else f.default
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    kw: dict[str, Any] = {"help": meta.get("help"), "metavar": meta.get("metavar"), "required": required}
    if not required:  # click >= 8.3 takes an explicit default=None as a value given, and skips the required check
        kw["default"] = default
    if meta.get("negate"):  # --no-compile: the flag sets the field False
        kw.update(is_flag=True, default=False)
    elif isinstance(default, bool) and "/" not in decls[0]:
        kw.update(is_flag=True)
    elif "cpu_default" in meta:  # unset: the device decides (samctl.decode.methods.method_config)
        kw.update(type=type(default), default=None)
    elif meta.get("multiple") or meta.get("nargs"):  # a tuple field, its option repeatable
        kw.update(multiple=True, type=meta.get("type", str))
    elif not isinstance(default, bool):
        kw.update(type=_click_type(meta, changes.get("default", default)), show_default=default is not None)
    else:
        kw.update(show_default=True)
    kw.update(changes)
    return click.option(*decls, key, cls=FieldOption, field=f"{owner}.{f.name}", **kw)


def run_config_command(argv: list[str] | None, name: str, config_type: type, run: Callable[[Any], Any],
                       help: str) -> Any:
    """Run `argv` through a command with an option per field of the frozen `config_type`
    (`field_option`): `run` gets the configuration they make, and its result is returned (--help:
    0). A field with `nargs: "+"` also takes the values after its flag (`--data A B`, as argparse did)."""
    fields = dataclasses.fields(config_type)
    rest = [f.name for f in fields if f.metadata.get("nargs") == "+"]

    def callback(rest_values: tuple[str, ...] = (), **values: Any) -> Any:
        if rest:
            values[rest[0]] = tuple(values[rest[0]]) + rest_values
        return run(config_type(**values))

    for f in reversed(fields):
        callback = field_option(f, f.name, config_type.__name__)(callback)
    if rest:
        callback = click.argument("rest_values", nargs=-1, metavar="")(callback)
    command = click.command(name, help=help, context_settings={"max_content_width": 100})(callback)
    return command.main(argv, f"samctl train {name}", standalone_mode=False)


def command_line(*words: str) -> str:
    """The command a report records: `samctl WORDS...` and the options it ran with (none when it was
    called from Python rather than from the command line)."""
    ran = sys.argv[1 + len(words):] if sys.argv[1 : 1 + len(words)] == list(words) else []
    return shlex.join(["samctl", *words, *ran])


def config_fields() -> list[tuple[str, dataclasses.Field, str]]:
    """(option key, field, owner) of every configuration field with a command-line option, in
    --help order: SessionConfig's, with the drafters' settings and the sampling fields in place."""
    from samctl.config import SessionConfig
    from samctl.decode.configs import SamplingConfig

    out = []
    for f in dataclasses.fields(SessionConfig):
        if f.name == "settings":
            out += [(setting_name(g), g, section) for section, g in cli_fields()]
        elif f.name == "sampling":
            out += [(g.name, g, "sampling") for g in dataclasses.fields(SamplingConfig) if "cli" in g.metadata]
        elif "help" in f.metadata:
            out.append((f.name, f, "session"))
    return out


def config_option(key: str, **changes: Any) -> Callable:
    """One field's option (keyed as `config_fields()`), for a command without a SessionConfig."""
    return next(field_option(f, key, owner, **changes) for k, f, owner in config_fields() if k == key)


SAMPLING = ("temperature", "top_k", "top_p", "seed")
ENGINE = ("device", "dtype", "threads", "quantize", "prepack", "backend", "graphs")


def session_options(*, only: tuple[str, ...] | None = None, exclude: tuple[str, ...] = (), raw: tuple[str, ...] = (),
                    methods: tuple[str, ...] | None = None, **changes: Any) -> Callable[[Callable], Callable]:
    """The options of the configuration fields a command takes (all, or `only` these keys; drafter
    settings by `settings`, only those one of `methods` reads when given), less `exclude`, each
    changed as `changes[key]` says (a value: the command's default; a dict: click arguments). The
    command receives `config`, the SessionConfig of the parsed options, before its own; a key in
    `raw` goes to it as parsed instead."""
    from samctl.decode.methods import method

    def taken(key: str, f: dataclasses.Field, owner: str) -> bool:
        if owner in ("session", "sampling"):
            return only is None or key in only
        return ((only is None or "settings" in only)
                and (methods is None or any(method(m).reads(f"{owner}.{f.name}") for m in methods)))

    chosen = [(key, f, owner) for key, f, owner in config_fields() if taken(key, f, owner) and key not in exclude]

    def add(command: Callable) -> Callable:
        @functools.wraps(command)
        def run(**values: Any) -> Any:
            parsed = {key: values.pop(key) for key, _, _ in chosen if key not in raw}
            return command(session_config(parsed), **values)

        for key, f, owner in reversed(chosen):
            change = changes.get(key, {})
            change = change if isinstance(change, dict) else {"default": change}
            if "pair" in f.metadata:  # --bounds MIN MAX
                change = {"default": setting_default(owner, f), **change}
            run = field_option(f, key, owner, **change)(run)
        return run
    return add


def batch_size_option_with(more: str = ""):
    """--batch-size; `more` names the command's own options that hold it to 1 (only those it has)."""
    return click.option(
        "--batch-size", type=int, default=None,
        help="Records in flight at once on the batched engine, each output still exactly its own batch-1 output in "
             "float32 and with --quantize int8 [default: 8 on a CPU, 32 on a GPU; 1 for the methods without a "
             f"batched form (SDSAT's){more}].")


batch_size_option = batch_size_option_with(", --compare and --memory-file/--memory-save; with --ray, per worker")


def batch_size(config: "SessionConfig", asked: int | None, on_gpu: bool, *, compare: bool = False,
               memory_save: str | None = None, per_worker: bool = False) -> int:
    """--batch-size, or the default for the device; 1 (said once) where batching does not apply:
    the method has no batched form, or --compare / --memory-file / --memory-save is given."""
    from samctl.decode.loop import BATCH_ONE, batch_blocker

    check_count("--batch-size", asked, MAX_BATCH_SIZE)
    why = batch_blocker(config.method)
    blocked = (f"method {config.method} {BATCH_ONE} ({why})" if why else
               "--compare times records one at a time" if compare else
               "--memory-file/--memory-save keep one drafter's memory" if config.memory_file or memory_save else "")
    if blocked:
        if asked != 1 and not config.quiet:
            click.echo(f"samctl: note: {blocked}: batch size 1", err=True)
        return 1
    if asked is not None:
        return asked
    size = 32 if on_gpu else 8
    if not config.quiet:
        where = " per Ray worker" if per_worker else ""
        click.echo(f"samctl: up to {size} records in flight{where} on the batched engine (--batch-size to change)",
                   err=True)
    return size


def session_config(values: dict[str, Any]) -> "SessionConfig":
    """The SessionConfig of parsed field options, keyed as `config_fields()` (a field left out keeps
    its default); checks every setting that needs no model, before torch loads."""
    from samctl.config import SessionConfig
    from samctl.decode.configs import SamplingConfig

    values = dict(values)
    sampling = SamplingConfig(**{f.name: values.pop(f.name) for f in dataclasses.fields(SamplingConfig)
                                 if f.name in values})
    settings = {name: value for name in setting_names() if (value := values.pop(name, None)) is not None}
    if "graphs" in values:
        values["graphs"] = not values["graphs"]  # the flag is --no-compile
    return SessionConfig(**values, sampling=sampling, settings=settings,
                         occurrence=settings.get("occurrence", "first"))


def ignored_settings(settings: dict[str, Any], method_name: str) -> list[str]:
    """The drafter flags given a value other than their default that `method_name` never reads
    (`--method sam --max-nodes 3`), as the user typed them; `--occurrence` shapes the store, which
    every method that drafts from one reads."""
    from samctl.decode.methods import method

    entry = method(method_name)
    flags = []
    for section, f in cli_fields():
        if entry.reads(f"{section}.{f.name}") or (f.name == "occurrence" and entry.uses_store):
            continue
        value = settings.get(setting_name(f))
        value = tuple(value) if isinstance(value, list) else value
        unset = None if "cpu_default" in f.metadata else setting_default(section, f)
        if value is None or value == unset:
            continue
        names = f.metadata["cli"].split("/")
        flags.append(names[1] if isinstance(value, bool) and not value and len(names) > 1 else names[0])
    return flags


def flag(field: str) -> str:
    """The command-line flag of a configuration field or drafter setting (`eagle_head` ->
    `--eagle-head`, `store` -> `--sam`); a field without an option, its name as a flag."""
    for key, f, _ in config_fields():
        if key == field:
            return cli(f).split()[-1].split("/")[0]
    return {"fields": "--field"}.get(field, "--" + field.replace("_", "-"))


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
