"""Method names -> drafters: the one place that knows which drafter each `--method` means."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from decode.drafters.base import Drafter, NoDraft
from decode.drafters.pld import PldConfig, PromptLookupDrafter
from decode.drafters.recycle import RecycleConfig, TokenRecycleDrafter
from decode.drafters.rest import RestConfig, RestDrafter
from decode.drafters.sam import SamConfig, SamDrafter
from index.errors import UserError

if TYPE_CHECKING:
    from index.automaton import SuffixAutomaton
    from index.ngram import NgramTable

METHODS = ("ar", "pld", "sam", "recycle", "sam+recycle", "rest")


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


def make_drafter(
    method: str,
    *,
    vocab_size: int,
    device: torch.device,
    eos_token_ids: tuple[int, ...] = (),
    static: "SuffixAutomaton | NgramTable | None" = None,
    config: MethodConfig = MethodConfig(),
) -> Drafter:
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
    raise UserError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
