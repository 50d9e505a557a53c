"""`samctl train NAME ARGS...`: hands the arguments to the trainer module's own command (an option per
field of its frozen settings), so that trainers stay importable alone."""
from __future__ import annotations

import importlib
from typing import Any

import click

TRAINERS = {"eagle": "samctl.train.eagle", "sdsat": "samctl.train.sdsat", "acc-head": "samctl.train.acc_head"}


@click.command("train", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": []})
@click.argument("trainer", required=False)
@click.pass_context
def train(ctx: click.Context, trainer: str | None, **_: Any) -> None:
    """Train an EAGLE head, an SDSAT fine-tune or a SpecDec++ acceptance head.

    \b
    samctl train eagle --model M --out head/ --prompts prompts.jsonl [--mixture data/]
    samctl train sdsat --model M --out tuned/ --data prompts.jsonl docs/
    samctl train acc-head --target M --draft D --out head/ --prompts prompts.jsonl
    samctl train NAME --help      # the trainer's own options
    """
    if trainer in (None, "--help", "-h"):
        click.echo(ctx.get_help())
        return
    if trainer not in TRAINERS:
        from samctl.index.errors import UserError

        raise UserError(f"no trainer {trainer!r}: choose one of {', '.join(TRAINERS)}")
    importlib.import_module(TRAINERS[trainer]).main(ctx.args)
