"""The one way samctl runs a model: a frozen configuration builds a Session.

A `SessionConfig` names everything a run depends on (model, device, dtype, threads, CUDA graphs,
store, method and its settings, the draft model and heads, generation length, sampling, chat
template, memory file); it is validated when built and recorded verbatim in every output record
(`Session.record`). A `Session` owns what the configuration names, loaded once: the engine (with
CUDA graphs chosen at construction), the store, the draft model and heads, and the drafter, which
is kept across requests so that its cross-request memory lives here. It offers one prompt (text,
token ids or a conversation, optionally streamed), compare (plain decoding on the same prompt,
alternating rounds, the speedup and whether the outputs are identical) and warm-up.

Loading is here too, and only here: names become objects (a model folder, a `.gguf` file or the
embedded default, a device and dtype; a `.sam` store checked against the model's tokenizer; a
draft model and heads checked against the target; a drafter for a method name), and the
cross-request memory is read from and written to an automaton store (`--memory-file`,
`--memory-save`). Decoding itself lives in `decode/`.

Every command (`generate`, `chat`, `bench`, `distill`, `calibrate`), `samctl.hf`, the trainers and
the Ray worker are adapters over this module; none of them builds an engine or a drafter itself.
JSONL records (one input line -> one output line) are `samctl.records`'s.
"""
from __future__ import annotations

import statistics
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import click
import numpy as np
import torch

from samctl.config import SessionConfig
from samctl.decode.acceptance_head import AcceptanceHead
from samctl.decode.configs import SamplingConfig
from samctl.decode.draft_model import DraftModel
from samctl.decode.drafters.base import Drafter, NoDraft
from samctl.decode.eagle_head import EagleHead
from samctl.decode.engine.cost import relative_cost
from samctl.decode.engine.cpu_linear import apply_cpu_linear
from samctl.decode.engine.graphs import enable_cuda_graphs
from samctl.decode.engine.native import backend_name, use_backend
from samctl.decode.engine.target import TargetModel
from samctl.decode.loop import GenerationConfig, GenerationResult, generate as decode_generate, prompt_error
from samctl.decode.methods import DRAFT_METHODS, MethodConfig, make_drafter, method as method_entry, uses_store
from samctl.decode.metrics import first_difference
from samctl.gguf_cache import first_line, model_folder
from samctl.index.automaton import SuffixAutomaton
from samctl.index.datastore import BuildConfig, CorpusStats, Datastore, StoreMeta, save_datastore
from samctl.index.errors import ConfigError, UserError
from samctl.index.load import load_datastore
from samctl.tokenizer import DEFAULT_MODEL_DIR, check_store_tokenizer, tokenizer_fingerprint


# ---------------------------------------------------------------------------------------------
# loading: names on the command line become objects

# The embedded default pair: the draft sits next to the default target. No SpecDec++ head ships
# (one trained on other weights of the pair predicted badly); one trained into these folders by
# `samctl train acc-head` becomes the embedded pair's default.
DEFAULT_DRAFT_DIR = DEFAULT_MODEL_DIR.parent / "draft"
DEFAULT_HEAD_DIR = DEFAULT_MODEL_DIR.parent / "acc_head"  # the paper's labels min(1, p/q) at T = 1
DEFAULT_GREEDY_HEAD_DIR = DEFAULT_MODEL_DIR.parent / "acc_head_greedy"  # labels: argmax matches
DEFAULT_EAGLE_DIR = DEFAULT_MODEL_DIR.parent / "eagle_head"  # EAGLE head of the embedded target
# What the embedded model is for, said whenever it is used: its rewrites are fast and exactly
# plain decoding's, not correct; a real model is one command away (README, "A real model").
EMBEDDED_MODEL_NOTE = (
    f"samctl: using the embedded default model ({DEFAULT_MODEL_DIR.parent.name}/{DEFAULT_MODEL_DIR.name}, 5.9M "
    "parameters): tiny, to show speed and exactness, not correct answers or edits; for a real model run "
    "`samctl fetch smollm2` and pass --model models/SmolLM2-135M-Instruct.Q4_1.gguf")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Engine:
    """A loaded target model with its tokenizer, ready to decode."""

    name: str  # the folder or name it was loaded from
    model: torch.nn.Module
    tokenizer: object  # a transformers tokenizer
    target: TargetModel
    eos_token_ids: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def encode(self, text: str, chat: bool) -> list[int]:
        return self.encode_conversation([{"role": "user", "content": text}], chat)

    def encode_conversation(self, messages: list[dict[str, str]], chat: bool) -> list[int]:
        """Multi-turn: the chat template over the whole conversation, or the turns joined by blank lines."""
        if not chat:
            return self.tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("model {name} has no chat template: drop {chat}", name=self.name)
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise ConfigError("{device} {value!r} is not a device: use auto, cpu, cuda or cuda:N", value=device) from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("{device} cuda, but no CUDA device is available: use {device} cpu")
    return resolved


def resolve_dtype(dtype: str, device: torch.device, config_dtype: torch.dtype | None = None) -> torch.dtype:
    """`auto`: float32 on the CPU (fast enough, and greedy output then equals plain greedy decoding
    token for token). On a GPU the dtype the model was saved in (config `dtype`): bfloat16 stays
    bfloat16, float16 stays float16; float32 or unknown becomes bfloat16, which has float32's
    range (no overflow in a model never run in float16), else float16 where bfloat16 is
    unsupported. Half precision keeps sampling lossless, but verifying several tokens runs other
    kernels than one-token decoding, so greedy output can differ at near-ties."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_ok else torch.float16


def _config_dtype(model: str) -> torch.dtype | None:
    # The dtype a model folder or hub-cache name declares, or None when it declares none.
    from transformers import AutoConfig

    try:
        declared = getattr(AutoConfig.from_pretrained(model, local_files_only=True), "dtype", None)
    except (OSError, ValueError, KeyError):
        return None  # the model load below reports the problem
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else None


def load_engine(model: str | None, device: str = "auto", dtype: str = "auto", quiet: bool = False,
                quantize: str = "none", prepack: bool = True, backend: str = "auto") -> Engine:
    """Load a causal LM and its tokenizer from a local folder, a `.gguf` file (dequantized once and
    cached, see samctl/gguf_cache.py) or the local HF cache (never a download). On a CPU its linear
    layers run as `quantize` and `prepack` say (decode/engine/cpu_linear.py); pass prepack=False
    to train the model's weights. `backend` picks the forward (decode/engine/native.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bars would break the one-line-error and stderr contracts
    # transformers' warnings (deprecations, generation-flag notes) address developers of code that
    # calls it, which here is samctl, not its user; samctl says what a user can act on itself.
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")

    if model is None:
        if not DEFAULT_MODEL_DIR.is_dir():
            raise ConfigError("no {model} given and the embedded default model is missing ({folder}): "
                              "pass {model} with a local model folder", folder=DEFAULT_MODEL_DIR)
        model = str(DEFAULT_MODEL_DIR)
        if not quiet:
            click.echo(EMBEDDED_MODEL_NOTE, err=True)
    if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        raise UserError(f"model folder {model} has no config.json: pass a folder written by save_pretrained")
    torch_device = resolve_device(device)
    folder = model_folder(model, quiet)  # a .gguf becomes its cached, dequantized folder
    declared = _config_dtype(folder) if dtype == "auto" and torch_device.type != "cpu" else None
    torch_dtype = resolve_dtype(dtype, torch_device, declared)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        hf_model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True,
            # straight onto the GPU: no whole host copy of the weights first (16 GB for an 8B)
            device_map=torch_device if torch_device.type == "cuda" else None,
        )
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError("cannot load model {name} offline ({reason}): pass {model} with a local "
                          "folder holding config.json, weights and tokenizer files", name=model,
                          reason=first_line(err)) from err
    hf_model.to(torch_device).eval()
    apply_cpu_linear(hf_model, quantize, prepack)
    return engine_for(hf_model, tokenizer, name=model, backend=backend)


def engine_for(model: torch.nn.Module, tokenizer: object | None, name: str | None = None,
               backend: str = "auto") -> Engine:
    """An Engine around a causal LM that is already loaded (the Python API's entry); the model is
    switched to sdpa attention if it uses one that ignores samctl's tree mask (decode/target.py).
    With the native backend the forward reads the model's weights once, here: a model whose
    weights change afterwards (training) wants backend="hf"."""
    use_backend(model, backend)
    return Engine(
        name=name or str(getattr(model, "name_or_path", "") or type(model).__name__),
        model=model,
        tokenizer=tokenizer,
        target=TargetModel(model),
        eos_token_ids=_eos_ids(model, tokenizer),
    )


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(int(i) for i in ids))


def load_store(path: str | None, engine: Engine, occurrence: str = "first") -> Datastore | None:
    """Load a store and check that it was built with the model's tokenizer."""
    if path is None:
        return None
    store = load_datastore(path, occurrence=occurrence)
    check_store_tokenizer(store.meta, str(path), tokenizer_fingerprint(engine.tokenizer), engine.name)
    return store


def resolve_draft_paths(method: str, model: str | None, draft: str | None, head: str | None,
                        quiet: bool = False, greedy: bool = False) -> tuple[str | None, str | None]:
    """(draft model folder, acceptance head folder) that `method` runs with, or None where unused.
    Without --draft-model, the embedded default draft serves the embedded default target only, and
    its embedded head is the one trained for the decoding mode (`greedy`) when there is one."""
    def note(text: str) -> None:
        if not quiet:
            click.echo(f"samctl: {text}", err=True)

    if method not in DRAFT_METHODS:
        for flag, value in (("--draft-model", draft), ("--acc-head", head)):
            if value is not None:
                note(f"note: method {method} does not use {flag}")
        return None, None
    if draft is None:
        if model is not None or not DEFAULT_DRAFT_DIR.is_dir():
            raise ConfigError("method {method} needs a draft model: pass {draft_model} with a small model that "
                              "shares the target's tokenizer", method=method)
        draft = str(DEFAULT_DRAFT_DIR)
        note(f"using the embedded default draft model ({DEFAULT_DRAFT_DIR.parent.name}/{DEFAULT_DRAFT_DIR.name}); "
             "pass --draft-model to choose another")
    if not method_entry(method).needs_head:
        if head is not None:
            note(f"note: method {method} does not use --acc-head")
        return draft, None
    if head is None:
        if draft != str(DEFAULT_DRAFT_DIR) or not DEFAULT_HEAD_DIR.is_dir():
            raise _train_head_hint(method, model, draft, greedy)
        chosen = DEFAULT_GREEDY_HEAD_DIR if greedy and DEFAULT_GREEDY_HEAD_DIR.is_dir() else DEFAULT_HEAD_DIR
        head = str(chosen)
        note(f"using the embedded default acceptance head ({chosen.parent.name}/{chosen.name})")
    return draft, head


def _train_head_hint(method: str, model: str | None, draft: str, greedy: bool) -> ConfigError:
    """How to get the acceptance head specdec++ lacks: none ships, since a head predicts well only
    for the exact target and draft weights it was trained on."""
    target = model or str(DEFAULT_MODEL_DIR)
    mode = " --label-mode greedy --response-temperature 0" if greedy else ""
    return ConfigError(
        "method {method} needs an acceptance head trained for this target and draft (none ships with samctl): "
        "train one (about 10 minutes on a CPU for the embedded pair) with `samctl train acc-head "
        "--target {target} --draft {draft} --prompts PROMPTS.json{mode} --out acc_head` (PROMPTS.json: an "
        "Alpaca-style list of {{\"instruction\": ...}}), then pass {acc_head} acc_head; or use a method without "
        "a head", method=method, target=target, draft=draft, mode=mode)


def load_draft(path: str, engine: Engine) -> DraftModel:
    """Load a draft model next to the engine's target (same device and dtype); its tokenizer must
    map text to the same ids as the target's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, path = path, model_folder(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"draft model {source} has no loadable tokenizer ({first_line(err)}): the draft must "
                        "ship the tokenizer it shares with the target (copy the target's tokenizer files "
                        "there if it was trained with it)") from err
    draft_fp, target_fp = tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(engine.tokenizer)
    if draft_fp != target_fp:
        raise UserError(f"draft model {source} uses another tokenizer than the target {engine.name} "
                        f"(fingerprints {draft_fp} and {target_fp}): pass a draft trained with the target's tokenizer")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=engine.target.dtype, attn_implementation="sdpa", local_files_only=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError("cannot load draft model {source} offline ({reason}): pass {draft_model} "
                          "with a local folder holding config.json, weights and tokenizer files", source=source,
                          reason=first_line(err)) from err
    model.to(engine.device).eval()
    return DraftModel(model, vocab_limit=engine.vocab_size)


def load_acc_head(path: str, engine: Engine, draft: DraftModel) -> AcceptanceHead:
    """Load a SpecDec++ acceptance head, refusing one trained for another target/draft pair."""
    from samctl.heads import load_head, model_fingerprint

    # The draft's tokenizer was checked equal to the target's in load_draft.
    return load_head(path, model_fingerprint(engine.model, engine.tokenizer),
                     model_fingerprint(draft.model, engine.tokenizer), engine.device)


def resolve_eagle_path(method_name: str, model: str | None, path: str | None, quiet: bool = False) -> str | None:
    """The EAGLE head folder `method_name` runs with, or None where unused. Without --eagle-head the
    embedded head serves the embedded default target only."""
    if not method_entry(method_name).needs_eagle:
        if path is not None and not quiet:
            click.echo(f"samctl: note: method {method_name} does not use --eagle-head", err=True)
        return None
    if path is not None:
        return path
    installed = installed_eagle_head(model) if model is not None else None
    if installed is not None and installed.is_dir():
        if not quiet:
            click.echo(f"samctl: using the EAGLE head installed beside the model ({installed})", err=True)
        return str(installed)
    if model is not None or not DEFAULT_EAGLE_DIR.is_dir():
        raise ConfigError("method {method} needs an EAGLE head: pass {eagle_head} with a folder written by "
                          "`samctl train eagle` for this model", method=method_name)
    if not quiet:
        click.echo(f"samctl: using the embedded EAGLE head ({DEFAULT_EAGLE_DIR.parent.name}/{DEFAULT_EAGLE_DIR.name})",
                   err=True)
    return str(DEFAULT_EAGLE_DIR)


def installed_eagle_head(model: str) -> Path:
    """Where a model file's EAGLE head is found without --eagle-head (`samctl fetch` puts the
    shipped one there): beside it, named after it, models/X.gguf -> models/X.eagle/."""
    return Path(model).with_suffix(".eagle")


def load_eagle(path: str, engine: Engine) -> EagleHead:
    """Load an EAGLE head bound to the engine's target, refusing one trained for another model."""
    from samctl.heads import load_eagle_head, model_fingerprint

    return load_eagle_head(path, engine.model, model_fingerprint(engine.model, engine.tokenizer))


def build_drafter(name: str, engine: Engine, store: Datastore | None, config: MethodConfig,
                  draft: DraftModel | None = None, head: AcceptanceHead | None = None,
                  sampling: SamplingConfig = SamplingConfig(), quiet: bool = False,
                  eagle: EagleHead | None = None) -> Drafter:
    """The drafter of method `name` for this engine; methods that size drafts by the verify cost
    get the engine's measured curve (cached per model and device; measured on first use)."""
    from samctl.costs import cost_curve

    if store is not None and not uses_store(name) and not quiet:
        click.echo(f"samctl: note: method {name} does not use the store {store.path}", err=True)
    cost = relative_cost(cost_curve(engine, quiet=quiet)) if method_entry(name).sized_by_cost else None
    return make_drafter(name, vocab_size=engine.vocab_size, device=engine.device, eos_token_ids=engine.eos_token_ids,
                        static=store.structure if store is not None and uses_store(name) else None, config=config,
                        draft=draft, head=head, sampling=sampling, cost=cost, target=engine.target, eagle=eagle)


# ---------------------------------------------------------------------------------------------
# cross-request memory on disk: an automaton store, one document per remembered output


def load_memory(path: str, engine: Engine, drafter) -> int:
    """Preload the drafter's memory from a store; returns the number of documents."""
    if not drafter.keeps_memory:
        raise UserError(f"method {drafter.name} keeps no memory across requests: drop --memory-file "
                        "or use --method adaptive, lookahead or ouroboros")
    store = load_store(path, engine)
    if not isinstance(store.structure, SuffixAutomaton):
        raise UserError(f"{path} is not a single automaton store: a memory file is one .sam automaton store "
                        "(samctl build --kind sam without --shards, or one written by --memory-save)")
    tokens = np.asarray(store.structure.tokens)
    ends = np.flatnonzero(tokens < 0)
    starts = np.concatenate(([0], ends[:-1] + 1))
    documents = [tokens[s:e] for s, e in zip(starts, ends) if e > s]
    drafter.load_memory(documents)
    return len(documents)


def save_memory(path: str, engine: Engine, drafter) -> int:
    """Write the drafter's memory as an automaton store; returns the number of documents."""
    if not drafter.keeps_memory:
        raise UserError(f"method {drafter.name} keeps no memory across requests: drop --memory-save")
    documents = [np.asarray(d, dtype=np.int32) for d in drafter.memory_documents() if len(d)]
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in documents]))).astype(np.int64)
    automaton = SuffixAutomaton.build(tokens, offsets)
    eos = engine.eos_token_ids[0] if engine.eos_token_ids else None
    meta = StoreMeta(tokenizer_name=engine.name, tokenizer_fingerprint=tokenizer_fingerprint(engine.tokenizer),
                     vocab_size=engine.vocab_size, eos_token_id=eos,
                     build=BuildConfig(kind="sam", append_eos=False),
                     corpus=CorpusStats(documents=len(documents), tokens=int(len(tokens)),
                                        inputs=(f"memory of {Path(path).name}",)))
    save_datastore(path, automaton, meta)
    return len(documents)


# ---------------------------------------------------------------------------------------------
# the session


WARM_UP_TOKENS = 32
BATCH_MAX_WIDTH = 16  # most draft nodes a row verifies per batched step


class _Loaded:
    """What several sessions of one process share: the engine, the store and the models that
    drafters run with (draft model, acceptance heads, EAGLE head), each loaded once on first use."""

    def __init__(self, engine: Engine, store: Datastore | None) -> None:
        self.engine, self.store = engine, store
        self._models: dict[tuple[Callable, str], Any] = {}

    def load(self, loader: Callable[..., Any], path: str | None, *args: Any) -> Any:
        """loader(path, engine, *args) (load_draft, load_acc_head, load_eagle), once per loader and
        path; None without a path."""
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
        paths = None
        if _shared is None:
            if config.threads is not None:  # validated by SessionConfig
                torch.set_num_threads(config.threads)
            self._note_sampling()
            paths = self._resolve_paths()  # a missing draft model or head is refused before the model loads
            engine = load_engine(config.model, config.device, config.dtype, quiet=config.quiet,
                                 quantize=config.quantize, prepack=config.prepack, backend=config.backend)
            enable_cuda_graphs(engine.target, config.graphs)
            _shared = _Loaded(engine, load_store(config.store, engine, config.occurrence))
        self._shared = _shared
        self.engine: Engine = _shared.engine
        self.method_config = config.method_config(self.engine.device)
        draft_path, head_path, eagle_path = paths or self._resolve_paths()  # resolved (and said) once
        self._draft = _shared.load(load_draft, draft_path)
        self._head = _shared.load(load_acc_head, head_path, self._draft)
        self._eagle = _shared.load(load_eagle, eagle_path)
        self.generation = GenerationConfig(max_new_tokens=config.max_new_tokens,
                                           eos_token_ids=self.engine.eos_token_ids, sampling=config.sampling)
        self.drafter = self._build_drafter(quiet=config.quiet)
        if config.memory_file:
            load_memory(config.memory_file, self.engine, self.drafter)
        self.record = {"method": config.method, "model": self.engine.name, "backend": backend_name(self.engine.model),
                       "store": config.store,
                       "draft_model": draft_path, "acc_head": head_path, "eagle_head": eagle_path,
                       "config": {"session": config.to_record(), "generation": asdict(self.generation),
                                  "method": asdict(self.method_config)}}
        self.warm = False  # warm_up has run (batch 1)
        self.batch_warm = False  # and the batched engine's warm-up (_warm_up_batched)
        self._room_noted = False

    @classmethod
    def over(cls, engine: Engine, config: SessionConfig, store: Datastore | None = None) -> "Session":
        """A session on an engine that is already built (samctl.hf wraps a loaded model in one);
        config.model, device, dtype, threads, graphs and store are not read."""
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
    def draft_model(self):
        """The draft model the method runs with (decode.draft_model.DraftModel), or None."""
        return self._draft

    # -- text ----------------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int] | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt: text, ids as they are, or a conversation (a list of messages)."""
        if isinstance(prompt, str):
            return self.engine.encode(prompt, self.config.chat)
        if prompt and isinstance(prompt[0], dict):
            return self.engine.encode_conversation(list(prompt), self.config.chat)
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str:
        return self.engine.decode(ids)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int] | list[dict[str, str]], *, prediction: str | None = None,
                 on_tokens: Callable[[list[int]], bool | None] | None = None, drafter: Drafter | None = None,
                 max_new_tokens: int | None = None, sampling: SamplingConfig | None = None) -> GenerationResult:
        """Generate after `prompt` with the session's drafter (or `drafter`); `prediction` is the
        expected output (e.g. the file being edited), for the methods that draft from one, and
        its usage comes back in `result.prediction` where the drafter counts it. `on_tokens` may
        return True to stop (finish_reason "stop"). `max_new_tokens` and `sampling` override the
        configuration's for this request (a draft model keeps drafting with the configured
        sampling, which costs acceptance, never correctness)."""
        ids = self.encode(prompt)
        drafter = self.drafter if drafter is None else drafter
        self._note_room(ids)
        if not self.warm:
            self.warm_up(ids)
        generation = self.generation
        if max_new_tokens is not None or sampling is not None:
            generation = replace(generation, max_new_tokens=max_new_tokens or generation.max_new_tokens,
                                 sampling=sampling or generation.sampling)
        return decode_generate(self.engine.target, drafter, ids, generation, on_tokens=on_tokens,
                               prediction=self.prediction_ids(prediction))

    def generate_batch(self, prompts: Sequence[str | Sequence[int] | list[dict[str, str]]], *, batch_size: int = 8,
                       on_result: Callable[[Any], None] | None = None, stats: Any = None,
                       predictions: Sequence[str | None] | None = None) -> list:
        """Generate for every prompt with up to `batch_size` sequences in flight (named as
        transformers names its batched call), each record's output exactly its batch-1 output in
        float32; a finished row is refilled from the queue at once. Returns
        decode.loop.BatchResult per prompt, in input order; `on_result` sees each as it finishes.
        Every slot drafts with its own fresh drafter. `predictions[i]` is prompt i's expected
        output (or None), drafted from by its own row only; its usage comes back in the result's
        `prediction`. Methods without a batched form (draft models, EAGLE, SDSAT) are refused:
        run them one prompt at a time."""
        from samctl.decode.loop import generate_batch, require_batchable

        require_batchable(self.config.method)
        ids = [self.encode(p) for p in prompts]
        expected = None if predictions is None else [self.prediction_ids(p) for p in predictions]
        cost_ms = self._batch_cost(batch_size)
        if not self.batch_warm:  # else the first records' metrics carry the JIT loads (or compiles)
            self._warm_up_batched(ids, cost_ms)
        return generate_batch(self.engine.model, self.fresh_drafter, ids, self.generation, batch_size, on_result,
                              cost_ms=cost_ms, max_width=BATCH_MAX_WIDTH, stats=stats, predictions=expected,
                              graphs=self.config.graphs)

    def batch_run(self, batch_size: int, stop: Callable[[], bool] | None = None):
        """An empty decode.loop.BatchRun on this session's engine, for records submitted one by
        one (the server's scheduler); any session of the engine may submit to it. Measuring its
        verify cost (once per model and batch size) stops between two forwards when `stop()` is
        true (decode.engine.cost.Stopped)."""
        from samctl.decode.loop import BatchRun

        return BatchRun(self.engine.model, batch_size, cost_ms=self._batch_cost(batch_size, stop),
                        max_width=BATCH_MAX_WIDTH, graphs=self.config.graphs)

    def batch_refusal(self) -> str:
        """Why this session cannot run on the batched engine ("" when it can)."""
        from samctl.decode.loop import batch_refusal

        return batch_refusal(self.config.method)

    def _batch_cost(self, batch_size: int, stop: Callable[[], bool] | None = None) -> np.ndarray:
        from samctl.costs import batch_cost_curve

        return np.asarray(batch_cost_curve(self.engine, batch_size, BATCH_MAX_WIDTH, quiet=self.config.quiet,
                                           stop=stop))

    def fresh_drafter(self) -> Drafter:
        """A new drafter of the session's method that shares nothing learned with the kept one;
        a draft model's cache is its own too (the weights are shared), so that drafters can run
        side by side (the batched engine's rows)."""
        return build_drafter(self.config.method, self.engine, self.store, self.method_config,
                             draft=None if self._draft is None else self._draft.fork(), head=self._head,
                             sampling=self.config.sampling, quiet=True, eagle=self._eagle)

    def warm_up(self, ids: list[int]) -> None:
        """Run a throwaway drafter and plain decoding once, so that JIT cache loads, lazy imports
        and allocator growth are paid outside every timed run. On the prompt itself, so that the
        drafter takes the paths the timed runs take; with a throwaway drafter, because warming the
        kept one would teach it (Token Recycle, memories) this very prompt."""
        self.warm = True
        warm = GenerationConfig(max_new_tokens=WARM_UP_TOKENS, eos_token_ids=(), sampling=self.config.sampling)
        drafter = self.fresh_drafter()
        for _ in range(2):  # the second run drafts from what the first taught it: other kernels, or other types
            decode_generate(self.engine.target, drafter, ids, warm)
        decode_generate(self.engine.target, NoDraft(), ids, warm)

    def _warm_up_batched(self, prompts: list[list[int]], cost_ms: np.ndarray) -> None:
        """warm_up, then the same throwaway run through the batched engine, whose drafters take
        paths of their own (scored proposals), on the first prompt the model can continue (the
        others get their errors in the batch)."""
        from samctl.decode.loop import generate_batch

        for ids in prompts:
            if not prompt_error(np.asarray(ids), self.engine.target.max_positions):
                if not self.warm:
                    self.warm_up(ids)
                self.batch_warm = True
                warm = GenerationConfig(max_new_tokens=WARM_UP_TOKENS, eos_token_ids=(), sampling=self.config.sampling)
                # twice through one slot, whose drafter drafts from the first record in the second
                generate_batch(self.engine.model, self.fresh_drafter, [ids, ids], warm, 1, cost_ms=cost_ms,
                               max_width=BATCH_MAX_WIDTH)
                return

    def compare(self, prompt: str | Sequence[int] | list[dict[str, str]], result: GenerationResult,
                runs: int = 1) -> dict[str, Any]:
        """Plain decoding (ar) on the same prompt; with runs > 1, more rounds of (fresh drafter,
        ar) in alternating order, so that a drift of the machine hits both sides alike. The speedup
        is the median of the per-round ratios of tokens/s; every round's greedy output must equal
        the first ar's."""
        ids = self.encode(prompt)
        rounds = [(result, self.generate(ids, drafter=NoDraft()))]
        for k in range(1, runs):
            if k % 2:
                baseline = self.generate(ids, drafter=NoDraft())
                rounds.append((self.generate(ids, drafter=self.fresh_drafter()), baseline))
            else:
                method = self.generate(ids, drafter=self.fresh_drafter())
                rounds.append((method, self.generate(ids, drafter=NoDraft())))
        reference = rounds[0][1].tokens
        diffs = [first_difference(r.tokens, reference) for pair in rounds for r in pair]
        first_diff = next((d for d in diffs if d is not None), None)
        greedy = self.config.sampling.greedy
        # On a CPU the ratio is of tokens per CPU-second of this process: the wall clock also counts
        # the time other processes hold the cores, which slows plain decoding's many small forwards
        # more than the method's few large ones (BENCHMARKS.md, "--compare under load"); the
        # wall-clock ratio is reported beside it.
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

    def save_memory(self, path: str) -> int:
        """Write the drafter's memory of outputs to a store; returns the number of outputs."""
        return save_memory(path, self.engine, self.drafter)

    # -- building ------------------------------------------------------------------------------

    def _resolve_paths(self) -> tuple[str | None, str | None, str | None]:
        c = self.config
        draft, head = resolve_draft_paths(c.method, c.model, c.draft_model, c.acc_head, quiet=c.quiet,
                                          greedy=c.sampling.greedy)
        return draft, head, resolve_eagle_path(c.method, c.model, c.eagle_head, quiet=c.quiet)

    def _build_drafter(self, quiet: bool) -> Drafter:
        return build_drafter(self.config.method, self.engine, self.store, self.method_config, draft=self._draft,
                             head=self._head, sampling=self.config.sampling, quiet=quiet, eagle=self._eagle)

    def _note_room(self, ids: list[int]) -> None:
        """Once per session: a prompt that leaves less of the model's context than max_new_tokens."""
        context = self.engine.target.max_positions
        room = context - len(ids)
        if self._room_noted or self.config.quiet or not 0 < room < self.config.max_new_tokens:
            return
        self._room_noted = True
        click.echo(f"samctl: note: the prompt is {len(ids)} tokens of the model's {context}-token context: at most "
                   f"{room} new tokens fit, fewer than --max-new-tokens {self.config.max_new_tokens}", err=True)

    def _note_sampling(self) -> None:
        c = self.config
        if not c.sampling.greedy and not method_entry(c.method).lossless and not c.quiet:
            click.echo(f"samctl: note: {c.method} is not lossless when sampling: its outputs do not "
                       "follow the model's distribution (use sdsat for that)", err=True)

    def prediction_ids(self, prediction: str | None) -> list[int] | None:
        """A request's expected output as token ids (tokenized as plain text); None for none."""
        return None if not prediction else self.engine.tokenizer(prediction, add_special_tokens=False)["input_ids"]


def _cpu_ratio(method: GenerationResult, base: GenerationResult) -> float:
    """Tokens per CPU-second of the method over the same for plain decoding."""
    m, b = method.metrics, base.metrics
    if m.cpu_s <= 0 or b.cpu_s <= 0 or not b.new_tokens:
        return 0.0
    return (m.new_tokens / m.cpu_s) / (b.new_tokens / b.cpu_s)
