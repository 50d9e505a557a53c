"""Loading what `generate` and `bench` run on: the model, its tokenizer, a store, the drafter.

This is where names on the command line become objects: a model folder (or the embedded
default), a device and dtype, a `.sam` store checked against the model's tokenizer, and a
drafter for a method name. Decoding itself lives in `decode/`.
"""
from __future__ import annotations

import warnings

from dataclasses import dataclass
from pathlib import Path

import click
import torch

from samctl.decode.acceptance_head import AcceptanceHead
from samctl.decode.draft_model import DraftModel
from samctl.decode.engine.cost import relative_cost
from samctl.decode.engine.cpu_linear import apply_cpu_linear
from samctl.decode.eagle_head import EagleHead
from samctl.decode.methods import DRAFT_METHODS, MethodConfig, make_drafter, method as method_entry, uses_store
from samctl.decode.drafters.base import Drafter
from samctl.decode.sampling import SamplingConfig
from samctl.decode.engine.target import TargetModel
from samctl.index.datastore import Datastore
from samctl.index.load import load_datastore
from samctl.index.errors import ConfigError, UserError
from samctl.gguf_cache import model_folder
from samctl.tokenizer import DEFAULT_MODEL_DIR, check_store_tokenizer, tokenizer_fingerprint

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
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError("model {name} has no chat template: drop {chat}", name=self.name)
            messages = [{"role": "user", "content": text}]
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def encode_conversation(self, messages: list[dict[str, str]], chat: bool) -> list[int]:
        """Multi-turn: the chat template over the whole conversation, or the turns joined by blank lines."""
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError("model {name} has no chat template: drop {chat}", name=self.name)
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return self.encode("\n\n".join(m["content"] for m in messages), chat=False)

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
                quantize: str = "none", prepack: bool = True) -> Engine:
    """Load a causal LM and its tokenizer from a local folder, a `.gguf` file (dequantized once and
    cached, see samctl/gguf_cache.py) or the local HF cache (never a download). On a CPU its linear
    layers run as `quantize` and `prepack` say (decode/engine/cpu_linear.py); pass prepack=False
    to train the model's weights."""
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
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ConfigError("cannot load model {name} offline ({reason}): pass {model} with a local "
                          "folder holding config.json, weights and tokenizer files", name=model, reason=reason) from err
    hf_model.to(torch_device).eval()
    apply_cpu_linear(hf_model, quantize, prepack)
    return engine_for(hf_model, tokenizer, name=model)


def engine_for(model: torch.nn.Module, tokenizer: object | None, name: str | None = None) -> Engine:
    """An Engine around a causal LM that is already loaded (the Python API's entry); the model is
    switched to sdpa attention if it uses one that ignores samctl's tree mask (decode/target.py)."""
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
        raise UserError(f"draft model {source} has no loadable tokenizer ({_first_line(err)}): the draft must "
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
                          reason=_first_line(err)) from err
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
    from samctl.eagle_heads import load_eagle_head
    from samctl.heads import model_fingerprint

    return load_eagle_head(path, engine.model, model_fingerprint(engine.model, engine.tokenizer))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def build_drafter(name: str, engine: Engine, store: Datastore | None, config: MethodConfig,
                  draft: DraftModel | None = None, head: AcceptanceHead | None = None,
                  sampling: SamplingConfig = SamplingConfig(), quiet: bool = False,
                  eagle: EagleHead | None = None) -> Drafter:
    """The drafter of method `name` for this engine; methods that size drafts by the verify cost
    get the engine's measured curve (cached per model and device; measured on first use)."""
    from samctl.costs import cost_curve

    if store is not None and not uses_store(name) and not quiet:
        click.echo(f"samctl: note: method {name} does not use the store {Path(store.path).name}", err=True)
    cost = relative_cost(cost_curve(engine, quiet=quiet)) if method_entry(name).sized_by_cost else None
    return make_drafter(
        name,
        vocab_size=engine.vocab_size,
        device=engine.device,
        eos_token_ids=engine.eos_token_ids,
        static=store.structure if store is not None and uses_store(name) else None,
        config=config,
        draft=draft,
        head=head,
        sampling=sampling,
        cost=cost,
        target=engine.target,
        eagle=eagle,
    )
