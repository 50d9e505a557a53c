"""What a session loads, decided before anything loads: `plan(config)` resolves every path once.

A method's draft model, acceptance head or EAGLE head is the one given, the one installed beside
the model, the one that ships for the model or the embedded pair's; a missing one is refused here.
What was chosen unasked, or given but unused, comes back as notes (data) for the caller to log.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from samctl.config import SessionConfig
from samctl.decode.methods import method as method_entry, missing
from samctl.fetch import installed_eagle_head, shipped_eagle_head
from samctl.index.errors import ConfigError, Note
from samctl.tokenizer import DEFAULT_MODEL_DIR, is_path_like

# The embedded default pair: the draft sits next to the default target. No SpecDec++ head ships
# (one trained on other weights of the pair predicted badly); one trained into these folders by
# `samctl train acc-head` becomes the embedded pair's default.
DEFAULT_DRAFT_DIR = DEFAULT_MODEL_DIR.parent / "draft"
DEFAULT_HEAD_DIR = DEFAULT_MODEL_DIR.parent / "acc_head"  # the paper's labels min(1, p/q) at T = 1
DEFAULT_GREEDY_HEAD_DIR = DEFAULT_MODEL_DIR.parent / "acc_head_greedy"  # labels: argmax matches
DEFAULT_EAGLE_DIR = DEFAULT_MODEL_DIR.parent / "eagle_head"  # EAGLE head of the embedded target
EMBEDDED_MODEL_ID = "default"  # the model id clients send to a server or batch on the embedded model
# What the embedded model is for, said whenever it is used: its rewrites are fast and exactly
# plain decoding's, not correct; a real model is one command away (README, "A real model").
EMBEDDED_MODEL_NOTE = Note(
    "using the embedded default model ({where}, 5.9M parameters): tiny, to show speed and exactness, not correct "
    "answers or edits; for a real model run `samctl fetch smollm2` and pass {model} models/SmolLM2-135M-Instruct.Q4_1.gguf",
    where=f"{DEFAULT_MODEL_DIR.parent.name}/{DEFAULT_MODEL_DIR.name}")


@dataclass(frozen=True)
class Plan:
    """The files a SessionConfig resolves to, and what was said while choosing them."""

    model: str  # a folder, a .gguf file or a hub-cache name: as given, or the embedded default's folder
    draft_model: str | None
    acc_head: str | None
    eagle_head: str | None
    notes: tuple[str | Note, ...]  # for the `samctl` logger, in the order they arose


def plan(config: SessionConfig) -> Plan:
    """Every path `config` names or implies, resolved once; ConfigError for a required one missing."""
    c, notes = config, []
    entry = method_entry(c.method)
    if not c.sampling.greedy and not entry.lossless:
        notes.append(f"note: {c.method} is not lossless when sampling: its outputs do not follow the model's "
                     "distribution (use sdsat for that)")
    notes.extend(Note(f"note: method {{method}} does not use {{{name}}}", method=c.method)
                 for name in ("draft_model", "acc_head", "eagle_head")
                 if getattr(c, name) is not None and name not in entry.requires)
    refuse_missing(c.model, "model")
    draft, head = resolve_draft_paths(c.method, c.model, c.draft_model, c.acc_head, notes, greedy=c.sampling.greedy)
    refuse_missing(draft, "draft_model")
    eagle = resolve_eagle_path(c.method, c.model, c.eagle_head, notes)
    if c.model is None:
        notes.append(EMBEDDED_MODEL_NOTE)  # default_model() below refuses a missing one
    if c.store is not None and not entry.uses_store:
        notes.append(f"note: method {c.method} does not use the store {c.store}")
    return Plan(c.model if c.model is not None else default_model(), draft, head, eagle, tuple(notes))


def refuse_missing(path: str | None, field: str) -> None:
    """Refuse a model named by a local path that is not there, before Hugging Face reads the name
    as a hub repository's (and words its complaint about that)."""
    if path is not None and is_path_like(path) and not Path(path).expanduser().exists():
        raise ConfigError(f"{field.replace('_', ' ')} {{path}} does not exist: pass {{{field}}} with a model "
                          "folder or a .gguf file", path=path)


def default_model() -> str:
    if not DEFAULT_MODEL_DIR.is_dir():
        raise ConfigError("no {model} given and the embedded default model is missing ({folder}): "
                          "pass {model} with a local model folder", folder=DEFAULT_MODEL_DIR)
    return str(DEFAULT_MODEL_DIR)


def resolve_draft_paths(method: str, model: str | None, draft: str | None, head: str | None, notes: list[str],
                        greedy: bool = False) -> tuple[str | None, str | None]:
    """(draft model folder, acceptance head folder) that `method` runs with, or None where unused.
    Without a draft model, the embedded default draft serves the embedded default target only, and
    its embedded head is the one trained for the decoding mode (`greedy`) when there is one."""
    requires = method_entry(method).requires
    if "draft_model" not in requires:
        return None, None
    if draft is None:
        if model is not None or not DEFAULT_DRAFT_DIR.is_dir():
            raise missing(method, "draft_model")
        draft = str(DEFAULT_DRAFT_DIR)
        notes.append(Note("using the embedded default draft model ({where}); pass {draft_model} to choose another",
                          where=f"{DEFAULT_DRAFT_DIR.parent.name}/{DEFAULT_DRAFT_DIR.name}"))
    if "acc_head" not in requires:
        return draft, None
    if head is None:
        if draft != str(DEFAULT_DRAFT_DIR) or not DEFAULT_HEAD_DIR.is_dir():
            raise _train_head_hint(method, model, draft, greedy)
        chosen = DEFAULT_GREEDY_HEAD_DIR if greedy and DEFAULT_GREEDY_HEAD_DIR.is_dir() else DEFAULT_HEAD_DIR
        head = str(chosen)
        notes.append(f"using the embedded default acceptance head ({chosen.parent.name}/{chosen.name})")
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


def resolve_eagle_path(method: str, model: str | None, path: str | None, notes: list[str]) -> str | None:
    """The EAGLE head folder `method` runs with, or None where unused. Without one given, the head
    installed beside the model, else the embedded head, which serves the embedded default target only."""
    if "eagle_head" not in method_entry(method).requires:
        return None
    if path is not None:
        return path
    if model is not None:
        if (installed := installed_eagle_head(model)).is_dir():
            notes.append(f"using the EAGLE head installed beside the model ({installed})")
            return str(installed)
        if (shipped := shipped_eagle_head(model)) is not None:
            notes.append(f"using the EAGLE head that ships with samctl for this model ({shipped})")
            return str(shipped)
    if model is not None or not DEFAULT_EAGLE_DIR.is_dir():
        raise missing(method, "eagle_head")
    notes.append(f"using the embedded EAGLE head ({DEFAULT_EAGLE_DIR.parent.name}/{DEFAULT_EAGLE_DIR.name})")
    return str(DEFAULT_EAGLE_DIR)
