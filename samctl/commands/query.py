"""`samctl query`: the longest suffix of a text (or id list) found in a store, and what follows it.

With `--ids` the text columns are filled in only when the store's tokenizer loads without
transformers (the `tokenizers` library reads a tokenizer.json in a fraction of a second), and are
left null otherwise, with a note, rather than spend seconds importing torch on every query.
"""
from __future__ import annotations

import json
from typing import Any

import click
import numpy as np

from samctl.index.datastore import Datastore
from samctl.index.load import load_datastore
from samctl.index.errors import UserError
from samctl.tokenizer import Tokenizer, load_store_tokenizer


def _parse_ids(spec: str, vocab_size: int) -> np.ndarray:
    try:
        ids = [int(part) for part in spec.replace(",", " ").split()]
    except ValueError as err:
        raise UserError(f"--ids {spec!r} is not a list of integers: pass e.g. --ids 12,7,99") from err
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UserError(f"--ids holds {bad[0]}, outside the store's vocabulary of {vocab_size}: "
                        f"pass ids in [0, {vocab_size})")
    return np.array(ids, dtype=np.int32)


def _tokenizer_for_ids(store: Datastore, spec: str | None) -> Tokenizer | None:
    try:
        tok = load_store_tokenizer(store.meta, store.path, spec, light=True)
    except UserError as err:
        if spec is not None:
            raise
        click.echo(f"samctl: warning: no text shown: {err}", err=True)
        return None
    if tok is None:
        click.echo(f"samctl: note: no text shown: tokenizer {spec or store.meta.tokenizer_name} loads only "
                   "through transformers or a .gguf file's first conversion (seconds); query with --text to see "
                   "text", err=True)
    return tok


def answer(store: Datastore, ids: np.ndarray, n: int, k: int, tok: Tokenizer | None) -> dict[str, Any]:
    found = store.lookup(ids, n, k)
    matched = ids[len(ids) - found.match_length :] if found.match_length else ids[:0]

    def text(tokens: np.ndarray) -> str | None:
        return tok.decode(tokens.tolist()) if tok is not None else None

    return {
        "kind": store.kind,
        "query_ids": ids.tolist(),
        "match_length": found.match_length,
        "matched_ids": matched.tolist(),
        "matched_text": text(matched),
        "count": found.count,
        "continuation_ids": found.continuation.tolist(),
        "continuation_text": text(found.continuation),
        "next_tokens": [{"id": int(t), "count": int(c), "text": text(np.array([t]))}
                        for t, c in zip(found.next_tokens, found.next_counts)],
    }


def _text(result: dict[str, Any]) -> str:
    def quoted(value: str | None) -> str:
        return json.dumps(value, ensure_ascii=False) if value is not None else "(no tokenizer)"

    next_tokens = ", ".join(
        f"{quoted(t['text']) if t['text'] is not None else t['id']} ({t['count']})"
        for t in result["next_tokens"]) or "-"
    rows = [
        ("query", f"{len(result['query_ids'])} tokens"),
        ("match", f"{result['match_length']} tokens, {result['count']} occurrence(s): "
                  f"{quoted(result['matched_text'])}"),
        ("continuation", f"{len(result['continuation_ids'])} tokens: "
                         f"{quoted(result['continuation_text'])}"),
        ("ids", " ".join(map(str, result["continuation_ids"])) or "-"),
        ("next tokens", next_tokens),
    ]
    return "\n".join(f"{name:<12}  {value}" for name, value in rows)


@click.command("query")
@click.argument("store", type=click.Path())
@click.option("--text", "query_text", default=None, help="Query text (tokenized with the store's tokenizer).")
@click.option("--ids", default=None, help="Query token ids, comma or space separated.")
@click.option("-n", "--n", "n", default=16, show_default=True, type=click.IntRange(0, 100_000),
              help="Continuation length in tokens.")
@click.option("--top-k", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Most frequent next tokens to list.")
@click.option("--tokenizer", default=None, metavar="PATH_OR_NAME",
              help="Tokenizer to use instead of the one the store names (same fingerprint).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def query(store: str, query_text: str | None, ids: str | None, n: int, top_k: int,
          tokenizer: str | None, as_json: bool) -> None:
    """Find the longest suffix of a query in STORE and print what follows it."""
    if (query_text is None) == (ids is None):
        raise UserError("pass exactly one of --text or --ids")
    loaded = load_datastore(store)
    if query_text is not None:
        tok: Tokenizer | None = load_store_tokenizer(loaded.meta, loaded.path, tokenizer)
        query_ids = np.array(tok.encode(query_text), dtype=np.int32)
    else:
        query_ids = _parse_ids(ids, loaded.meta.vocab_size)
        tok = _tokenizer_for_ids(loaded, tokenizer)
    result = answer(loaded, query_ids, n, top_k, tok)
    click.echo(json.dumps(result, ensure_ascii=False) if as_json else _text(result))
