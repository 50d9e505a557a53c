"""`samctl generate`: lossless speculative decoding of one prompt or a JSONL batch.

Single prompt (--prompt / --prompt-file): the text streams to stdout as it is accepted, or
`--json` prints one object with the text and the metrics. Batch (--input FILE|-): one JSON record
per line in, one per line out in input order, blank lines included; a bad record (a blank line too)
gets an `error` field and the rest go on, and the exit status is 1 when any record failed. Progress
lines come every few seconds on a non-terminal stderr, also while one long record runs. `--compare` also runs plain decoding (`ar`)
on the same input in the same process, checks greedy outputs are identical and reports the speedup:
for a single prompt the median of --compare-runs rounds run in alternating order, with its range.
Every timing is of the steady state: a warm-up run comes first (see Runner). In float32 a
difference in the outputs exits 1; in half precision the first divergence and the agreeing rate
are reported instead (near-tie drift of batched verification, not an error).

`--resume` skips the records whose id the output file already holds (a torn last line is cut)
and appends the rest. `--ray` runs a batch on Ray Data actors, each with its own Session
(samctl/cluster.py); `Runner.process` turns one input line into one output line for both.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Iterator

import click

from samctl.decode.configs import DraftConfig, SamplingConfig, SpecDecConfig
from samctl.decode.methods import ALL_METHODS, DEFAULT_METHOD, NOT_LOSSLESS, method as method_entry, uses_store
from samctl.index.errors import UserError
from samctl.detok import IncrementalDetokenizer
from samctl.options import method_config as shared_method_config
from samctl.options import ignored_settings, method_options, sampling_options, set_threads
from samctl.progress import progress_bar
from samctl.textio import TEXT_FILE, check_utf8

if TYPE_CHECKING:  # torch, transformers and the decoder load when a model does, not for --help
    from samctl.decode.drafters.base import Drafter
    from samctl.decode.loop import GenerationConfig, GenerationResult
    from samctl.runtime import Engine

PROMPT_FIELDS = ("prompt", "turns", "text", "question", "instruction")
WARM_UP_TOKENS = 32


@click.command("generate")
@click.option("--model", "model_path", metavar="PATH", help="Local model folder or .gguf file (default: the embedded model).")
@click.option("--sam", "store_path", metavar="STORE", type=click.Path(), help="Static datastore built by `samctl build` with the model's tokenizer: a .sam file or a sharded store directory (--shards).")
@click.option("--method", type=click.Choice(ALL_METHODS), default=DEFAULT_METHOD, show_default=True, help="Drafting method (README's method table; adaptive needs no tuning). "
              f"{', '.join(NOT_LOSSLESS)}: NOT lossless when sampling, reference reproductions only.")
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=TEXT_FILE, help="File holding the prompt.")
@click.option("--input", "input_file", type=TEXT_FILE, help="JSONL batch, '-' for stdin (field prompt, turns, or --field).")
@click.option("--output", "output_path", type=click.Path(dir_okay=False, allow_dash=True), default="-", show_default=True, help="JSONL results of a batch, '-' for stdout.")
@click.option("--resume", is_flag=True, help="Batch: skip records whose id is already in --output and append the rest (after a killed run).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Batch: generate on the Ray cluster at ADDRESS (a local Ray instance when omitted) with Ray Data, one "
                   "model + store + drafter per worker, each with --threads CPU threads (default 1); output in "
                   "input order, as without --ray.")
@click.option("--workers", type=int, default=None, help="--ray: worker actors [default: the cluster's CPUs / --threads, or its GPUs / --gpus-per-worker].")
@click.option("--gpus-per-worker", type=float, default=0.0, show_default=True, help="--ray: GPUs each worker holds (0: CPU workers).")
@click.option("--field", "prompt_field", metavar="NAME", help="Batch: the record field holding the prompt.")
@click.option("--prediction", "prediction_file", type=TEXT_FILE,
              help="adaptive: the expected output (e.g. the file being edited), drafted from like the prompt; "
                   "in a batch, a record's `prediction` field.")
@click.option("--memory-file", "memory_file", metavar="STORE", type=click.Path(exists=True, dir_okay=False),
              help="adaptive, lookahead, ouroboros: preload the memory of earlier outputs from this store.")
@click.option("--memory-save", "memory_save", metavar="STORE", type=click.Path(dir_okay=False),
              help="adaptive, lookahead, ouroboros: write the memory of outputs to this store at the end (atomically).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--chat", is_flag=True, help="Apply the tokenizer's chat template to the prompt.")
@click.option("--json", "as_json", is_flag=True, help="Single prompt: print one JSON object instead of streaming text.")
@click.option("--compare", is_flag=True, help="Also run plain decoding (ar) and report the speedup and whether outputs match.")
@click.option("--compare-runs", type=int, default=3, show_default=True, help="--compare, single prompt: timed runs of each side, alternating; the speedup is their median, with its range.")
@sampling_options
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto", show_default=True, help="auto: float32 on CPU; on GPU the model's saved dtype (float32 models run in bfloat16). Greedy output equals plain greedy decoding token for token in float32; in half precision the distribution is the model's and greedy can differ at near-ties.")
@click.option("--no-compile", is_flag=True, help="CUDA: run the verify forward eagerly instead of as CUDA graphs at fixed widths (the CPU never compiles).")
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; 1 with --compare, "
              "whose ratio several threads on a busy machine make erratic); 1 is steadier on a busy machine.")
@method_options
@click.option("--draft-model", "draft_path", metavar="PATH", help="sd, specdec++, sam+draft, ouroboros: a small model sharing the target's tokenizer (default: the embedded draft, with the embedded target only).")
@click.option("--gamma", type=int, default=4, show_default=True, help="sd, sam+draft, ouroboros: draft tokens per step.")
@click.option("--acc-head", "acc_head_path", metavar="PATH", help="specdec++: acceptance head folder from tools/train_acceptance_head.py (default: the embedded one, with the embedded pair only).")
@click.option("--stop-threshold", type=float, default=0.3, show_default=True, help="specdec++: stop drafting once the predicted P(some draft token is rejected) exceeds this.")
@click.option("--bounds", type=(int, int), default=(2, 20), show_default=True, metavar="MIN MAX", help="specdec++: inclusive bounds on the draft length.")
@click.option("--eagle-head", "eagle_path", metavar="PATH", help="eagle, sam+eagle, adaptive+eagle: EAGLE head folder from tools/train_eagle.py for this model (default: the embedded one, with the embedded target only).")
@click.option("--quiet", is_flag=True, help="No notes on stderr.")
def generate(**opts: Any) -> None:
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
    if opts["compare_runs"] < 1:
        raise UserError(f"--compare-runs must be >= 1, got {opts['compare_runs']}")
    _check_batch_options(opts)
    _check_settings(opts)
    if opts["compare"] and opts["threads"] is None:
        # Timing both sides on one thread keeps the ratio steady when other processes want the
        # cores (BENCHMARKS.md, "--compare under load"); --threads N still chooses.
        opts["threads"] = 1
    # The single prompt's files are read (and refused if not UTF-8) before any model loads.
    single = opts["input_file"] is None
    prediction = _read_file(opts["prediction_file"], "--prediction") if single else None
    text = opts["prompt"] if opts["prompt"] is not None else _read_file(opts["prompt_file"], "--prompt-file")
    if prediction is not None and not method_entry(opts["method"]).takes_prediction:
        raise UserError(f"method {opts['method']} does not draft from a prediction: drop --prediction "
                        "or use --method adaptive, lookahead or ouroboros")
    refuse_foreign_store(opts["store_path"], opts["model_path"])
    if opts["ray_address"] is not None:
        from samctl.cluster import generate_on_ray

        failed = _batch_to_output(opts, lambda records, write: generate_on_ray(opts, records, write))
        _exit_for(failed)
        return
    session = Session(opts)
    runner, engine, drafter = session.runner, session.engine, session.drafter
    if opts["input_file"] is not None:
        total = _count_records(opts["input_file"])
        failed = _batch_to_output(opts, lambda records, write: runner.batch(records, write, opts["quiet"], total))
        _save_memory(opts, engine, drafter)
        _exit_for(failed)
        return
    mismatch = runner.single(text, opts["as_json"], opts["quiet"], prediction)
    _save_memory(opts, engine, drafter)
    if mismatch:
        sys.exit(1)


# Options that hold open files or only matter to the driver: a Ray worker gets the others.
DRIVER_ONLY = ("prompt", "prompt_file", "input_file", "output_path", "prediction_file", "memory_save", "resume")


class Session:
    """Everything one process needs to generate: the engine, the store, the drafter (kept across
    records: its cross-request memory lives here) and the Runner. Built from the command's options,
    here or, with --ray, in each worker from `worker_options(opts)`."""

    def __init__(self, opts: dict[str, Any]) -> None:
        from samctl.decode.engine.graphs import enable_cuda_graphs
        from samctl.decode.loop import GenerationConfig
        from samctl.memory import load_memory
        from samctl.runtime import (build_drafter, load_acc_head, load_draft, load_eagle, load_engine, load_store,
                                    resolve_draft_paths, resolve_eagle_path)

        set_threads(opts["threads"])
        sampling = SamplingConfig(opts["temperature"], opts["top_k"], opts["top_p"], opts["seed"])
        if not sampling.greedy and not method_entry(opts["method"]).lossless and not opts["quiet"]:
            click.echo(f"samctl: note: {opts['method']} is not lossless when sampling: its outputs do not "
                       "follow the model's distribution (use sdsat for that)", err=True)
        # Draft settings are checked before any file is looked for or loaded.
        draft_config = DraftConfig(gamma=opts["gamma"])
        specdec_config = SpecDecConfig(opts["stop_threshold"], *opts["bounds"])
        draft_path, head_path = resolve_draft_paths(opts["method"], opts["model_path"], opts["draft_path"],
                                                    opts["acc_head_path"], opts["quiet"], greedy=sampling.greedy)
        eagle_path = resolve_eagle_path(opts["method"], opts["model_path"], opts["eagle_path"], opts["quiet"])
        engine = load_engine(opts["model_path"], opts["device"], opts["dtype"], quiet=opts["quiet"])
        enable_cuda_graphs(engine.target, not opts["no_compile"])
        method_config = replace(
            shared_method_config(opts, engine.device),
            draft=draft_config,
            specdec=specdec_config,
        )
        store = load_store(opts["store_path"], engine, opts["occurrence"])
        draft = load_draft(draft_path, engine) if draft_path is not None else None
        head = load_acc_head(head_path, engine, draft) if head_path is not None else None
        eagle = load_eagle(eagle_path, engine) if eagle_path is not None else None
        gen_config = GenerationConfig(max_new_tokens=opts["max_new_tokens"], eos_token_ids=engine.eos_token_ids,
                                      sampling=sampling)
        drafter = build_drafter(opts["method"], engine, store, method_config, draft=draft, head=head,
                                sampling=sampling, quiet=opts["quiet"], eagle=eagle)
        if opts["memory_file"]:
            load_memory(opts["memory_file"], engine, drafter)
        method_store = store if uses_store(opts["method"]) else None  # build_drafter already said it is unused

        def fresh_drafter() -> Drafter:
            return build_drafter(opts["method"], engine, method_store, method_config, draft=draft, head=head,
                                 sampling=sampling, quiet=True, eagle=eagle)

        self.engine, self.drafter = engine, drafter
        self.runner = Runner(engine, drafter, fresh_drafter, gen_config, opts["compare"], opts["compare_runs"],
                             opts["chat"], field=opts["prompt_field"], record={
            "method": opts["method"], "model": engine.name, "store": opts["store_path"],
            "draft_model": draft_path, "acc_head": head_path, "eagle_head": eagle_path,
            "config": {"generation": asdict(gen_config), "method": asdict(method_config)},
        })


def _check_settings(opts: dict[str, Any]) -> None:
    """Every setting that needs no model, checked before torch is imported: a usage error costs
    no model load (the configs validate themselves on construction)."""
    if opts["max_new_tokens"] < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {opts['max_new_tokens']}")
    if opts["threads"] is not None and opts["threads"] < 1:
        raise UserError(f"--threads must be >= 1, got {opts['threads']}")
    SamplingConfig(opts["temperature"], opts["top_k"], opts["top_p"], opts["seed"])
    DraftConfig(gamma=opts["gamma"])
    SpecDecConfig(opts["stop_threshold"], *opts["bounds"])
    shared_method_config(opts)
    _note_ignored(opts)


def _note_ignored(opts: dict[str, Any]) -> None:
    """One line naming the drafter flags the chosen method does not read (`--method sam --max-nodes 3`)."""
    settings = method_entry(opts["method"]).settings
    flags = ignored_settings(opts, opts["method"])
    draft, specdec = DraftConfig(), SpecDecConfig()
    if "draft" not in settings and opts["gamma"] != draft.gamma:
        flags.append("--gamma")
    if "specdec" not in settings:
        flags += [flag for flag, changed in (
            ("--stop-threshold", opts["stop_threshold"] != specdec.stop_threshold),
            ("--bounds", tuple(opts["bounds"]) != (specdec.min_draft, specdec.max_draft))) if changed]
    if flags and not opts["quiet"]:
        click.echo(f"samctl: note: method {opts['method']} does not use {', '.join(flags)}", err=True)


def refuse_foreign_store(store_path: str | None, model: str | None) -> None:
    """Refuse a store built with another tokenizer before any weights load, where the model's
    tokenizer reads cheaply: a model folder, the embedded default, a .gguf already dequantized
    (a sharded store directory, or a .gguf not yet converted, is checked once the model is loaded)."""
    import os

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
    tokenizer = load_tokenizer(folder or "default", quiet=True)
    check_store_tokenizer(meta, store_path, tokenizer.fingerprint, model or "default")


def worker_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The options a --ray worker builds its Session from (no open files, no driver-only ones)."""
    return {k: v for k, v in opts.items() if k not in DRIVER_ONLY} | {"quiet": True}


def _check_batch_options(opts: dict[str, Any]) -> None:
    batch = opts["input_file"] is not None
    for flag, used in (("--resume", opts["resume"]), ("--ray", opts["ray_address"] is not None),
                       ("--workers", opts["workers"] is not None), ("--gpus-per-worker", opts["gpus_per_worker"] != 0)):
        if used and not batch:
            raise UserError(f"{flag} applies to a batch: give --input FILE")
    if opts["resume"] and opts["output_path"] == "-":
        raise UserError("--resume appends to the --output file: give a file, not stdout")
    if opts["ray_address"] is None and (opts["workers"] is not None or opts["gpus_per_worker"] != 0):
        raise UserError("--workers and --gpus-per-worker size the Ray workers: add --ray [ADDRESS]")
    if opts["ray_address"] is not None:
        if opts["memory_save"]:
            raise UserError("--memory-save keeps one process's memory; each --ray worker has its own: drop one of them")
        if opts["workers"] is not None and opts["workers"] < 1 or opts["gpus_per_worker"] < 0:
            raise UserError("--workers must be >= 1 and --gpus-per-worker >= 0")


def _batch_to_output(opts: dict[str, Any], run: Callable[[Iterable[tuple[int, str]], Callable[[str], None]], int]) -> int:
    """Run the batch's records (read lazily, so a pipe streams) through `run`, which calls
    `write` with each output line in input order and returns the number that failed; --resume
    drops the records already in the output and appends."""
    records: Iterable[tuple[int, str]] = _records(opts["input_file"])
    path = opts["output_path"]
    skipped = 0

    def unfinished(records: Iterable[tuple[int, str]], done: set[str]) -> Iterator[tuple[int, str]]:
        nonlocal skipped
        for number, line in records:
            if _record_key(number, line) in done:
                skipped += 1
            else:
                yield number, line

    if opts["resume"]:
        records = unfinished(records, _finished_ids(path))
        output = open(path, "a", encoding="utf-8")
    else:
        output = sys.stdout if path == "-" else open(path, "w", encoding="utf-8")

    def write(line: str) -> None:
        output.write(line + "\n")
        output.flush()

    try:
        return run(records, write)
    finally:
        if output is not sys.stdout:
            output.close()
        if opts["resume"] and not opts["quiet"]:
            click.echo(f"samctl: --resume: skipped {skipped} record(s) already in {path}", err=True)


def _exit_for(failed: int) -> None:
    if failed:
        click.echo(f"samctl: {failed} record(s) failed; see their `error` fields", err=True)
        sys.exit(1)


def _record_key(number: int, line: str) -> str:
    """A record's id as the output will write it (JSON text, so 7 and "7" differ)."""
    try:
        record = _parse(line, number)
    except UserError:
        return json.dumps(number)
    return json.dumps(record_key(record, number))


def _finished_ids(path: str) -> set[str]:
    """Ids already in the output file; a torn last line (a killed run) is cut off first."""
    try:
        with open(path, "rb+") as handle:
            data = handle.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                handle.truncate(end)
    except FileNotFoundError:
        return set()
    done = set()
    for number, line in enumerate(data[:end].decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            done.add(json.dumps(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise UserError(f"--resume: line {number} of {path} is not a samctl output record: "
                            "pass the --output file of the run to resume") from err
    return done


class Runner:
    """Runs prompts through one drafter (kept warm across records) and, with compare, through ar.

    Timings are of the steady state: before the first timed run, a throwaway drafter of the same
    method and plain decoding each run once, so that JIT cache loads, lazy imports and allocator
    growth are paid outside every measurement (the kept drafter learns nothing from it)."""

    def __init__(self, engine: Engine, drafter: Drafter, fresh_drafter: Callable[[], Drafter],
                 config: GenerationConfig, compare: bool, compare_runs: int, chat: bool,
                 record: dict[str, Any], field: str | None = None) -> None:
        self.engine, self.drafter, self.fresh_drafter, self.config = engine, drafter, fresh_drafter, config
        self.compare, self.compare_runs, self.chat, self.record = compare, compare_runs, chat, record
        self.field = field
        self.warm = False
        self.quiet = False  # single() and batch() set it: no notes on stderr
        self.room_noted = False
        self.cpu_s: dict[int, float] = {}  # id(result) -> the process's CPU seconds of that run

    def single(self, text: str, as_json: bool, quiet: bool, prediction: str | None = None) -> bool:
        """Generate for one prompt; True when --compare found greedy outputs that differ."""
        self.quiet = quiet
        ids = self.engine.encode(text, self.chat)
        stream = None if as_json else _Streamer(self.engine)
        self._expect(prediction)
        result = self._run(self.drafter, ids, stream)
        if stream is not None:
            stream.finish()
        out = self._result_record(result)
        mismatch = False
        if self.compare:
            out["compare"] = self._compare(ids, result, self.compare_runs)
            # Only float32 promises token-for-token equality; half precision reports the drift.
            mismatch = out["compare"]["identical"] is False and out["compare"]["exact_dtype"]
            if not as_json or not quiet:
                click.echo(_compare_line(self.record["method"], out["compare"], result), err=True)
        if as_json:
            click.echo(json.dumps({**self.record, **out}, ensure_ascii=False))
        return mismatch

    def batch(self, records: Iterable[tuple[int, str]], write: Callable[[str], None], quiet: bool,
              total: int | None = None) -> int:
        """Process (line number, line) records in order, writing each output line; returns the
        number of failed records."""
        self.quiet = quiet
        failed = 0
        with progress_bar("generate", "record", quiet, total=total) as progress, progress.heartbeat():
            for number, line in records:
                out, bad = self.process(number, line)
                failed += bad
                write(out)
                progress.update(1, tokens=output_tokens(out))
        return failed

    def process(self, number: int, line: str) -> tuple[str, bool]:
        """One input line -> (its output line, whether it failed): a bad record gets an `error`."""
        record_id: Any = number
        try:
            record = _parse(line, number)
            record_id = record_key(record, number)
            out = self._run_record(record, self.field)
        except UserError as err:
            return json.dumps({"id": record_id, "error": str(err)}, ensure_ascii=False), True
        return json.dumps({"id": record_id, **out}, ensure_ascii=False), False

    def _run_record(self, record: dict[str, Any], field: str | None) -> dict[str, Any]:
        turns = _prompt_turns(record, field)
        prediction = record.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise UserError("the record's `prediction` is not text: give the expected output as a string")
        messages: list[dict[str, str]] = []
        texts, results = [], []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            ids = self.engine.encode_conversation(messages, self.chat)
            self._expect(prediction if len(messages) == 1 else None)
            result = self._run(self.drafter, ids, None)
            text = self.engine.decode(result.tokens)
            messages.append({"role": "assistant", "content": text})
            texts.append(text)
            results.append((ids, result))
        out = self._result_record(results[-1][1])
        if len(turns) > 1:
            out["turn_texts"] = texts
            out["metrics"] = [self._result_record(r)["metrics"] for _, r in results]
        if self.compare:
            out["compare"] = [self._compare(ids, r) for ids, r in results] if len(turns) > 1 else self._compare(*results[0])
        return out

    def _expect(self, prediction: str | None) -> None:
        """Hand the drafter the request's expected output (tokenized as plain text), if it takes one."""
        expect = getattr(self.drafter, "expect", None)
        if expect is not None:
            expect(None if not prediction else self.engine.tokenizer(prediction, add_special_tokens=False)["input_ids"])

    def _run(self, drafter: Drafter, ids: list[int], stream: "_Streamer | None") -> GenerationResult:
        from samctl.decode.loop import generate as decode_generate

        self._note_room(ids)
        if not self.warm:
            self._warm_up(ids)
        start = time.process_time()
        result = decode_generate(self.engine.target, drafter, ids, self.config,
                                 on_tokens=stream.push if stream is not None else None)
        if self.compare:
            self.cpu_s[id(result)] = time.process_time() - start
        return result

    def _note_room(self, ids: list[int]) -> None:
        """Once per run: a prompt that leaves less of the model's context than --max-new-tokens."""
        context = self.engine.target.max_positions
        room = context - len(ids)
        if self.room_noted or self.quiet or not 0 < room < self.config.max_new_tokens:
            return
        self.room_noted = True
        click.echo(f"samctl: note: the prompt is {len(ids)} tokens of the model's {context}-token context: at most "
                   f"{room} new tokens fit, fewer than --max-new-tokens {self.config.max_new_tokens}", err=True)

    def _result_record(self, result: GenerationResult) -> dict[str, Any]:
        return {"text": self.engine.decode(result.tokens), "finish_reason": result.finish_reason,
                "metrics": result.metrics.to_dict()}

    def _compare(self, ids: list[int], result: GenerationResult, runs: int = 1) -> dict[str, Any]:
        """ar on the same prompt; with runs > 1, more rounds of (fresh drafter, ar), in alternating
        order so that a drift of the machine hits both sides alike. The speedup is the median of
        the per-round ratios of tokens/s; every round's greedy output must equal the first ar's.
        On a CPU the ratio is of tokens per CPU-second of this process: the wall clock also counts
        the time other processes hold the cores, which slows plain decoding's many small forwards
        more than the method's few large ones, so a busy machine would inflate it (BENCHMARKS.md,
        "--compare under load"); the wall-clock ratio is reported beside it."""
        import torch

        from samctl.decode.drafters.base import NoDraft

        rounds = [(result, self._run(NoDraft(), ids, None))]
        for k in range(1, runs):
            if k % 2:
                baseline = self._run(NoDraft(), ids, None)
                rounds.append((self._run(self.fresh_drafter(), ids, None), baseline))
            else:
                method = self._run(self.fresh_drafter(), ids, None)
                rounds.append((method, self._run(NoDraft(), ids, None)))
        reference = rounds[0][1].tokens
        diffs = [_first_difference(r.tokens, reference) for pair in rounds for r in pair]
        first_diff = next((d for d in diffs if d is not None), None)
        greedy = self.config.sampling.greedy
        wall = [m.metrics.tokens_per_s / b.metrics.tokens_per_s if b.metrics.tokens_per_s else 0.0
                for m, b in rounds]
        on_cpu = self.engine.device.type == "cpu"
        ratios = [self._cpu_ratio(m, b) for m, b in rounds] if on_cpu else wall
        exact = self.engine.target.dtype == torch.float32
        for pair in rounds:
            for r in pair:
                self.cpu_s.pop(id(r), None)
        same = first_diff if first_diff is not None else len(reference)
        return {
            "ar_metrics": rounds[0][1].metrics.to_dict(),
            "speedup": round(statistics.median(ratios), 3),
            "speedup_runs": [round(r, 3) for r in ratios],
            "speedup_clock": "cpu" if on_cpu else "wall",
            "speedup_wall": round(statistics.median(wall), 3),
            "speedup_wall_runs": [round(r, 3) for r in wall],
            "tokens_per_s": round(statistics.median(m.metrics.tokens_per_s for m, _ in rounds), 3),
            "ar_tokens_per_s": round(statistics.median(b.metrics.tokens_per_s for _, b in rounds), 3),
            "identical": (first_diff is None) if greedy else None,
            "first_difference": first_diff if greedy else None,
            "exact_dtype": exact,  # float32: a difference is an error; half precision: near-tie drift
            "torch_threads": torch.get_num_threads(),
            "agreeing_prefix_rate": round(same / len(reference), 4) if greedy and reference else None,
        }

    def _cpu_ratio(self, method: GenerationResult, base: GenerationResult) -> float:
        # tokens per CPU-second of the method over the same for ar
        m_cpu, b_cpu = self.cpu_s.get(id(method), 0.0), self.cpu_s.get(id(base), 0.0)
        if m_cpu <= 0 or b_cpu <= 0 or not base.metrics.new_tokens:
            return 0.0
        return (method.metrics.new_tokens / m_cpu) / (base.metrics.new_tokens / b_cpu)

    def _warm_up(self, ids: list[int]) -> None:
        # On the first prompt itself, so that the drafter takes the paths (and JIT-compiles the
        # kernel signatures) the timed runs take; with a throwaway drafter, because warming the
        # kept one would teach it (Token Recycle, memories) this very prompt.
        from samctl.decode.drafters.base import NoDraft
        from samctl.decode.loop import GenerationConfig, generate as decode_generate

        self.warm = True
        warm = GenerationConfig(max_new_tokens=WARM_UP_TOKENS, eos_token_ids=(), sampling=self.config.sampling)
        decode_generate(self.engine.target, self.fresh_drafter(), ids, warm)
        decode_generate(self.engine.target, NoDraft(), ids, warm)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class _Streamer:
    """Writes decoded text to stdout as tokens arrive: only the new text, an incomplete character
    held back (samctl.detok)."""

    def __init__(self, engine: Engine) -> None:
        self.detok = IncrementalDetokenizer(engine.decode)

    def push(self, tokens: list[int]) -> None:
        text = self.detok.push(tokens)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write(self.detok.finish() + "\n")
        sys.stdout.flush()


def _save_memory(opts: dict[str, Any], engine: Engine, drafter: Drafter) -> None:
    from samctl.memory import save_memory

    if opts["memory_save"]:
        saved = save_memory(opts["memory_save"], engine, drafter)
        if not opts["quiet"]:
            click.echo(f"samctl: memory of {saved} output(s) written to {opts['memory_save']}", err=True)


def _compare_line(method: str, compare: dict[str, Any], result: GenerationResult) -> str:
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


def output_tokens(line: str) -> int:
    """New tokens of an output line, for progress."""
    metrics = json.loads(line).get("metrics", [])  # a list for multi-turn records, none for failed ones
    return sum(m["new_tokens"] for m in (metrics if isinstance(metrics, list) else [metrics]))


def _count_records(lines: IO[str]) -> int | None:
    """Records in a seekable input (a file), for progress; None for a pipe."""
    if not lines.seekable():
        return None
    count = sum(1 for _ in lines)
    lines.seek(0)
    return count


def _records(lines: IO[str]) -> Iterator[tuple[int, str]]:
    """Every line, blank ones included: the output has one line per input line."""
    return enumerate(lines, start=1)


def record_key(record: dict[str, Any], number: int) -> Any:
    """A batch record's id: its `id`, else `question_id`, else its line number."""
    return record.get("id", record.get("question_id", number))


def _read_file(handle: IO[str] | None, flag: str) -> str | None:
    """The text of a file option, refused in one line if it is not UTF-8."""
    if handle is None:
        return None
    return check_utf8(handle.read(), f"{flag} {getattr(handle, 'name', '')}".strip())


def _parse(line: str, number: int) -> dict[str, Any]:
    check_utf8(line, f"line {number}")
    if not line.strip():
        raise UserError(f"line {number} is blank: one JSON object per line (the output keeps one "
                        "line per input line)")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"line {number} is not JSON ({err.msg}): one JSON object per line") from err
    if not isinstance(record, dict):
        raise UserError(f"line {number} is not a JSON object: one object per line, e.g. {{\"prompt\": \"...\"}}")
    return record


def _prompt_turns(record: dict[str, Any], field: str | None) -> list[str]:
    names = (field,) if field else PROMPT_FIELDS
    for name in names:
        value = record.get(name)
        if name == "turns" and value is not None and not isinstance(value, list):
            raise UserError("`turns` must be a list of texts, one per turn, e.g. [\"first\", \"second\"]")
        if isinstance(value, str) and value:
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            return value
        if value == "" or (isinstance(value, list) and any(v == "" for v in value)):
            raise UserError(f"the record's `{name}` is empty: give the prompt text")
    raise UserError(f"no prompt: the record has none of the fields {', '.join(names)} as text; "
                    "name the field with --field")
