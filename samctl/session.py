"""The one way samctl runs a model: a frozen `SessionConfig` (samctl.config) builds a Session.

A Session plans the config (samctl.plan), loads what it names once (engine, store, draft model,
heads) and keeps its drafter across requests, so cross-request memory lives here. The config is
recorded verbatim in every output record (`Session.record`). Every command, `samctl.hf`, the
trainers and the Ray worker are adapters over this module; none builds an engine or a drafter
itself. Decoding itself is `decode/`'s; JSONL records are `samctl.records`'s.
"""
from __future__ import annotations

import functools
import logging
import numbers
import statistics
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from samctl.config import SessionConfig, check_sampling
from samctl.decode.acceptance_head import AcceptanceHead
from samctl.decode.configs import SamplingConfig
from samctl.decode.draft_model import DraftModel
from samctl.decode.drafters.base import Drafter, NoDraft
from samctl.decode.eagle_head import EagleHead
from samctl.decode.engine.cost import VerifyCost
from samctl.decode.engine.graphs import enable_cuda_graphs
from samctl.decode.engine.native import backend_name
from samctl.decode.loop import GenerationConfig, GenerationResult, generate as decode_generate, prompt_error
from samctl.decode.methods import MethodConfig, make_drafter, method as method_entry, uses_store
from samctl.decode.metrics import first_difference
from samctl.heads import load_acc_head, load_eagle
from samctl.index.datastore import Datastore
from samctl.index.errors import Note, UserError
from samctl.models import Engine, load_draft, load_engine
from samctl.plan import plan
from samctl.stores import load_memory, load_store

log = logging.getLogger(__name__)


def build_drafter(name: str, engine: Engine, store: Datastore | None, config: MethodConfig,
                  draft: DraftModel | None = None, head: AcceptanceHead | None = None,
                  sampling: SamplingConfig = SamplingConfig(), eagle: EagleHead | None = None,
                  cost: VerifyCost | None = None) -> Drafter:
    """`cost`: the engine's verify cost, for methods that size drafts by it (`_Loaded.verify_cost`)."""
    return make_drafter(name, vocab_size=engine.vocab_size, device=engine.device, eos_token_ids=engine.eos_token_ids,
                        static=store.structure if store is not None and uses_store(name) else None, config=config,
                        draft=draft, head=head, sampling=sampling, cost=cost, target=engine.target, eagle=eagle)


WARM_UP_TOKENS = 32
BATCH_MAX_WIDTH = 16  # most draft nodes a row verifies per batched step


class _Loaded:
    """What the sessions of one process share: the engine, the store, and models loaded on first use."""

    def __init__(self, engine: Engine, store: Datastore | None) -> None:
        self.engine, self.store = engine, store
        self._models: dict[tuple[Callable, str], Any] = {}

    @functools.cached_property
    def verify_cost(self) -> VerifyCost:
        """samctl.costs.verify_cost, read once for every drafter of every session."""
        from samctl.costs import verify_cost

        return verify_cost(self.engine)

    def load(self, loader: Callable[..., Any], path: str | None, *args: Any) -> Any:
        """loader(path, engine, *args), once per loader and path; None without a path."""
        if not path:
            return None
        if (loader, path) not in self._models:
            self._models[loader, path] = loader(path, self.engine, *args)
        return self._models[loader, path]


class Session:
    """An engine, a store, heads and a drafter, built from a SessionConfig and kept across requests.

        session = Session(SessionConfig(store="store.sam", chat=True))
        result = session.generate("Rewrite this function ...")
        print(session.decode(result.tokens), result.metrics.mean_accepted)
    """

    def __init__(self, config: SessionConfig, *, _shared: _Loaded | None = None) -> None:
        self.config = config
        self.plan = plan(config)  # a missing draft model or head is refused before the model loads
        for note in self.plan.notes if not config.quiet else ():
            log.info(note)
        if _shared is None:
            if config.threads is not None:  # validated by SessionConfig
                torch.set_num_threads(config.threads)
            engine = load_engine(self.plan.model, config.device, config.dtype, quantize=config.quantize,
                                 prepack=config.prepack, backend=config.backend)
            enable_cuda_graphs(engine.target, config.graphs)
            _shared = _Loaded(engine, load_store(config.store, engine, config.occurrence))
        self._shared = _shared
        self.engine: Engine = _shared.engine
        self.method_config = config.method_config(self.engine.device)
        self._draft = _shared.load(load_draft, self.plan.draft_model)
        self._head = _shared.load(load_acc_head, self.plan.acc_head, self._draft)
        self._eagle = _shared.load(load_eagle, self.plan.eagle_head)
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens,
                                           eos_token_ids=self.engine.eos_token_ids, sampling=config.sampling)
        self.drafter = self.fresh_drafter(fork=False)
        if config.memory_file:
            load_memory(config.memory_file, self.engine, self.drafter)
        self.record = {"method": config.method, "model": self.engine.name, "backend": backend_name(self.engine.model),
                       "store": config.store, "draft_model": self.plan.draft_model, "acc_head": self.plan.acc_head,
                       "eagle_head": self.plan.eagle_head,
                       "config": {"session": config.to_record(), "generation": asdict(self.generation),
                                  "method": asdict(self.method_config)}}
        self.warm = self.batch_warm = False  # warm_up / warm_up_batched has run
        self._room_noted = False
        self._run = None  # the BatchRun stream_batch keeps (_kept_run)
        self._run_size = 0

    @classmethod
    def over(cls, engine: Engine, config: SessionConfig, store: Datastore | None = None) -> "Session":
        """A session on an engine that is already built (samctl.hf wraps a loaded model in one);
        config.model, device, dtype, threads and store are not read; graphs is, where the engine has none."""
        if engine.target.graphs is None:  # a no-op off CUDA
            enable_cuda_graphs(engine.target, config.graphs)
        return cls(replace(config, model=engine.name), _shared=_Loaded(engine, store))

    def for_method(self, method: str, **changes: Any) -> "Session":
        """A session of another method (or other settings) on the same engine, store and heads."""
        changes = {"memory_file": None, "quiet": True, **changes}  # notes were said by the first session
        return Session(replace(self.config, method=method, **changes), _shared=self._shared)

    @property
    def store(self) -> Datastore | None:
        return self._shared.store

    def loaded_parts(self) -> tuple:
        """What this session's drafter refers to besides the engine (the store's structure, the
        draft model, heads): shared, never copied, when a drafter's state is snapshotted."""
        parts = (self.store.structure if self.store is not None else None, self._draft,
                 self._draft.model if self._draft is not None else None, self._head, self._eagle)
        return tuple(p for p in parts if p is not None)

    @property
    def draft_model(self) -> DraftModel | None:
        return self._draft

    def encode(self, prompt: str | Sequence[int] | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt: text, ids as they are, or a conversation (a list of messages)."""
        if isinstance(prompt, str):
            return self.engine.encode(prompt, self.config.chat)
        # a tensor or array of ids as a list of ints; any other sequence as a list
        prompt = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt) if isinstance(prompt, Iterable) else prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if all(_is_message(m) for m in prompt):
                return self.engine.encode_conversation(prompt, self.config.chat)
        elif isinstance(prompt, list) and all(isinstance(t, numbers.Integral) for t in prompt):
            return [int(t) for t in prompt]
        raise UserError(f"a prompt is text, a list of token ids or a list of messages ({{'role': str, 'content': str}}"
                        f" each), not {_shown(prompt)}")

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    def generate(self, prompt: str | Sequence[int] | list[dict[str, str]], *, prediction: str | None = None,
                 on_tokens: Callable[[list[int]], bool | None] | None = None, drafter: Drafter | None = None,
                 max_new_tokens: int | None = None, sampling: SamplingConfig | None = None) -> GenerationResult:
        """`prediction`: the expected output (e.g. the file being edited), for the methods that draft
        from one. `on_tokens` may return True to stop (finish_reason "stop"). `max_new_tokens` and
        `sampling` override the configuration's for this request (a draft model keeps drafting
        with the configured sampling, which costs acceptance, never correctness)."""
        ids, drafter, generation = self._request(prompt, drafter, max_new_tokens, sampling)
        return decode_generate(self.engine.target, drafter, ids, generation, on_tokens=on_tokens,
                               prediction=self.prediction_ids(prediction))

    def one_row_run(self, prompt: str | Sequence[int] | list[dict[str, str]], *, prediction: str | None = None,
                    on_tokens: Callable[[list[int]], bool | None] | None = None, max_new_tokens: int | None = None,
                    sampling: SamplingConfig | None = None):
        """`generate` as a one-row decode.loop.BatchRun (key 0), not yet run: the server steps it
        between two steps of its batch, holding the batch back by a step, never by a whole answer."""
        from samctl.decode.loop import one_row_run

        ids, drafter, generation = self._request(prompt, None, max_new_tokens, sampling)
        return one_row_run(self.engine.target, drafter, ids, generation, on_tokens=on_tokens,
                           prediction=self.prediction_ids(prediction))

    def _request(self, prompt, drafter: Drafter | None, max_new_tokens: int | None,
                 sampling: SamplingConfig | None) -> tuple[list[int], Drafter, GenerationConfig]:
        ids = self.encode(prompt)
        self._note_room(ids)
        if not self.warm:
            self.warm_up(ids)
        generation = self.generation
        if max_new_tokens is not None or sampling is not None:
            # `is None`, not `or`: max_new_tokens=0 is refused by GenerationConfig, never read as unset
            generation = replace(generation,
                                 max_new_tokens=generation.max_new_tokens if max_new_tokens is None else max_new_tokens,
                                 sampling=generation.sampling if sampling is None else check_sampling(sampling))
        return ids, self.drafter if drafter is None else drafter, generation

    def generate_batch(self, prompts: Sequence[str | Sequence[int] | list[dict[str, str]]], *, batch_size: int = 8,
                       on_result: Callable[[Any], None] | None = None, stats: Any = None,
                       predictions: Sequence[str | None] | None = None) -> list:
        """Up to `batch_size` rows in flight, each output exactly its batch-1 output in float32, results
        in input order; `predictions[i]`: prompt i's expected output (or None). SDSAT's methods,
        which draft with the target's own forward, are refused."""
        if isinstance(prompts, (str, dict)):
            raise UserError(f"generate_batch takes a list of prompts, not one {type(prompts).__name__}: "
                            "pass [prompt] or call generate")
        items = ((i, p, None if predictions is None else predictions[i]) for i, p in enumerate(prompts))
        results = {}
        for result in self.stream_batch(items, batch_size=batch_size, stats=stats):
            results[result.index] = result
            if on_result is not None:
                on_result(result)
        return [results[i] for i in range(len(prompts))]

    def stream_batch(self, items: Iterable[tuple[Any, Any, str | None]], *, batch_size: int = 8,
                     stats: Any = None) -> Iterator:
        """generate_batch over `items` (key, prompt, prediction or None), read lazily as rows free
        up, yielding each result (`index`: its key) as it finishes. The BatchRun (its cache and
        CUDA graphs) is kept between calls: the session holds that memory."""
        from samctl.decode.loop import BatchStats, DrafterPool, feed, require_batchable

        require_batchable(self.config.method)
        run = self._kept_run(batch_size)
        run.stats = stats if stats is not None else BatchStats()
        run.stats.batch_size = run.target.rows
        start = time.perf_counter()

        def encoded():
            for key, prompt, prediction in items:
                ids = self.encode(prompt)
                if not self.batch_warm:  # else the first records' metrics carry the JIT loads (or compiles)
                    self.warm_up_batched([ids], run.cost)
                yield key, ids, self.prediction_ids(prediction)

        yield from feed(run, encoded(), self.generation, DrafterPool(self.fresh_drafter))
        run.stats.time_s = time.perf_counter() - start

    def _kept_run(self, batch_size: int):
        # one run at a time: a run holds its rows' cache
        if self._run is None or self._run_size != batch_size or not self._run.idle:
            self._run, self._run_size = self.batch_run(batch_size), batch_size
        return self._run

    def batch_run(self, batch_size: int, stop: Callable[[], bool] | None = None):
        """An empty decode.loop.BatchRun on this engine, for records submitted one by one (the
        server's scheduler). Measuring its verify cost stops between two forwards once `stop()`."""
        from samctl.costs import batch_cost
        from samctl.decode.loop import BatchRun

        return BatchRun(self.engine.model, batch_size, max_width=BATCH_MAX_WIDTH, graphs=self.config.graphs,
                        cost=batch_cost(self.engine, batch_size, BATCH_MAX_WIDTH, stop=stop))

    def batch_refusal(self) -> str:
        from samctl.decode.loop import batch_refusal

        return batch_refusal(self.config.method)

    def fresh_drafter(self, fork: bool = True) -> Drafter:
        """A new drafter that shares nothing learned with the kept one, and with a draft model cache
        of its own (weights shared), so drafters can run side by side. fork=False: the kept one."""
        draft = self._draft.fork() if fork and self._draft is not None else self._draft
        cost = self._shared.verify_cost if method_entry(self.config.method).sized_by_cost else None
        return build_drafter(self.config.method, self.engine, self.store, self.method_config, draft=draft,
                             head=self._head, sampling=self.config.sampling, eagle=self._eagle, cost=cost)

    def warm_up(self, ids: list[int]) -> None:
        """Pay JIT loads, lazy imports and allocator growth outside every timed run: on the prompt
        itself, so the drafter takes the timed runs' paths, with a throwaway drafter, because warming
        the kept one would teach it (Token Recycle, memories) this very prompt."""
        self.warm = True
        drafter, warm = self.fresh_drafter(), self._warm_config()
        for _ in range(2):  # the second run drafts from what the first taught it: other kernels, or other types
            decode_generate(self.engine.target, drafter, ids, warm)
        decode_generate(self.engine.target, NoDraft(), ids, warm)

    def _warm_config(self) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=WARM_UP_TOKENS, eos_token_ids=(), sampling=self.config.sampling)

    def warm_up_batched(self, prompts: list[list[int]], cost: VerifyCost) -> None:
        """warm_up, then the batched engine's (its drafters take paths of their own), on the first
        prompt the model can continue (the others get their errors in the batch)."""
        from samctl.decode.loop import generate_batch

        for ids in prompts:
            target = self.engine.target
            if not prompt_error(np.asarray(ids), target.max_positions, vocab_size=target.vocab_size):
                if not self.warm:
                    self.warm_up(ids)
                self.batch_warm = True
                # twice through one slot, whose drafter drafts from the first record in the second
                generate_batch(self.engine.model, self.fresh_drafter, [ids, ids], self._warm_config(), 1, cost=cost,
                               max_width=BATCH_MAX_WIDTH)
                return

    def compare(self, prompt: str | Sequence[int] | list[dict[str, str]], result: GenerationResult,
                runs: int = 1) -> dict[str, Any]:
        """Plain decoding (ar) on the same prompt, in `runs` rounds of alternating order (a drift of the
        machine hits both sides alike): the median speedup, and whether every greedy output is ar's."""
        ids = self.encode(prompt)
        rounds = [(result, self.generate(ids, drafter=NoDraft()))]
        for k in range(1, runs):  # odd rounds run plain decoding first
            plain = self.generate(ids, drafter=NoDraft()) if k % 2 else None
            method = self.generate(ids, drafter=self.fresh_drafter())
            rounds.append((method, plain if plain is not None else self.generate(ids, drafter=NoDraft())))
        reference = rounds[0][1].tokens
        diffs = [first_difference(r.tokens, reference) for pair in rounds for r in pair]
        first_diff = next((d for d in diffs if d is not None), None)
        greedy = self.config.sampling.greedy
        # On a CPU, tokens per CPU-second: the wall clock also counts other processes' time on the cores,
        # which slows plain decoding's many small forwards more (BENCHMARKS.md, "--compare under load").
        wall = [m.metrics.tokens_per_s / b.metrics.tokens_per_s if b.metrics.tokens_per_s else 0.0
                for m, b in rounds]
        on_cpu = self.engine.device.type == "cpu"
        ratios = [_cpu_ratio(m, b) for m, b in rounds] if on_cpu else wall
        same = first_diff if first_diff is not None else len(reference)
        return {
            "ar_metrics": rounds[0][1].metrics.to_dict(),
            "speedup": round(statistics.median(ratios), 3),
            "speedup_runs": [round(r, 3) for r in ratios],
            "speedup_clock": "cpu" if on_cpu else "wall",
            "speedup_wall": round(statistics.median(wall), 3),
            "speedup_wall_runs": [round(r, 3) for r in wall],
            "torch_threads": torch.get_num_threads(),
            "tokens_per_s": round(statistics.median(m.metrics.tokens_per_s for m, _ in rounds), 3),
            "ar_tokens_per_s": round(statistics.median(b.metrics.tokens_per_s for _, b in rounds), 3),
            "identical": (first_diff is None) if greedy else None,
            "first_difference": first_diff if greedy else None,
            # float32: a difference is an error; half precision: near-tie drift
            "exact_dtype": self.engine.target.dtype == torch.float32,
            "agreeing_prefix_rate": round(same / len(reference), 4) if greedy and reference else None,
        }

    def _note_room(self, ids: list[int]) -> None:
        # once per session: a prompt that leaves less of the model's context than max_new_tokens
        context = self.engine.target.max_positions
        room = context - len(ids) + 1  # the last new token is never fed back
        if self._room_noted or self.config.quiet or not 0 < room < self.config.max_new_tokens:
            return
        self._room_noted = True
        log.info(Note("note: the prompt is {n} tokens of the model's {context}-token context: at most {room} new "
                      "tokens fit, fewer than {max_new_tokens} {asked}", n=len(ids), context=context, room=room,
                      asked=self.config.max_new_tokens))

    def prediction_ids(self, prediction: str | None) -> list[int] | None:
        """Tokenized as plain text."""
        if prediction is not None and not isinstance(prediction, str):
            raise UserError(f"a prediction is the expected output as text, not {type(prediction).__name__} "
                            f"{prediction!r:.40}")
        return None if not prediction else self.engine.tokenizer(prediction, add_special_tokens=False)["input_ids"]


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("role"), str) and isinstance(item.get("content"), str)


def _shown(prompt: Any) -> str:
    """A wrong prompt as its error names it: its type, or the first item that is not a message (a
    conversation) or not a token id."""
    if not isinstance(prompt, list):
        return f"{type(prompt).__name__} {prompt!r:.60}"
    if prompt and isinstance(prompt[0], dict):
        bad = next(m for m in prompt if not _is_message(m))
    else:
        bad = next(t for t in prompt if not isinstance(t, numbers.Integral))
    return f"a list holding {bad!r:.60}"


def _cpu_ratio(method: GenerationResult, base: GenerationResult) -> float:
    m, b = method.metrics, base.metrics
    if m.cpu_s <= 0 or b.cpu_s <= 0 or not b.new_tokens:
        return 0.0
    return (m.new_tokens / m.cpu_s) / (b.new_tokens / b.cpu_s)
