"""`samctl generate`: lossless speculative decoding of one prompt or a JSONL batch.

A single prompt streams to stdout as it is accepted (`--json`: one object). A batch writes one line
per input line in input order, blank lines included; a bad record gets an `error` field, the rest go
on, and the exit status is 1 when any failed. `--compare` exits 1 when greedy outputs differ in
float32; in half precision it reports the divergence (near-tie drift, not an error). This module
only turns flags into a SessionConfig and output into lines: the session is samctl.session's, the
records samctl.records's, `--ray` samctl.cluster's.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import IO, Any, Callable, Iterable

import click
from click.core import ParameterSource

from samctl.config import SessionConfig
from samctl.decode.methods import PREDICTION_METHODS, method as method_entry
from samctl.index.errors import UserError
from samctl.options import (MAX_BATCH_SIZE, MAX_WORKERS, batch_size, batch_size_option, check_count, ignored_settings,
                            session_options)
from samctl.plan import EMBEDDED_MODEL_ID, plan
from samctl.textio import TEXT_FILE, check_output_path, check_utf8

@click.command("generate")
@session_options()
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=TEXT_FILE, help="File holding the prompt.")
@click.option("--input", "input_file", type=TEXT_FILE, help="JSONL batch, '-' for stdin (field prompt, turns, or --field; "
              "or OpenAI Batch API lines, see --input-format).")
@click.option("--input-format", type=click.Choice(["auto", "records", "openai"]), default="auto", show_default=True,
              help="Batch: `records` (samctl's: prompt/turns/text fields -> id, text, metrics) or `openai` (OpenAI Batch "
                   "API lines, as `vllm run-batch` reads them: {custom_id, method: POST, url: /v1/chat/completions or "
                   "/v1/completions, body} -> {id, custom_id, response: {status_code, request_id, body: the completion "
                   "`samctl serve` returns}, error}; body.model must be --model as given, or default without it). auto: from the first line.")
@click.option("--output", "output_path", type=click.Path(dir_okay=False, allow_dash=True), default="-", show_default=True, help="JSONL results of a batch, '-' for stdout.")
@click.option("--resume", is_flag=True, help="Batch: skip the records already in --output (by id) and append the rest (after a killed run).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Batch: generate on the Ray cluster at ADDRESS (a local Ray instance when omitted) with Ray Data, one "
                   "model + store + drafter per worker, each with --threads CPU threads (default 1); output in "
                   "input order, as without --ray.")
@click.option("--workers", type=int, default=None, help="--ray: worker actors [default: the cluster's CPUs / --threads, or its GPUs / --gpus-per-worker].")
@click.option("--gpus-per-worker", type=float, default=0.0, show_default=True, help="--ray: GPUs each worker holds (0: CPU workers).")
@batch_size_option
@click.option("--field", "prompt_field", metavar="NAME", help="Batch: the record field holding the prompt.")
@click.option("--prediction", "prediction_file", type=TEXT_FILE,
              help=f"{', '.join(PREDICTION_METHODS)}: the expected output (e.g. the file being edited), drafted from "
                   "like the prompt; in a batch, a record's `prediction` field.")
@click.option("--memory-save", "memory_save", metavar="STORE", type=click.Path(dir_okay=False),
              help="adaptive, adaptive+eagle, lookahead, ouroboros: write the memory of outputs to this store at the end (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Single prompt: print one JSON object instead of streaming text.")
@click.option("--compare", is_flag=True, help="Also run plain decoding (ar) and report the speedup and whether outputs match (both on one torch thread unless --threads is given).")
@click.option("--compare-runs", type=int, default=3, show_default=True, help="--compare, single prompt: timed runs of each side, alternating; the speedup is their median, with its range.")
def generate(config: SessionConfig, **opts: Any) -> None:
    """Generate from a prompt or a JSONL batch, faster, with exactly the model's output.

    \b
    samctl generate --sam store.sam --prompt-file p.txt
    samctl generate --model ./my-model --prompt "..." --method pld --compare
    samctl generate --model ./big --draft-model ./small --method sd --gamma 4 --prompt "..."
    cat docs.jsonl | samctl generate --sam store.sam --input - --output - > out.jsonl
    """
    sources = [name for name in ("prompt", "prompt_file", "input_file") if opts[name] is not None]
    if len(sources) != 1:
        raise UserError("give exactly one of --prompt, --prompt-file or --input")
    check_count("--compare-runs", opts["compare_runs"], 1000)
    _check_batch_options(opts)
    if opts["memory_save"]:
        check_output_path("--memory-save", opts["memory_save"], (("--sam", config.store),), store=True)
    if opts["compare"] and config.threads is None:
        # Timing both sides on one thread keeps the ratio steady when other processes want the
        # cores (BENCHMARKS.md, "--compare under load"); --threads N still chooses.
        config = replace(config, threads=1)
    flags = ignored_settings(config.settings, config.method)
    if flags and not config.quiet:
        click.echo(f"samctl: note: method {config.method} does not use {', '.join(flags)}", err=True)
    # The single prompt's files are read (and refused if not UTF-8) before any model loads.
    prediction = _read_file(opts["prediction_file"], "--prediction")
    text = opts["prompt"] if opts["prompt"] is not None else _read_file(opts["prompt_file"], "--prompt-file")
    if text == "" and not config.chat:  # refused now, not once the model has loaded (--chat: the template is text)
        where = "--prompt" if opts["prompt"] is not None else f"--prompt-file {opts['prompt_file'].name}"
        raise UserError(f"{where} is empty: give at least one token of text")
    if prediction is not None and not method_entry(config.method).takes_prediction:
        raise UserError(f"method {config.method} does not draft from a prediction: drop --prediction "
                        f"or use --method {' or '.join(PREDICTION_METHODS)}")
    refuse_foreign_store(config.store, config.model)
    input_format = _input_format(opts)
    if opts["ray_address"] is not None:
        from samctl.cluster import generate_on_ray

        size = batch_size(config, opts["batch_size"], on_gpu=opts["gpus_per_worker"] > 0, compare=opts["compare"],
                          per_worker=True)
        failed = _batch_to_output(opts, config, lambda records, write, _: generate_on_ray(
            config, records, write, address=opts["ray_address"], workers=opts["workers"],
            gpus_per_worker=opts["gpus_per_worker"], field=opts["prompt_field"], compare=opts["compare"],
            batch_size=size))
        _exit_for(failed)
        return
    plan(config)  # a missing draft model or head is refused now, not after torch loads (seconds)
    from samctl.records import RecordRunner
    from samctl.session import Session

    session = Session(config)
    if opts["memory_save"] and not session.drafter.keeps_memory:  # refused before the run, not after it
        raise UserError(f"method {config.method} keeps no memory across requests: drop --memory-save, or choose "
                        "--method adaptive, adaptive+eagle, lookahead or ouroboros")
    if opts["input_file"] is not None:
        size = batch_size(config, opts["batch_size"], on_gpu=session.engine.device.type != "cpu",
                          compare=opts["compare"], memory_save=opts["memory_save"])
        if input_format == "openai":
            from samctl.records import OpenAIBatchRunner

            runner = OpenAIBatchRunner(session, config.model or EMBEDDED_MODEL_ID, size)
        else:
            runner = RecordRunner(session, field=opts["prompt_field"], compare=opts["compare"], batch_size=size)
        failed = _batch_to_output(opts, config, lambda records, write, total: runner.batch(records, write, config.quiet,
                                                                                          total))
        _save_memory(opts, session)
        _exit_for(failed)
        return
    mismatch = _single(session, text, opts, prediction)
    _save_memory(opts, session)
    if mismatch:
        sys.exit(1)


def _single(session, text: str, opts: dict[str, Any], prediction: str | None) -> bool:
    """Generate for one prompt, streamed or as JSON; True when --compare found greedy outputs that
    differ in float32."""
    from samctl.detok import TextStream
    from samctl.records import result_fields

    stream = None if opts["as_json"] else TextStream(session.decode)
    result = session.generate(text, prediction=prediction, on_tokens=stream.push if stream is not None else None)
    if stream is not None:
        stream.finish()
    out = result_fields(session, result)
    mismatch = False
    if opts["compare"]:
        out["compare"] = session.compare(text, result, opts["compare_runs"])
        # Only float32 promises token-for-token equality; half precision reports the drift.
        mismatch = out["compare"]["identical"] is False and out["compare"]["exact_dtype"]
        if mismatch or not session.config.quiet:  # with --quiet, only a difference (an error) is said
            click.echo(compare_line(session.config.method, out["compare"], result), err=True)
    if opts["as_json"]:
        click.echo(json.dumps({**session.record, **out}, ensure_ascii=False))
    return mismatch


def refuse_foreign_store(store_path: str | None, model: str | None) -> None:
    """Refuse a store built with another tokenizer before any weights load, where the model's
    tokenizer reads cheaply: a model folder, the embedded default, a .gguf already dequantized
    (a sharded store directory, or a .gguf not yet converted, is checked once the model is loaded)."""
    from samctl.gguf_cache import cached_folder, is_gguf
    from samctl.index.datastore import read_meta
    from samctl.tokenizer import check_store_tokenizer, load_tokenizer

    if store_path is None or os.path.isdir(store_path):
        return
    _, meta = read_meta(store_path)  # a missing or damaged store is refused here too
    folder = model
    if model is not None and not os.path.isdir(model):
        folder = cached_folder(model) if is_gguf(model) else None
        if folder is None:
            return
    tokenizer = load_tokenizer(folder or "default")
    check_store_tokenizer(meta, store_path, tokenizer.fingerprint, model or "default", model=True)


def _input_format(opts: dict[str, Any]) -> str | None:
    """The batch's input format (None without --input); the lines to read go to opts["input_lines"]."""
    from samctl.records import batch_format

    if opts["input_file"] is None:
        return None
    found, opts["input_lines"] = batch_format(opts["input_file"], opts["input_format"])
    if found == "openai":
        for flag, used in (("--compare", opts["compare"]), ("--field", opts["prompt_field"] is not None),
                           ("--resume", opts["resume"]), ("--ray", opts["ray_address"] is not None)):
            if used:
                raise UserError(f"{flag} reads samctl records, and the input holds OpenAI Batch API lines: drop {flag} "
                                "(or give --input-format records)")
    return found


def _read_file(handle: IO[str] | None, flag: str) -> str | None:
    if handle is None:
        return None
    return check_utf8(handle.read(), f"{flag} {getattr(handle, 'name', '')}".strip())


def _check_batch_options(opts: dict[str, Any]) -> None:
    """Refuse a flag that the single prompt or the batch would ignore, in one line."""
    batch = opts["input_file"] is not None
    for flag, used in (("--resume", opts["resume"]), ("--ray", opts["ray_address"] is not None),
                       ("--batch-size", opts["batch_size"] is not None), ("--output", opts["output_path"] != "-"),
                       ("--input-format", opts["input_format"] != "auto"), ("--field", opts["prompt_field"] is not None),
                       ("--workers", opts["workers"] is not None), ("--gpus-per-worker", opts["gpus_per_worker"] != 0)):
        if used and not batch:
            raise UserError(f"{flag} applies to a batch: give --input FILE")
    runs_given = click.get_current_context().get_parameter_source("compare_runs") != ParameterSource.DEFAULT
    for flag, used, instead in (
            ("--json", opts["as_json"], "a batch's output is JSON lines already: drop --json"),
            ("--prediction", opts["prediction_file"] is not None, "in a batch give each record a `prediction` field"),
            ("--compare-runs", runs_given, "a batch compares each record once: drop --compare-runs")):
        if used and batch:
            raise UserError(f"{flag} applies to a single prompt; {instead}")
    if runs_given and not opts["compare"]:
        raise UserError("--compare-runs sets the rounds of --compare: add --compare, or drop --compare-runs")
    check_count("--batch-size", opts["batch_size"], MAX_BATCH_SIZE)  # before the model loads
    if opts["resume"] and opts["output_path"] == "-":
        raise UserError("--resume appends to the --output file: give a file, not stdout")
    if batch and opts["output_path"] != "-":  # before the model loads, not once the batch starts
        check_output_path("--output", opts["output_path"], (("--input", getattr(opts["input_file"], "name", "")),))
    if opts["ray_address"] is None and (opts["workers"] is not None or opts["gpus_per_worker"] != 0):
        raise UserError("--workers and --gpus-per-worker size the Ray workers: add --ray [ADDRESS]")
    if opts["ray_address"] is not None:
        if opts["memory_save"]:
            raise UserError("--memory-save keeps one process's memory; each --ray worker has its own: drop one of them")
        check_count("--workers", opts["workers"], MAX_WORKERS)
        if opts["gpus_per_worker"] < 0:
            raise UserError("--gpus-per-worker must be >= 0")


def _batch_to_output(opts: dict[str, Any], config: SessionConfig,
                     run: Callable[[Iterable[tuple[int, str]], Callable[[str], None], int | None], int]) -> int:
    """Run the batch's records (read lazily, so a pipe streams) through `run`, which calls
    `write` with each output line in input order and returns the number that failed (its third
    argument: how many records it will get, for progress, when a file says); --resume drops the
    records already in the output and appends."""
    from samctl.records import count_records, finished_keys, read_records, unfinished

    path = opts["output_path"]
    done = finished_keys(path) if opts["resume"] else None
    total = count_records(opts["input_file"], done)
    records: Iterable[tuple[int, str]] = read_records(opts["input_lines"])
    skipped = 0

    def skip() -> None:
        nonlocal skipped
        skipped += 1

    if done is not None:
        records = unfinished(records, done, skip)
    # --resume appends (it refuses stdout: _check_batch_options)
    try:
        output = sys.stdout if path == "-" else open(path, "a" if opts["resume"] else "w", encoding="utf-8")
    except OSError as err:
        raise UserError(f"cannot write --output {path}: {err.strerror or err}: choose another path") from err

    written = 0
    broken: OSError | None = None

    def write(line: str) -> None:
        nonlocal written, broken
        try:
            output.write(line + "\n")
            output.flush()
        except BrokenPipeError:
            raise  # the reader went away (`| head`): samctl.cli ends quietly
        except OSError as err:  # a full disk, a quota, an I/O error
            broken = err
            raise _write_error(err, path, written) from err
        written += 1

    try:
        return run(records, write, total)
    finally:
        if output is not sys.stdout:
            try:
                output.close()
            except OSError:  # flushing what the failed write left in the buffer fails again
                if broken is None:
                    raise
        if opts["resume"] and not config.quiet:
            click.echo(f"samctl: --resume: skipped {skipped} record(s) already in {path}", err=True)


def _write_error(err: OSError, path: str, written: int) -> UserError:
    """A failed write of the batch's output as one line: what failed, what was kept, what to do.
    Every line before the failed one was flushed whole; `--resume` cuts a torn last line."""
    where = "standard output" if path == "-" else path
    then = (f"; the {written} complete line(s) written are kept: make room, then rerun with --resume to finish"
            if path != "-" else f" after {written} line(s): make room, then rerun")
    return UserError(f"cannot write to {where}: {err.strerror or err} (errno {err.errno}){then}")


def _exit_for(failed: int) -> None:
    if failed:
        click.echo(f"samctl: {failed} record(s) failed; see their `error` fields", err=True)
        sys.exit(1)


def _save_memory(opts: dict[str, Any], session) -> None:
    if opts["memory_save"]:
        from samctl.stores import save_memory

        saved = save_memory(opts["memory_save"], session.engine, session.drafter)
        if not session.config.quiet:
            click.echo(f"samctl: memory of {saved} output(s) written to {opts['memory_save']}", err=True)


def compare_line(method: str, compare: dict[str, Any], result) -> str:
    """The one stderr line of --compare: both speeds, the speedup with its spread, the verdict."""
    m, ar, ratios = result.metrics, compare["ar_metrics"], compare["speedup_runs"]
    verdict = {True: "outputs identical", False: f"OUTPUTS DIFFER at token {compare['first_difference']}",
               None: "sampling: outputs not compared"}[compare["identical"]]
    if compare["identical"] is False and not compare["exact_dtype"]:
        verdict = (f"outputs diverge at token {compare['first_difference']} "
                   f"({compare['agreeing_prefix_rate']:.0%} agree; half precision, near-tie drift, not an error)")
    spread = (f" (median of {len(ratios)} alternating runs, range {min(ratios):.2f}-{max(ratios):.2f})"
              if len(ratios) > 1 else " (one run; --compare-runs 3 gives a spread)")
    if compare["speedup_clock"] == "cpu":
        spread += f" in CPU time ({compare['speedup_wall']:.2f}x by the wall clock)"
    return (f"samctl: {method}: {m.new_tokens} tokens, {compare['tokens_per_s']:.1f} tok/s "
            f"({m.mean_accepted:.2f} tokens/step); ar: {ar['new_tokens']} tokens, {compare['ar_tokens_per_s']:.1f} "
            f"tok/s; speedup {compare['speedup']:.2f}x{spread}, {compare['torch_threads']} torch "
            f"thread{'s' if compare['torch_threads'] != 1 else ''}, after a warm-up; {verdict}")
