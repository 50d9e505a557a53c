"""The method registry: the one place that maps a `--method` name to its drafter.

Each entry says what the method drafts from, what it needs (a store, a draft model, an acceptance
head), whether `simulate` can replay it without a model, and how to build it. `generate`,
`simulate`, `bench` and the Python API read this table; the CLI options of a method come from
the metadata of its config section's fields (`MethodConfig`, `samctl/options.py`). A new method is
its drafter module plus one entry in `REGISTRY`.

Importing this module loads neither torch nor numba (the command line reads the names and the
settings for `--help` and usage errors); a drafter's module is imported when it is built.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from samctl.decode.configs import (AdaptiveConfig, DraftConfig, EagleConfig, LookaheadConfig, OuroborosConfig,
                                   PldConfig, RecycleConfig, RestConfig, SamConfig, SamplingConfig, SdsatConfig,
                                   SpecDecConfig, setting_name)
from samctl.index.errors import ConfigError, UserError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from samctl.decode.acceptance_head import AcceptanceHead
    from samctl.decode.draft_model import DraftModel
    from samctl.decode.drafters.base import Drafter
    from samctl.decode.engine.cost import VerifyCost
    from samctl.decode.eagle_head import EagleHead
    from samctl.decode.engine.target import TargetModel
    from samctl.index.automaton import SuffixAutomaton
    from samctl.index.ngram import NgramTable


@dataclass(frozen=True)
class MethodConfig:
    """Settings of every drafter; each method reads its own section."""

    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    sam: SamConfig = field(default_factory=SamConfig)
    pld: PldConfig = field(default_factory=PldConfig)
    recycle: RecycleConfig = field(default_factory=RecycleConfig)
    rest: RestConfig = field(default_factory=RestConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    specdec: SpecDecConfig = field(default_factory=SpecDecConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    ouroboros: OuroborosConfig = field(default_factory=OuroborosConfig)
    sdsat: SdsatConfig = field(default_factory=SdsatConfig)
    eagle: EagleConfig = field(default_factory=EagleConfig)


@dataclass(frozen=True)
class Resources:
    """What a drafter may be built from."""

    vocab_size: int
    device: "torch.device"
    eos_token_ids: tuple[int, ...] = ()
    static: "SuffixAutomaton | NgramTable | None" = None
    config: MethodConfig = field(default_factory=MethodConfig)
    draft: DraftModel | None = None
    head: AcceptanceHead | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    cost: "VerifyCost | np.ndarray | None" = None  # relative verify cost t(1 + n) / t(1), n = 0, 1, ...
    target: TargetModel | None = None  # the engine's target, for methods that draft with its weights
    eagle: EagleHead | None = None


# What a method may require, by the configuration field that names it ("sat_model": a target
# fine-tuned with semantic adaptive tokens), and what the error says when it is missing.
REQUIREMENTS = {
    "draft_model": "method {method} needs a draft model: pass {draft_model} with a small model that shares the "
                   "target's tokenizer",
    "acc_head": "method {method} needs an acceptance head: pass {acc_head} (train one with `samctl train acc-head`)",
    "eagle_head": "method {method} needs an EAGLE head: pass {eagle_head} with a folder written by `samctl train "
                  "eagle` for this model",
    "sat_model": "method {method} drafts with the target itself: it needs the loaded target model",
}


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line: what it drafts from
    build: Callable[[Resources], "Drafter"]
    uses_store: bool = False
    # What it cannot run without (REQUIREMENTS), read by the session, samctl.hf and the engine.
    requires: frozenset[str] = frozenset()
    not_replayable: str = ""  # why `simulate` cannot replay it without a model ("" = it can)
    takes_prediction: bool = False  # drafts from an expected output (--prediction)
    sized_by_cost: bool = False  # sizes drafts by the target's verify-cost curve (samctl calibrate)
    lossless: bool = True  # False only for reference reproductions whose sampling is biased
    # The MethodConfig sections (or "section.field") its drafter reads; the other settings' flags do nothing.
    settings: tuple[str, ...] = ()
    # `simulate --sweep`: (config section, field) -> values; fields of `store_fields` count only
    # when a store is given
    sweep: dict[tuple[str, str], tuple] = field(default_factory=dict)
    store_fields: tuple[tuple[str, str], ...] = ()

    needs_draft = property(lambda self: "draft_model" in self.requires)
    needs_head = property(lambda self: "acc_head" in self.requires)
    needs_eagle = property(lambda self: "eagle_head" in self.requires)
    needs_sat_model = property(lambda self: "sat_model" in self.requires)

    def reads(self, setting: str) -> bool:
        """Whether its drafter reads `setting`, a MethodConfig "section.field" or a setting's name
        (`gamma`); the other settings' flags do nothing."""
        section = next((s for s, f in cli_fields() if setting_name(f) == setting), setting.split(".")[0])
        return section in self.settings or setting in self.settings


def _load(path: str) -> type:
    """A drafter class by its path under samctl.decode.drafters ("pld.PromptLookupDrafter"),
    imported when a drafter is first built: importing this module loads no torch."""
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"samctl.decode.drafters.{module}"), name)


# The factories of the drafters that several methods build (alone, or as the fallback of sam).
def _recycle(r: Resources) -> Drafter:
    return _load("recycle.TokenRecycleDrafter")(r.vocab_size, r.device, r.config.recycle)


def _draft(r: Resources, name: str) -> Drafter:
    length = _load("draft.FixedLength")(r.config.draft.gamma)
    return _load("draft.DraftModelDrafter")(r.draft, length, r.sampling, r.eos_token_ids, name)


def _specdec(r: Resources) -> Drafter:
    if r.head.config.hidden_size != r.draft.hidden_size:
        raise UserError(f"the acceptance head reads hidden size {r.head.config.hidden_size}, the draft model "
                        f"has {r.draft.hidden_size}: use the head trained for this draft model")
    length = _load("draft.AdaptiveLength")(r.head, r.config.specdec)
    return _load("draft.DraftModelDrafter")(r.draft, length, r.sampling, r.eos_token_ids, "specdec++")


def _sdsat(r: Resources, cls: str, *args: Any) -> Drafter:
    from samctl.decode.sdsat import read_settings

    name = getattr(r.target.model, "name_or_path", "") or "the model"
    return _load(cls)(r.target, read_settings(r.target.model.config, name), *args, r.config.sdsat)


def _eagle(r: Resources) -> Drafter:
    return _load("eagle.EagleDrafter")(r.eagle, r.config.eagle, r.cost)


def _sam(r: Resources, fallback: Drafter | None = None) -> Drafter:
    return _load("sam.SamDrafter")(r.config.sam, static=r.static, fallback=fallback)


_EAGLE = "its drafts come from a head over the target's hidden states"
_LOGITS = "its Token Recycle part learns from the target's logits"
_DRAFT_MODEL = "its drafts come from a draft model"
_DRAFT_MODEL_ONLY, _EAGLE_ONLY, _SAT_ONLY = (frozenset({need}) for need in ("draft_model", "eagle_head", "sat_model"))

REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("adaptive", "every retrieval source (prompt and output, store, memory of earlier requests, "
           "--prediction) and Token Recycle, scored and sized by the verify cost (the default)",
           lambda r: _load("adaptive.AdaptiveDrafter")(r.config.adaptive, r.static, r.cost, r.vocab_size, r.device),
           uses_store=True, takes_prediction=True, sized_by_cost=True, settings=("adaptive",),
           sweep={("adaptive", "max_nodes"): (8, 16, 32, 64), ("adaptive", "min_prob"): (0.01, 0.02, 0.035, 0.05, 0.1),
                  ("adaptive", "width"): (2, 3, 4)}),
    Method("ar", "nothing: plain decoding through the same loop, the baseline", lambda r: _load("base.NoDraft")()),
    Method("pld", "prompt lookup: the earliest earlier match of the last 1..3 tokens",
           lambda r: _load("pld.PromptLookupDrafter")(r.config.pld, r.eos_token_ids), settings=("pld",),
           sweep={("pld", "max_ngram"): (1, 2, 3, 4, 5), ("pld", "num_draft"): (5, 10, 20, 40)}),
    Method("sam", "SAM-Decoding: longest suffix match in the prompt/output automaton and the store",
           _sam, uses_store=True, settings=("sam",),
           sweep={("sam", "dyn_threshold"): (1, 2, 3, 5, 8), ("sam", "alpha"): (1.0, 4.0, 16.0),
                  ("sam", "max_draft"): (10, 20, 39, 60), ("sam", "static_bias"): (0, 5)},
           store_fields=(("sam", "static_bias"),)),
    Method("recycle", "Token Recycle: a static tree over each token's recorded likely successors", _recycle,
           not_replayable="Token Recycle learns its table from the target's logits", settings=("recycle",)),
    Method("sam+recycle", "sam when the match is long enough, Token Recycle otherwise",
           lambda r: _sam(r, fallback=_recycle(r)), uses_store=True,
           not_replayable=_LOGITS, settings=("sam", "recycle")),
    Method("rest", "REST: a tree of the most frequent continuations in the store",
           lambda r: _load("rest.RestDrafter")(r.config.rest, r.static), uses_store=True, settings=("rest",),
           sweep={("rest", "num_nodes"): (16, 32, 64), ("rest", "max_depth"): (4, 6, 10)}),
    Method("lookahead", "Lookahead decoding: a Jacobi window and an n-gram pool verified in the same forward "
           "(simulate replays the pool only)",
           lambda r: _load("lookahead.LookaheadDrafter")(r.config.lookahead, r.vocab_size, r.device, r.eos_token_ids),
           settings=("lookahead",)),
    Method("sd", "speculative decoding with a draft model (--gamma tokens)", lambda r: _draft(r, "sd"),
           requires=_DRAFT_MODEL_ONLY, not_replayable=_DRAFT_MODEL, settings=("draft",)),
    Method("specdec++", "a draft model whose acceptance head stops drafting", _specdec,
           requires=frozenset({"draft_model", "acc_head"}), not_replayable=_DRAFT_MODEL, settings=("specdec",)),
    Method("sam+draft", "sam when the match is long enough, the draft model otherwise",
           lambda r: _sam(r, fallback=_draft(r, "draft")), uses_store=True,
           requires=_DRAFT_MODEL_ONLY, not_replayable="its fallback is a draft model", settings=("sam", "draft")),
    Method("ouroboros", "Dual Decoding: the draft model runs lookahead with a shared n-gram pool; the target "
           "verifies its --gamma tokens plus the pool's suffixes",
           lambda r: _load("ouroboros.OuroborosDrafter")(r.draft, r.config.ouroboros, r.config.draft.gamma,
                                                          r.config.lookahead.pool_text, r.vocab_size),
           requires=_DRAFT_MODEL_ONLY, not_replayable=_DRAFT_MODEL,
           settings=("ouroboros", "draft", "lookahead.pool_text")),
    Method("sdsat", "SDSAT: a target fine-tuned with semantic adaptive tokens drafts k tokens for itself "
           "(`samctl train sdsat`)", lambda r: _sdsat(r, "sdsat.SdsatDrafter"), requires=_SAT_ONLY,
           not_replayable="its drafts come from the target's own forward at SAT tokens", settings=("sdsat",)),
    Method("sdsat-nucleus-reference", "NOT LOSSLESS when sampling: the SDSAT paper's nucleus variant (a static "
           "tree of sampled SAT candidates, the best of independently drawn paths), for comparison only",
           lambda r: _sdsat(r, "sdsat_nucleus.SdsatNucleusDrafter", r.sampling), requires=_SAT_ONLY, lossless=False,
           not_replayable="its drafts come from the target's own forward at SAT tokens", settings=("sdsat",)),
    Method("eagle", "EAGLE-2: a dynamic tree from a head trained on the target's hidden states (--eagle-head)",
           _eagle, requires=_EAGLE_ONLY, not_replayable=_EAGLE, sized_by_cost=True, settings=("eagle",)),
    Method("sam+eagle", "sam when the match is long enough, the EAGLE-2 tree otherwise",
           lambda r: _sam(r, fallback=_eagle(r)), uses_store=True,
           requires=_EAGLE_ONLY, not_replayable=_EAGLE, sized_by_cost=True, settings=("sam", "eagle")),
    Method("adaptive+eagle", "adaptive's candidates and the EAGLE-2 head's best nodes in one tree, each priced "
           "by its own calibrated estimate and cut by the verify cost",
           lambda r: _load("eagle.AdaptiveEagleDrafter")(_eagle(r), config=r.config.adaptive, static=r.static,
                                                         cost=r.cost, vocab_size=r.vocab_size, device=r.device),
           uses_store=True, requires=_EAGLE_ONLY, not_replayable=_EAGLE, takes_prediction=True, sized_by_cost=True,
           settings=("adaptive", "eagle")),
)}

DEFAULT_METHOD = "adaptive"
# Methods that run on any target with nothing trained for it, and those that need a draft model,
# an EAGLE head, or a target fine-tuned with semantic adaptive tokens: code looping over METHODS
# needs none of them.
METHODS = tuple(name for name, m in REGISTRY.items() if not m.requires)
DRAFT_METHODS = tuple(name for name, m in REGISTRY.items() if m.needs_draft)
EAGLE_METHODS = tuple(name for name, m in REGISTRY.items() if m.needs_eagle)
SELF_DRAFT_METHODS = tuple(name for name, m in REGISTRY.items() if m.needs_sat_model)
ALL_METHODS = METHODS + DRAFT_METHODS + EAGLE_METHODS + SELF_DRAFT_METHODS
NOT_LOSSLESS = tuple(name for name, m in REGISTRY.items() if not m.lossless)  # biased when sampling
PREDICTION_METHODS = tuple(name for name, m in REGISTRY.items() if m.takes_prediction)  # draft from --prediction
REPLAYABLE = tuple(name for name, m in REGISTRY.items() if not m.not_replayable)


def method(name: str) -> Method:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown method {name!r}: choose one of {', '.join(ALL_METHODS)}") from None


def missing(name: str, need: str) -> ConfigError:
    """The error for method `name` run without `need` (one of REQUIREMENTS)."""
    return ConfigError(REQUIREMENTS[need], method=name)


def uses_store(name: str) -> bool:
    """Whether a method drafts from the static datastore (--sam)."""
    return method(name).uses_store


def make_drafter(name: str, *, vocab_size: int, device: "torch.device | str", eos_token_ids: tuple[int, ...] = (),
                 static: "SuffixAutomaton | NgramTable | None" = None, config: MethodConfig = MethodConfig(),
                 draft: DraftModel | None = None, head: AcceptanceHead | None = None,
                 sampling: SamplingConfig = SamplingConfig(), cost: "VerifyCost | np.ndarray | None" = None,
                 target: TargetModel | None = None, eagle: EagleHead | None = None) -> Drafter:
    """The drafter of method `name`. Draft-model methods sample their drafts with `sampling`; a
    mismatch with the loop's settings only costs acceptance, never correctness. `cost`: the target's
    verify cost (a VerifyCost or one relative curve); `target`: the engine's model (sdsat drafts with
    its weights and cache); `eagle`: an EAGLE head bound to the target."""
    import torch

    entry = method(name)
    given = {"draft_model": draft, "acc_head": head, "eagle_head": eagle, "sat_model": target}
    for need in REQUIREMENTS:  # in its order: the draft model's error before its head's
        if need in entry.requires and given[need] is None:
            raise missing(name, need)
    return entry.build(Resources(vocab_size=vocab_size, device=torch.device(device), eos_token_ids=eos_token_ids,
                                 static=static if entry.uses_store else None, config=config, draft=draft,
                                 head=head, sampling=sampling, cost=cost, target=target, eagle=eagle))


# -- settings by name: the command line's options and the Python API's keyword arguments ---------

def cli_fields() -> list[tuple[str, dataclasses.Field]]:
    """(config section, field) of every drafter setting that has a command-line option: the
    fields of MethodConfig's sections whose metadata names a `cli` flag."""
    return [(section.name, f) for section in dataclasses.fields(MethodConfig)
            for f in dataclasses.fields(section.default_factory) if "cli" in f.metadata]


def setting_names() -> list[str]:
    """The parsed-option keys of every drafter setting (`max_nodes`, `sam_threshold`, ...), which
    `method_config` reads; the Python API takes them as keyword arguments."""
    return sorted(setting_name(f) for _, f in cli_fields())


def setting_default(section: str, f: dataclasses.Field) -> Any:
    """A setting's default as its option holds it: a `pair` field's is (its default, the pair's)."""
    pair = f.metadata.get("pair")
    return (f.default, getattr(getattr(MethodConfig(), section), pair)) if pair else f.default


_KINDS = {"int": ((numbers.Integral,), "an integer"), "float": ((numbers.Real,), "a number"),
          "bool": ((bool,), "True or False"), "str": ((str,), "a string")}


def _check_type(f: dataclasses.Field, value: Any) -> None:
    """A setting of the field's type (a `pair` field: two of them), else a ConfigError naming it:
    the Python API takes any value, which the configs' range checks would compare and fail on."""
    kinds, what = _KINDS[f.type]
    values = value if "pair" in f.metadata and isinstance(value, (tuple, list)) and len(value) == 2 else None
    ok = all(isinstance(v, kinds) and (bool in kinds or not isinstance(v, bool))
             for v in (values if values is not None else (value,)))
    if not ok or ("pair" in f.metadata and values is None):
        what = f"(MIN, MAX), each {what}" if "pair" in f.metadata else what
        raise ConfigError(f"{{{setting_name(f)}}} must be {what}, got {{value!r}}", value=value)


def method_config(settings: dict[str, Any], device: torch.device | None = None) -> MethodConfig:
    """The drafters' settings from their Python names (`setting_names()`); `device` sizes the defaults that depend on it
    (a `cpu_default` left unset: that value on a CPU, the config's own default elsewhere)."""
    sections: dict[str, dict[str, Any]] = {}
    on_cpu = device is not None and device.type == "cpu"
    for section, f in cli_fields():
        value = settings.get(setting_name(f))
        if value is None and on_cpu and "cpu_default" in f.metadata:
            value = f.metadata["cpu_default"]
        if value is not None:  # a `pair` field's option sets it and its pair (--bounds MIN MAX)
            _check_type(f, value)
            names = (f.name, f.metadata["pair"]) if "pair" in f.metadata else (f.name,)
            sections.setdefault(section, {}).update(zip(names, value if "pair" in f.metadata else (value,)))
    base = MethodConfig()
    return dataclasses.replace(base, **{name: dataclasses.replace(getattr(base, name), **values)
                                        for name, values in sections.items()})
