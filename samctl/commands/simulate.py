"""`samctl simulate`: replay retrieval drafters against reference outputs, no model loaded.

A trace is a prompt and the output the model is assumed to produce. A trace file is JSON lines
(or a `.json` list) of records in one of these shapes:
    prompt_ids + output_ids        token ids, used as they are (a model's own greedy answers, as written
                                   with the model's tokenizer name and fingerprint in `tokenizer`)
    prompt + output                (or completion / response / reference for the output)
    instruction [+ input] + output Alpaca
    question + answer              GSM8K
    prediction (optional, text)    the expected output, handed to drafters that take one (adaptive)
    turns + reference              Spec-Bench: one trace per turn that has a reference; the prompt
                                   of turn k is the conversation so far (turns and references),
                                   joined by blank lines or rendered by the chat template (--chat)
Text is tokenized with the store's tokenizer (or --tokenizer, or the embedded default) without
special tokens; an optional `category` groups the results (MT-bench's eight as `mt_bench`). A record
that cannot be read is reported (how many, and the first) and the rest are replayed. Per method and
category the report gives decode.simulate's tallies and a speedup projected by its CostModel.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import click

from samctl.decode.methods import METHODS, REPLAYABLE, MethodConfig, make_drafter, method_config
from samctl.decode.simulate import CostModel, Trace, check_replayable, make_trace, replay, sweep_configs, tally_by_category
from samctl.index.datastore import Datastore
from samctl.index.load import load_datastore
from samctl.index.errors import UserError
from samctl.bench_report import format_cell, report_category
from samctl.config import SessionConfig
from samctl.options import check_count, parse_methods, session_options
from samctl.progress import progress_bar
from samctl.textio import ERRORS, check_utf8
from samctl.tokenizer import Tokenizer, load_store_tokenizer, load_tokenizer

_OUTPUT_FIELDS = ("output", "completion", "response", "reference")


@click.command("simulate")
@session_options(only=("store", "max_new_tokens", "chat", "quiet", "settings"), raw=("max_new_tokens",),
                 methods=REPLAYABLE,
                 store={"help": "Static datastore (for sam and rest): a .sam file or a store directory (sharded, or a suffix array)."},
                 max_new_tokens={"default": None, "type": int, "show_default": False,
                                 "help": "Cut references to this many tokens (default: whole references)."})
@click.option("--traces", "traces_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL (or .json list) of prompts with reference outputs.")
@click.option("--tokenizer", "tokenizer_spec", metavar="T", help="Tokenizer for text traces (default: the store's, else the embedded model's).")
@click.option("--methods", "methods_spec", default=None, help=f"Comma-separated, from {', '.join(REPLAYABLE)} [default: adaptive,ar,pld,sam, and rest with --sam].")
@click.option("--limit", type=int, default=None, help="Use only the first N traces.")
@click.option("--sweep", is_flag=True, help="Replay a grid of settings per method and print the best per category.")
@click.option("--forward-ms", type=float, default=CostModel.forward_ms, show_default=True, help="Cost model: one target forward, ms.")
@click.option("--token-cost", type=float, default=CostModel.token_cost, show_default=True, help="Cost model: extra forward cost per drafted token, as a fraction of a forward.")
@click.option("--cost-curve", "cost_curve", type=click.Path(exists=True, dir_okay=False),
              help="Verify-cost curve from `samctl calibrate --json` (sizes adaptive's drafts and projects speedups; "
                   "default: the linear model of --forward-ms and --token-cost).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def simulate(config: SessionConfig, max_new_tokens: int | None, **opts: Any) -> None:
    """Replay drafters against reference outputs: accepted tokens per step, without a model.

    \b
    samctl simulate --traces refs.jsonl --sam store.sam --methods pld,sam,rest
    samctl simulate --traces refs.jsonl --methods sam,pld --sweep
    """
    store = load_datastore(config.store, occurrence=config.occurrence) if config.store else None
    tokenizer = (load_store_tokenizer(store.meta, store.path, opts["tokenizer_spec"]) if store is not None
                 else load_tokenizer(opts["tokenizer_spec"]))
    default_methods = "adaptive,ar,pld,sam" + (",rest" if store is not None else "")
    methods = parse_methods(opts["methods_spec"] or default_methods, METHODS)
    for method in methods:
        check_replayable(method)
    cost = CostModel(forward_ms=opts["forward_ms"], token_cost=opts["token_cost"])  # refused before the traces are read
    try:
        traces = read_traces(Path(opts["traces_path"]), tokenizer, config.chat, max_new_tokens, opts["limit"])
    except ForeignTraceIds as err:
        if store is None:
            raise
        # --tokenizer cannot help here: the store fixes the tokenizer, and it is not the traces'.
        raise UserError(f"{err.where}: the ids come from tokenizer {err.name} (fingerprint {err.fingerprint}), but the "
                        f"store {config.store} was built with {tokenizer.name} (fingerprint {tokenizer.fingerprint}): "
                        f"rebuild the store with --tokenizer {err.name}, or write the traces with a model that has "
                        f"the store's tokenizer ({tokenizer.name})") from err
    settings = method_config(config.settings)
    if opts["cost_curve"]:
        from samctl.costs import read_cost_curve

        cost = CostModel.from_curve(read_cost_curve(opts["cost_curve"]))
    sim = _Simulation(traces, store, tokenizer, cost, config.quiet)
    if opts["sweep"]:
        result = sim.sweep(methods, settings)
        click.echo(json.dumps(result, indent=1) if opts["as_json"] else _sweep_table(result))
        return
    report = {"traces": len(traces), "store": config.store, "tokenizer": tokenizer.name,
              "cost_model": asdict(cost), "config": asdict(settings),
              "methods": {m: sim.run(m, settings) for m in methods}}
    click.echo(json.dumps(report, indent=1) if opts["as_json"] else _results_table(report))


class _Simulation:
    def __init__(self, traces: list[Trace], store: Datastore | None, tokenizer: Tokenizer, cost: CostModel,
                 quiet: bool) -> None:
        self.traces, self.store, self.tokenizer, self.cost, self.quiet = traces, store, tokenizer, cost, quiet

    def run(self, method: str, config: MethodConfig, label: str = "") -> dict[str, dict[str, Any]]:
        """{category: the tally's figures} of one replay of every trace."""
        # Warm-up on a drafter of its own: JIT caches load on first calls (kept out of the timings),
        # and a drafter that remembers earlier requests must not have seen the first trace already.
        replay(self._drafter(method, config), self.traces[0])
        drafter = self._drafter(method, config)
        metrics = []
        with progress_bar(f"simulate {label or method}", "trace", self.quiet, total=len(self.traces)) as bar:
            for trace in self.traces:
                metrics.append(replay(drafter, trace))
                bar.update(1)
        return {c: t.to_dict(self.cost) for c, t in tally_by_category(self.traces, metrics).items()}

    def _drafter(self, method: str, config: MethodConfig):
        return make_drafter(method, vocab_size=self.tokenizer.vocab_size, device="cpu",
                            eos_token_ids=self.tokenizer.eos_token_ids,
                            static=self.store.structure if self.store is not None else None, config=config,
                            cost=self.cost.curve())

    def sweep(self, methods: list[str], base: MethodConfig) -> dict[str, Any]:
        """Every grid point of every method; the best setting per (method, category)."""
        grid: dict[str, list[dict[str, Any]]] = {}
        for method in methods:
            points = list(sweep_configs(method, base, has_store=self.store is not None))
            grid[method] = [{"setting": setting,
                             "results": self.run(method, config, label=f"{method} {n}/{len(points)}")}
                            for n, (setting, config) in enumerate(points, start=1)]
        default = {m: self.run(m, base) for m in methods}
        best: dict[str, dict[str, Any]] = {}
        for method, points in grid.items():
            for category in default[method]:
                top = max(points, key=lambda p: p["results"][category]["projected_speedup"])
                best.setdefault(category, {})[method] = {
                    "setting": top["setting"], **top["results"][category],
                    **{f"default_{k}": default[method][category][k]
                       for k in ("projected_speedup", "mean_accepted", "drafted_per_step")}}
        return {"traces": len(self.traces), "cost_model": asdict(self.cost), "best": best, "grid": grid}


# ---------------------------------------------------------------------------------------------
# reading traces


def read_traces(path: Path, tokenizer: Tokenizer, chat: bool, max_new_tokens: int | None,
                limit: int | None) -> list[Trace]:
    check_count("--max-new-tokens", max_new_tokens)
    check_count("--limit", limit)
    traces: list[Trace] = []
    skipped: list[str] = []
    for where, record in _records(path):
        try:
            if isinstance(record, BadRecord):
                raise record
            traces.extend(_traces_of(record, where, tokenizer, chat, max_new_tokens))
        except BadRecord as err:  # reported, and the rest go on
            skipped.append(str(err))
        if limit is not None and len(traces) >= limit:
            break
    if skipped:
        click.echo(f"samctl: warning: skipped {len(skipped)} record(s) (first: {skipped[0]})", err=True)
    if not traces:
        raise UserError(f"{path} holds no traces: give JSON lines with prompt and output (see samctl simulate --help)")
    return traces[:limit]


class BadRecord(UserError):
    """A trace record simulate cannot read; the other records are read on."""


def _traces_of(record: dict[str, Any], where: str, tokenizer: Tokenizer, chat: bool,
               max_new_tokens: int | None) -> list[Trace]:
    prediction = record.get("prediction")
    if prediction is not None and not isinstance(prediction, str):
        raise BadRecord(f"{where}: `prediction` is not text: give the expected output as a string")
    predicted = tokenizer.encode(prediction) if prediction else None
    return [make_trace(prompt, reference, tokenizer.eos_token_ids, max_new_tokens,
                       category=report_category(record.get("category")), trace_id=trace_id,
                       prediction=predicted if k == 0 else None)
            for k, (trace_id, prompt, reference) in enumerate(_record_traces(record, where, tokenizer, chat))]


def _records(path: Path) -> Iterator[tuple[str, dict[str, Any] | BadRecord]]:
    text = check_utf8(path.read_bytes().decode("utf-8", ERRORS), str(path))
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}): fix or convert it to JSONL") from err
        numbered = ((f"{path}[{i}]", row) for i, row in enumerate(rows))
    else:
        numbered = ((f"{path}:{n}", _parse_line(line, path, n)) for n, line in enumerate(text.splitlines(), 1) if line.strip())
    for where, row in numbered:
        if not isinstance(row, (dict, BadRecord)):
            row = BadRecord(f"{where} is not a JSON object: one object per record")
        yield where, row


def _parse_line(line: str, path: Path, number: int) -> Any:
    """The line's JSON value, or the BadRecord that reports it (the other lines are read on)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        return BadRecord(f"{path}:{number} is not JSON ({err.msg}): one JSON object per line")


def _record_traces(record: dict[str, Any], where: str, tok: Tokenizer, chat: bool) -> Iterator[tuple[str, list[int], list[int]]]:
    """(id, prompt ids, reference ids) for each trace a record holds."""
    rid = str(record.get("id", record.get("question_id", where)))
    if "prompt_ids" in record or "output_ids" in record:
        _check_trace_tokenizer(record.get("tokenizer"), where, tok)
        yield rid, _ids(record.get("prompt_ids"), "prompt_ids", where, tok), _ids(record.get("output_ids"), "output_ids", where, tok)
        return
    if isinstance(record.get("turns"), list):
        yield from _turn_traces(record, rid, where, tok, chat)
        return
    prompt, output = _prompt_and_output(record, where)
    yield rid, _encode_prompt(tok, [{"role": "user", "content": prompt}], chat), tok.encode(output)


def _check_trace_tokenizer(recorded: Any, where: str, tok: Tokenizer) -> None:
    """Ids replayed under another tokenizer would be other tokens: refuse, never fall back."""
    if not isinstance(recorded, dict) or recorded.get("fingerprint") in (None, tok.fingerprint):
        return
    name = recorded.get("name", "?")
    raise ForeignTraceIds(f"{where}: the ids come from tokenizer {name} (fingerprint {recorded['fingerprint']}), "
                          f"but simulate uses {tok.name} (fingerprint {tok.fingerprint}): pass --tokenizer {name}",
                          where, name, str(recorded["fingerprint"]))


class ForeignTraceIds(UserError):
    """Trace ids written with another tokenizer than the one simulate uses."""

    def __init__(self, message: str, where: str, name: str, fingerprint: str) -> None:
        super().__init__(message)
        self.where, self.name, self.fingerprint = where, name, fingerprint


def _prompt_and_output(record: dict[str, Any], where: str) -> tuple[str, str]:
    def text(name: str) -> str | None:
        value = record.get(name)
        return value if isinstance(value, str) and value else None

    output = next((text(f) for f in _OUTPUT_FIELDS if text(f)), None)
    if text("prompt") and output:
        return text("prompt"), output
    if text("instruction") and text("output"):
        return "\n".join(t for t in (text("instruction"), text("input")) if t), text("output")
    if text("question") and text("answer"):
        return text("question"), text("answer")
    raise BadRecord(f"{where} has no prompt and reference (fields prompt + output, instruction + output, "
                    f"question + answer, turns + reference, or prompt_ids + output_ids)")


def _turn_traces(record: dict[str, Any], rid: str, where: str, tok: Tokenizer, chat: bool) -> Iterator[tuple[str, list[int], list[int]]]:
    turns = record["turns"]
    references = record.get("reference")
    if isinstance(references, str):
        references = [references]
    if not isinstance(references, list) or not references:
        raise BadRecord(f"{where} has turns but no reference outputs: add a `reference` list "
                        "(the output of each turn)")
    messages: list[dict[str, str]] = []
    for k, (turn, reference) in enumerate(zip(turns, references)):
        for what, value in (("text", turn), ("reference", reference)):
            if not isinstance(value, str):
                raise BadRecord(f"{where}: turn {k}'s {what} is a {type(value).__name__}, not text: give each turn "
                                "and its reference as a string")
        messages.append({"role": "user", "content": turn})
        yield f"{rid}.{k}", _encode_prompt(tok, messages, chat), tok.encode(reference)
        messages.append({"role": "assistant", "content": reference})


def _encode_prompt(tok: Tokenizer, messages: list[dict[str, str]], chat: bool) -> list[int]:
    """The conversation as the model would see it: chat template, or turns joined by blank lines
    (as `generate` and `bench` build multi-turn prompts)."""
    return tok.encode_chat(messages) if chat else tok.encode("\n\n".join(m["content"] for m in messages))


def _ids(value: Any, name: str, where: str, tok: Tokenizer) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRecord(f"{where}: {name} must be a non-empty list of token ids")
    if min(value) < 0 or max(value) >= tok.vocab_size:
        raise UserError(f"{where}: {name} holds an id outside the tokenizer's {tok.vocab_size}: "
                        f"pass the tokenizer the ids come from with --tokenizer")
    return value


# ---------------------------------------------------------------------------------------------
# tables

_COLUMNS = (("traces", "traces"), ("new_tokens", "tokens"), ("mean_accepted", "tokens/step"),
            ("forwards", "forwards"), ("drafted_per_step", "drafted/step"), ("acceptance_rate", "accept rate"),
            ("draft_us_per_step", "draft µs/step"), ("projected_speedup", "projected speedup"))


def _results_table(report: dict[str, Any]) -> str:
    cost = report["cost_model"]
    lines = [f"{report['traces']} traces; projected speedup: forward {cost['forward_ms']} ms "
             f"+ {cost['token_cost']} of a forward per drafted token", "",
             "| category | method | " + " | ".join(h for _, h in _COLUMNS) + " |",
             "|---|---|" + "---:|" * len(_COLUMNS)]
    for category in _category_order(report["methods"]):
        for method, by_cat in report["methods"].items():
            if (row := by_cat.get(category)) is not None:
                lines.append(f"| {category} | {method} | " + " | ".join(format_cell(row[k], k) for k, _ in _COLUMNS)
                             + " |")
    return "\n".join(lines)


def _sweep_table(result: dict[str, Any]) -> str:
    lines = [f"{result['traces']} traces; best setting per category by projected speedup "
             f"(forward {result['cost_model']['forward_ms']} ms + {result['cost_model']['token_cost']} per drafted token)", "",
             "| category | method | best setting | tokens/step | drafted/step | projected speedup "
             "| default: tokens/step | default: drafted/step | default: speedup |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for category in _category_order({"x": result["best"]}) if result["best"] else []:
        for method, row in result["best"][category].items():
            setting = " ".join(f"{k.split('.')[1]}={v}" for k, v in row["setting"].items()) or "(none)"
            lines.append(f"| {category} | {method} | {setting} | {row['mean_accepted']:.2f} | {row['drafted_per_step']:.1f} "
                         f"| {row['projected_speedup']:.2f} | {row['default_mean_accepted']:.2f} "
                         f"| {row['default_drafted_per_step']:.1f} | {row['default_projected_speedup']:.2f} |")
    return "\n".join(lines)


def _category_order(by_method: dict[str, dict[str, Any]]) -> list[str]:
    seen = sorted({c for by_cat in by_method.values() for c in by_cat if c != "overall"})
    return seen + ["overall"]

