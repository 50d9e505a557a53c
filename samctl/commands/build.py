"""`samctl build`: read corpora, tokenize them, build a store of one kind (index/kinds.py), save it.

Phases: 1) read documents (index.corpus) 2) tokenize them in bounded batches, an EOS after each
document 3) build the structure (numba loads here, so that `build --help` stays fast) 4) write the
store atomically. The summary line goes to stdout; progress, notes and warnings to stderr.
`--append-to` grows a store without re-reading its corpus: an automaton inserts the new documents
after its own (equal to a full build over the old inputs, then the new), a suffix array is rebuilt
over its stored documents and the new ones. `--shards N` writes a store directory (index/sharded.py)
of N shards over contiguous runs of documents, each built in its own process or, with --ray, as a
Ray task (samctl/cluster.py).
"""
from __future__ import annotations

import os
import time
import dataclasses

import click
import numpy as np

from samctl.index.corpus import CorpusReader
from samctl.index.datastore import BuildConfig, CorpusStats, StoreMeta, save_datastore
from samctl.index.load import load_datastore
from samctl.index.errors import UserError
from samctl.index.kinds import KINDS, BuildOptions
from samctl.index.ngram_config import MAX_N, NgramConfig
from samctl.index.store import is_store_file
from samctl.options import MAX_WORKERS, check_count, config_option
from samctl.progress import human_bytes, progress_bar, status
from samctl.tokenizer import load_store_tokenizer, load_tokenizer, tokenize_documents


MAX_SHARDS = 1 << 16
MAX_NGRAM_TOP_K = 4096  # next tokens kept per context


@click.command("build")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("-o", "--output", required=True, type=click.Path(),
              help="Store to write: a .sam file, or a directory with --kind sa or --shards.")
@click.option("--kind", type=click.Choice(list(KINDS)), default="sam", show_default=True,
              help="; ".join(f"{k.name}: {k.label}, {k.help}" for k in KINDS.values()) + ".")
@click.option("--tokenizer", default=None, metavar="PATH_OR_NAME",
              help="Tokenizer folder, .gguf model file, cached model name, 'bytes', or 'default' "
                   "[default: the embedded model's, else bytes].")
@click.option("--include", multiple=True, metavar="GLOB",
              help="In folders, read only files matching GLOB (repeatable; replaces the "
                   "default text/code extensions).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="In folders, skip files matching GLOB (repeatable).")
@click.option("--field", "fields", multiple=True, metavar="NAME",
              help="Record field to read, instead of the known shapes (repeatable; joined "
                   "with newlines).")
@click.option("--max-n", default=4, show_default=True, help="n-gram: longest context.")
@click.option("--min-count", default=2, show_default=True, help="n-gram: prune rarer entries.")
@click.option("--top-k", default=8, show_default=True, help="n-gram: next tokens per context.")
@click.option("--compress/--no-compress", default=True, show_default=True,
              help="zstd-compress arrays where it pays; uncompressed stores take about twice "
                   "the bytes but are memory-mapped on load.")
@click.option("--eos/--no-eos", "append_eos", default=True, show_default=True,
              help="Append the tokenizer's EOS token after each document.")
@click.option("--append-to", "append_to", type=click.Path(exists=True), metavar="STORE",
              help="Grow this automaton or suffix-array store with the inputs (its tokenizer and settings; the old "
                   "corpus is not re-read); -o may name the same file.")
@click.option("--shards", type=int, default=None, metavar="N",
              help="Write a store directory of N shards of --kind sam or sa (whole documents each), built "
                   "in parallel: one process per core (sa: sharing --memory-limit), or Ray tasks with --ray.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="With --shards: tokenize with Ray Data and build each shard as a Ray task on the cluster at "
                   "ADDRESS (a local Ray instance when omitted; write -o to a path every node sees). Put it "
                   "after the inputs or write --ray=ADDRESS.")
@click.option("--workers", type=int, default=None,
              help="With --shards, without --ray: shards built at once [default: the CPU count]. With --kind sa "
                   "and no --shards: suffix-sorting processes at once [default: 1].")
@click.option("--memory-limit", "memory_limit", default=None, metavar="SIZE",
              help="--kind sa: memory the suffix sort may hold, e.g. 4G or 512M, divided between the shards "
                   "sorted at once [default: half the free memory].")
@click.option("--verify", is_flag=True, help="Re-read the written store and check every checksum.")
@click.option("--force", is_flag=True, help="Replace OUTPUT even when it is not a samctl store.")
@config_option("quiet")
def build(inputs, output, kind, tokenizer, include, exclude, fields, max_n, min_count, top_k,
          compress, append_eos, append_to, shards, ray_address, workers, memory_limit, verify, force, quiet) -> None:
    """Build a datastore from folders, .json/.jsonl/.parquet files, hf:NAME[[:CONFIG]:SPLIT] or - (stdin).

    Records are read in known shapes (Alpaca instruction/input/output, GSM8K question/answer,
    Spec-Bench turns, chat messages, a text field) or from the fields given with --field.
    An existing OUTPUT is replaced only when it is a store (or with --force).

    \b
    samctl build docs/ -o store.sam
    samctl build --append-to store.sam new_docs/ -o store.sam    # grow it
    samctl build big/ -o store.sa --kind sa --memory-limit 4G     # suffix array (pip install 'samctl[sa]')
    """
    start = time.perf_counter()
    old = None
    if append_to is not None:
        if shards is not None:
            raise UserError("--append-to grows one store: drop --shards, or rebuild the sharded store")
        old = load_datastore(append_to)
        if hasattr(old, "shards"):
            raise UserError(f"{append_to} is a sharded store: --append-to grows one store; rebuild it with --shards")
        if not KINDS[old.kind].grows:
            raise UserError(f"{append_to} is an {old.kind} store ({KINDS[old.kind].label}): --append-to grows "
                            f"automaton and suffix-array stores; rebuild the {KINDS[old.kind].label} over all inputs")
        given = click.get_current_context().get_parameter_source("kind") != click.core.ParameterSource.DEFAULT
        if given and kind != old.kind:
            raise UserError(f"--append-to grows a {KINDS[old.kind].label} store: drop --kind {kind}")
        kind = old.kind
    _check_ngram_options(kind)
    if kind == "ngram":
        check_count("--max-n", max_n, MAX_N, low=None)  # BuildConfig checks the lower bounds
        check_count("--top-k", top_k, MAX_NGRAM_TOP_K, low=None)
    config = BuildConfig(kind=kind, max_n=max_n, min_count=min_count, top_k=top_k,
                         compress=compress, append_eos=append_eos, include=include,
                         exclude=exclude, fields=fields)
    if old is not None:
        config = dataclasses.replace(old.meta.build, include=include, exclude=exclude, fields=fields)
    entry = KINDS[kind]
    memory_bytes = _size(memory_limit) if memory_limit is not None else None
    if memory_limit is not None and kind != "sa":
        raise UserError("--memory-limit bounds the suffix sort: drop it, or add --kind sa")
    _check_sharding(kind, shards, ray_address, None if entry.directory and shards is None else workers)
    check_count("--workers", workers, MAX_WORKERS)
    if shards is None and os.path.isdir(output) and not entry.directory:
        raise click.BadParameter(f"{output} is a directory: pass a file path, or --kind sa or --shards N to write a "
                                 "store directory", param_hint="'-o' / '--output'")
    if os.path.isfile(output) and entry.directory:
        raise UserError(f"{output} is a file: a {entry.label} store is a directory, pass another -o path")
    if shards is None and not entry.directory and os.path.lexists(output) and not force and not is_store_file(output):
        raise UserError(f"{output} exists and is not a samctl store: pass --force to replace it, "
                        "or choose another -o")
    # 1) documents, read lazily while tokenizing
    reader = CorpusReader(inputs, include, exclude, fields, stdin=click.get_text_stream("stdin"))
    tok = load_tokenizer(tokenizer) if old is None else load_store_tokenizer(old.meta, append_to, tokenizer)
    # 2) tokens, streamed in bounded batches (timed apart from loading the tokenizer)
    tokenize_start = time.perf_counter()
    with progress_bar("tokenizing", "document", quiet) as bar:
        if ray_address is not None:
            from samctl.cluster import tokenize_on_ray

            tokens, doc_offsets = tokenize_on_ray(ray_address, (d.text for d in reader), tokenizer, append_eos,
                                                  on_tokens=lambda docs, count: bar.update(docs, tokens=count))
        else:
            tokens, doc_offsets = tokenize_documents(
                (d.text for d in reader), tok, append_eos=config.append_eos,
                on_batch=lambda docs, count: bar.update(docs, tokens=count))
    counts = reader.counts
    if counts.skipped:
        click.echo(f"samctl: warning: skipped {len(counts.skipped)} file(s) that are not readable text "
                   f"(first: {counts.skipped[0]})", err=True)
    if len(tokens) == 0:
        raise UserError(f"the corpus is empty ({counts.files} file(s) read, {counts.empty} blank "
                        "document(s)): check the inputs and --include/--exclude")
    tokenized = time.perf_counter()
    corpus = CorpusStats(documents=counts.documents, tokens=int(len(tokens)),
                         characters=counts.characters, files=counts.files,
                         empty_documents=counts.empty, skipped_files=len(counts.skipped),
                         inputs=tuple(inputs))
    if old is not None:
        corpus = _combined(old.meta.corpus, corpus)
    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    meta = StoreMeta(tokenizer_name=tok.name, tokenizer_fingerprint=tok.fingerprint,
                     vocab_size=tok.vocab_size, eos_token_id=eos, build=config, corpus=corpus,
                     written_by=old.meta.written_by if old is not None else {})
    if shards is not None:
        _build_and_write_sharded(output, tokens, doc_offsets, meta, tok.name, shards, ray_address,
                                 workers, memory_bytes, verify, quiet, (start, tokenize_start, tokenized))
        return
    # 3) structure; numba loads here, not for --help (a directory kind writes itself meanwhile)
    with progress_bar(f"building the {entry.label}", "token", quiet, total=len(tokens)) as bar:
        if old is not None and not entry.directory:
            with bar.heartbeat():
                structure = old.structure.appended(tokens, doc_offsets)
        else:
            if old is not None:  # rebuilt over the stored documents, then the new ones
                old_tokens, old_offsets = old.structure.documents()
                doc_offsets = np.concatenate((old_offsets, old_offsets[-1] + doc_offsets[1:]))
                tokens = np.concatenate((old_tokens, tokens))
            structure = entry.build(tokens, doc_offsets, meta, BuildOptions(
                path=output, memory_limit=memory_bytes, threads=workers or 1, heartbeat=bar.heartbeat))
        bar.update(bar.total - bar.done)  # a kind that cannot count its progress (ngram, sa) is done too
    built = time.perf_counter()
    del tokens, doc_offsets  # the structure holds what it needs; free the input before writing
    # 4) store
    if not entry.directory:
        save_datastore(output, structure, meta)
    written = time.perf_counter()
    phases = [("load tokenizer", tokenize_start - start), ("read and tokenize", tokenized - tokenize_start),
              ("build", built - tokenized), ("write", written - built)]
    if verify:
        load_datastore(output, verify=True)
        phases.append(("verify", time.perf_counter() - written))
    if not quiet:
        size = load_datastore(output).file_size if entry.directory else os.path.getsize(output)
        click.echo(_summary(output, size, entry.counts(structure), corpus, tok.name, phases,
                            time.perf_counter() - start, verified=verify))


def _check_ngram_options(kind: str) -> None:
    """The n-gram table's settings (NgramConfig's fields) given for another kind are refused, not ignored."""
    ctx = click.get_current_context()
    given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(NgramConfig)
             if ctx.get_parameter_source(f.name) != click.core.ParameterSource.DEFAULT]
    if kind != "ngram" and given:
        raise UserError(f"a {KINDS[kind].label} has no n-gram settings: drop {' and '.join(given)}, or add --kind ngram")


def _check_sharding(kind: str, shards: int | None, ray_address: str | None, workers: int | None) -> None:
    if shards is None:
        if ray_address is not None or workers is not None:
            raise UserError("--ray and --workers build shards: add --shards N")
        return
    if not KINDS[kind].shards:
        raise UserError(f"--shards splits suffix automata and suffix arrays, not an {KINDS[kind].label}: drop --shards "
                        "or use --kind sam or sa")
    check_count("--shards", shards, MAX_SHARDS)
    if workers is not None and ray_address is not None:
        raise UserError("Ray schedules its own workers: drop --workers with --ray")


def _build_and_write_sharded(output: str, tokens, doc_offsets, meta: StoreMeta, tokenizer_name: str, shards: int,
                             ray_address: str | None, workers: int | None, memory_limit: int | None, verify: bool,
                             quiet: bool, times: tuple[float, float, float]) -> None:
    """Phases 3-4 with --shards: each shard built and written by its own worker, then the manifest."""
    from samctl.index.sharded import StoreDirectoryWriter, plan_shards, verify_sharded  # numba loads here
    from samctl.cluster import run_local, run_on_ray, shard_jobs

    if os.path.isfile(output):
        raise UserError(f"{output} is a store file: --shards writes a directory, pass another -o path")
    kind = KINDS[meta.build.kind]
    bounds = plan_shards(doc_offsets, shards)
    workers = min(shards, workers or os.cpu_count() or 1)
    if kind.directory:  # suffix sorts at once share the memory limit (Ray: as many as this machine's cores)
        workers, memory_limit = _shared_memory(memory_limit, workers)
    with StoreDirectoryWriter(output) as writer:
        jobs = shard_jobs(writer.tmp, tokens, doc_offsets, bounds, meta, lambda i: writer.shard_path(i, kind.name),
                          memory_limit)
        where = f"as Ray tasks ({ray_address})" if ray_address else f"in {workers} processes"
        status(f"building {shards} {kind.label} shards over {len(tokens):,} tokens {where}", quiet)

        def done(index: int, peak: int) -> None:
            status(f"shard {index} built (worker peak {human_bytes(peak)})", quiet)

        results = run_on_ray(ray_address, jobs, done) if ray_address is not None else run_local(jobs, workers, done)
        writer.commit(meta, [entry for entry, _, _ in results])
    start, tokenize_start, tokenized = times
    written = time.perf_counter()
    if verify:
        verify_sharded(output)  # shard by shard: the driver never holds the whole store
    if not quiet:
        click.echo(_sharded_summary(output, meta.corpus, tokenizer_name, results, written - start,
                                    tokenized - tokenize_start, written - tokenized, ray_address, verify))


def _shared_memory(memory_limit: int | None, workers: int) -> tuple[int, int]:
    """(suffix sorts at once, bytes each): `workers` sorts share the limit, fewer if each would get
    less than the indexer's minimum."""
    from samctl.index.suffix_array import MIN_SORT_MEMORY, check_memory_limit, default_memory_limit

    total = check_memory_limit(memory_limit if memory_limit is not None else default_memory_limit())
    workers = max(1, min(workers, total // MIN_SORT_MEMORY))
    return workers, total // workers


def _sharded_summary(output, corpus, tokenizer_name, results, total, tokenize, build_s, ray_address, verified) -> str:
    size = sum(entry["bytes"] for entry, _, _ in results)
    peaks = sorted(peak for _, peak, _ in results)
    shape = ", ".join(f"{sum(counts[name] for _, _, counts in results):,} {name}" for name in results[0][2])
    return (f"wrote {output}: {len(results)} shards, {corpus.documents:,} documents, {corpus.tokens:,} tokens "
            f"({tokenizer_name}), {shape}, {human_bytes(size)} ({size / corpus.tokens:.1f} bytes/token) "
            f"in {total:.2f} s (tokenize {tokenize:.2f} s, build and write {build_s:.2f} s"
            f"{', on Ray' if ray_address else ''}); worker peak memory {peaks[len(peaks) // 2] / 1e6:,.1f} MB median, "
            f"{peaks[-1] / 1e6:,.1f} MB largest{', checksums verified' if verified else ''}")


def _combined(old: CorpusStats, new: CorpusStats) -> CorpusStats:
    return CorpusStats(**{f.name: getattr(old, f.name) + getattr(new, f.name) for f in dataclasses.fields(CorpusStats)})


def _size(text: str) -> int:
    """Bytes from 4G, 512M, 64K or a plain number."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(body[:-1]) * units[body[-1]]) if body and body[-1] in units else int(body)
    except (ValueError, IndexError) as err:
        raise UserError(f"--memory-limit {text!r} is not a size: write e.g. 4G or 512M") from err


def _summary(output, size, counts, corpus, tokenizer_name, phases, total, verified) -> str:
    shape = ", ".join(f"{value:,} {name}" for name, value in counts.items())
    check = ", checksums verified" if verified else ""
    breakdown = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases)
    return (f"wrote {output}: {corpus.documents:,} documents, {corpus.tokens:,} tokens "
            f"({tokenizer_name}), {shape}, {human_bytes(size)} "
            f"({size / corpus.tokens:.1f} bytes/token) in {total:.2f} s ({breakdown}){check}")
