"""Method names -> drafters: the one place that knows which drafter each `--method` means."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from decode.acceptance_head import AcceptanceHead
from decode.draft_model import DraftModel
from decode.drafters.base import Drafter, NoDraft
from decode.drafters.draft import AdaptiveLength, DraftConfig, DraftModelDrafter, FixedLength, SpecDecConfig
from decode.drafters.pld import PldConfig, PromptLookupDrafter
from decode.drafters.recycle import RecycleConfig, TokenRecycleDrafter
from decode.drafters.rest import RestConfig, RestDrafter
from decode.drafters.sam import SamConfig, SamDrafter
from decode.sampling import SamplingConfig
from index.errors import UserError

if TYPE_CHECKING:
    from index.automaton import SuffixAutomaton
    from index.ngram import NgramTable

METHODS = ("ar", "pld", "sam", "recycle", "sam+recycle", "rest")
# Methods that run a draft model next to the target (make_drafter's `draft`); kept apart so that
# code looping over METHODS needs no draft model.
DRAFT_METHODS = ("sd", "specdec++", "sam+draft")
ALL_METHODS = METHODS + DRAFT_METHODS


def uses_store(method: str) -> bool:
    """Whether a method drafts from the static datastore (--sam)."""
    return method.startswith("sam") or method == "rest"


@dataclass(frozen=True)
class MethodConfig:
    """Settings of every drafter; each method reads the parts it uses."""

    sam: SamConfig = field(default_factory=SamConfig)
    pld: PldConfig = field(default_factory=PldConfig)
    recycle: RecycleConfig = field(default_factory=RecycleConfig)
    rest: RestConfig = field(default_factory=RestConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    specdec: SpecDecConfig = field(default_factory=SpecDecConfig)


def make_drafter(
    method: str,
    *,
    vocab_size: int,
    device: torch.device,
    eos_token_ids: tuple[int, ...] = (),
    static: "SuffixAutomaton | NgramTable | None" = None,
    config: MethodConfig = MethodConfig(),
    draft: DraftModel | None = None,
    head: AcceptanceHead | None = None,
    sampling: SamplingConfig = SamplingConfig(),
) -> Drafter:
    """The drafter of `method`. Draft-model methods sample their drafts with `sampling` (the run's
    settings); any mismatch with the loop's settings only costs acceptance, never correctness."""
    if method in DRAFT_METHODS:
        return _draft_model_drafter(method, draft, head, static, eos_token_ids, sampling, config)
    if method == "ar":
        return NoDraft()
    if method == "pld":
        return PromptLookupDrafter(config.pld, eos_token_ids)
    if method == "recycle":
        return TokenRecycleDrafter(vocab_size, device, config.recycle)
    if method == "sam":
        return SamDrafter(config.sam, static=static)
    if method == "sam+recycle":
        return SamDrafter(config.sam, static=static, fallback=TokenRecycleDrafter(vocab_size, device, config.recycle))
    if method == "rest":
        return RestDrafter(config.rest, static)
    raise UserError(f"unknown method {method!r}: choose one of {', '.join(ALL_METHODS)}")


def _draft_model_drafter(
    method: str,
    draft: DraftModel | None,
    head: AcceptanceHead | None,
    static: "SuffixAutomaton | NgramTable | None",
    eos_token_ids: tuple[int, ...],
    sampling: SamplingConfig,
    config: MethodConfig,
) -> Drafter:
    if draft is None:
        raise UserError(f"method {method} needs a draft model: pass --draft-model with a small model "
                        "that shares the target's tokenizer")
    if method == "specdec++":
        if head is None:
            raise UserError("method specdec++ needs an acceptance head: pass --acc-head "
                            "(train one with tools/train_acceptance_head.py)")
        if head.config.hidden_size != draft.hidden_size:
            raise UserError(f"the acceptance head reads hidden size {head.config.hidden_size}, the draft model "
                            f"has {draft.hidden_size}: use the head trained for this draft model")
        return DraftModelDrafter(draft, AdaptiveLength(head, config.specdec), sampling, eos_token_ids, "specdec++")
    fixed = FixedLength(config.draft.gamma)
    if method == "sd":
        return DraftModelDrafter(draft, fixed, sampling, eos_token_ids, "sd")
    return SamDrafter(config.sam, static=static,
                      fallback=DraftModelDrafter(draft, fixed, sampling, eos_token_ids, "draft"))
