"""`samctl info`: what a store holds, how it was built, and (with --verify) whether it is intact.

It reads the header and the arrays' shapes only (numba is not loaded); `--verify` also checks
every checksum and validates the structure as a decoder would load it.
"""
from __future__ import annotations

import json
import os
from typing import Any

import click

from samctl.index.datastore import StoreMeta, read_meta, structure_counts
from samctl.index.kinds import KINDS
from samctl.index.load import load_datastore
from samctl.index.store import StoreFile
from samctl.progress import human_bytes


def _report(path: str, kind: str, format_version: int, file_size: int, meta: StoreMeta,
            counts: dict[str, int]) -> dict[str, Any]:
    tokens = meta.corpus.tokens
    return {
        "path": path, "kind": kind, "format_version": format_version, "file_size": file_size,
        "bytes_per_token": round(file_size / tokens, 3) if tokens else None,
        "documents": meta.corpus.documents, "tokens": tokens, **counts,
        "tokenizer": {"name": meta.tokenizer_name, "fingerprint": meta.tokenizer_fingerprint,
                      "vocab_size": meta.vocab_size, "eos_token_id": meta.eos_token_id},
        "build": meta.build.settings(), "corpus": meta.corpus.to_dict(), "created_by": meta.created_by,
        "written_by": meta.written_by or None,
    }


def describe(store: StoreFile, meta: StoreMeta, verified: bool) -> dict[str, Any]:
    report = _report(store.path, meta.build.kind, store.format_version, store.file_size, meta,
                     structure_counts(store, meta.build.kind))
    report["arrays"] = [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "codec": e.codec,
                         "stored_bytes": e.length, "raw_bytes": e.raw_length} for e in store.entries.values()]
    report["verified"] = verified
    return report


def describe_directory(store, verified: bool) -> dict[str, Any]:
    """`describe` for a store directory: a sharded store's shards (index/sharded.py) or a directory
    kind's files (index/kinds.py, e.g. `sa`) instead of arrays."""
    kind = KINDS[store.kind]
    report = _report(store.path, store.kind, store.format_version, store.file_size, store.meta,
                     kind.counts(store.structure))
    report["verified"] = verified
    if hasattr(store, "shards"):
        report["shards"] = [{**entry, **kind.counts(shard.structure)}
                            for entry, shard in zip(store.manifest["shards"], store.shards)]
    else:
        report["files"] = [{"file": name, **entry} for name, entry in store.manifest["sa"]["files"].items()]
    return report


def _text(report: dict[str, Any]) -> str:
    kind, tok = KINDS[report["kind"]], report["tokenizer"]
    per_token = f" ({report['bytes_per_token']:.1f} bytes/token)" if report["bytes_per_token"] else ""
    rows = [
        ("store", report["path"]),
        ("kind", f"{report['kind']} ({kind.label})"),
        ("format version", report["format_version"]),
        ("file size", f"{human_bytes(report['file_size'])}{per_token}"),
        ("documents", f"{report['documents']:,}"),
        ("tokens", f"{report['tokens']:,}"),
    ]
    rows += [(name, f"{report[name]:,}") for name in kind.count_names]
    rows += [
        ("tokenizer", f"{tok['name']} (fingerprint {tok['fingerprint']}, vocabulary "
                      f"{tok['vocab_size']:,}, eos {tok['eos_token_id']})"),
        ("build", _pairs(report["build"])),
        ("corpus", _pairs({k: v for k, v in report["corpus"].items()
                           if k not in ("documents", "tokens")})),
        ("created by", report["created_by"]),
    ]
    if report["written_by"]:
        rows.append(("written by", _pairs(report["written_by"])))
    rows += [(f"array {a['name']}", f"{a['dtype']} {tuple(a['shape'])} {a['codec']} "
                                    f"{human_bytes(a['stored_bytes'])}") for a in report.get("arrays", [])]
    rows += [(f"file {f['file']}", human_bytes(f["bytes"])) for f in report.get("files", [])]
    rows += [(f"shard {s['file']}", f"{s['documents']:,} documents, {s['tokens']:,} tokens, "
                                    + "".join(f"{s[name]:,} {name}, " for name in kind.count_names)
                                    + human_bytes(s["bytes"]))
             for s in report.get("shards", [])]
    if report["verified"]:
        rows.append(("checksums", "ok"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _pairs(values: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        if isinstance(value, list):
            return ",".join(map(str, value)) or "-"
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"{key}={show(value)}" for key, value in values.items())


@click.command("info")
@click.argument("store", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--verify", is_flag=True,
              help="Check every array's checksum (raw arrays are not checked on load).")
def info(store: str, as_json: bool, verify: bool) -> None:
    """Describe a store: kind, size, tokenizer, build config and corpus statistics."""
    if os.path.isdir(store):  # a store directory: loaded (a sharded one's shards, to count states)
        report = describe_directory(load_datastore(store, verify=verify), verify)
    elif verify:
        loaded = load_datastore(store, verify=True)
        report = describe(loaded.file, loaded.meta, verified=True)
    else:
        report = describe(*read_meta(store), verified=False)
    click.echo(json.dumps(report) if as_json else _text(report))
