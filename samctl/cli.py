"""The `samctl` command group and the single boundary where errors become one-line messages.

Commands load on first use (samctl/commands). A `UserError` or a usage error prints `samctl: error:
<message>` and exits 2 (a `ConfigError`'s fields worded as flags; SAMCTL_DEBUG=1: the traceback); a
closed standard output (`samctl ... | head`) exits 0. The `samctl` logger's notes print here, once
each, as `samctl: <note>` on stderr; a command's `--quiet` keeps warnings only.
"""
from __future__ import annotations

import logging
import os
import sys

import click

from samctl.index.errors import UserError, Worded
from samctl import __version__


class _PipeClosed(Exception):
    """Standard output's reader went away (`samctl ... | head`). Not an OSError, so that click's
    own handler, which would exit 1, lets it through to `main`."""


class _Notes(logging.Handler):
    """The `samctl` logger's records, one line each on stderr as it is when said (click.echo)."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if isinstance(record.msg, Worded):  # the settings it names, as flags
            from samctl.options import flag

            text = record.msg.render(flag)
        click.echo(f"samctl: {text}", err=True)


_NOTES = _Notes()


def _heard(callback):
    """A command's callback that first sets which notes it shows: warnings only with --quiet."""
    def run(*args, **kwargs):
        _NOTES.setLevel(logging.WARNING if kwargs.get("quiet") else logging.INFO)
        return callback(*args, **kwargs)
    run.heard = True
    return run


class _LazyGroup(click.Group):
    """Imports a command's module only when that command is asked for."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError as err:
            raise _PipeClosed() from err

    def list_commands(self, ctx: click.Context) -> list[str]:
        from samctl.commands import COMMANDS

        return [name for name, _ in COMMANDS]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        from samctl.commands import load_command

        command = load_command(name)
        if command is not None and not getattr(command.callback, "heard", False):
            command.callback = _heard(command.callback)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from samctl.commands import COMMANDS

        limit = formatter.width - 6 - max(len(name) for name, _ in COMMANDS)
        rows = [(name, click.utils.make_default_short_help(text, limit)) for name, text in COMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="samctl")
def cli() -> None:
    """Faster LLM generation when the output overlaps text the model can see.

    Build a datastore from corpora, then generate with lossless speculative decoding
    (greedy output is identical to plain decoding; sampling keeps the model's distribution).
    """
    notes = logging.getLogger("samctl")
    if _NOTES not in notes.handlers:  # the library's notes are printed here only, once each
        notes.addHandler(_NOTES)
        notes.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="samctl", standalone_mode=False)
    except UserError as err:
        if os.environ.get("SAMCTL_DEBUG") == "1":
            raise
        from samctl.options import cli_message

        click.echo(f"samctl: error: {cli_message(err)}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("samctl: aborted", err=True)
        sys.exit(130)
    except click.UsageError as err:
        command = err.ctx.command_path if err.ctx is not None else "samctl"
        click.echo(f"samctl: error: {err.format_message()} (see {command} --help)", err=True)
        sys.exit(err.exit_code)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except _PipeClosed:
        # Downstream of a pipe closed early (`samctl ... | head`): not an error. Standard output
        # now points at /dev/null, so that flushing it at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
