"""SessionConfig: everything a session's output depends on, frozen and validated when built.

Torch-free, so that a command checks its settings (and says what is wrong in one line) before any
model loads; `samctl.session.Session` builds what it names. Recorded verbatim in every output
record (`to_record`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from samctl.decode.configs import BACKENDS, DraftConfig, SamplingConfig, SpecDecConfig
from samctl.decode.methods import (ALL_METHODS, DEFAULT_METHOD, DRAFT_MODEL_SETTINGS, MethodConfig, method_config,
                                   setting_names)
from samctl.index.errors import ConfigError, UserError

if TYPE_CHECKING:
    import torch

MAX_NEW_TOKENS = 1 << 20  # bounds what is preallocated per generation
MAX_THREADS = 4096
# Draft-model settings that are not drafter-section fields with a `cli` flag of their own.
DRAFT_SETTINGS = tuple(DRAFT_MODEL_SETTINGS)


@dataclass(frozen=True)
class SessionConfig:
    """Everything a session's output depends on. `settings` holds the drafters' options by their
    Python names (`max_nodes`, `sam_threshold`, ..., `gamma`, `stop_threshold`, `bounds`; see
    `setting_names()`); options left out take the device's defaults."""

    model: str | None = None  # a model folder, a .gguf file, or None for the embedded default
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    quantize: str = "none"  # CPU: "int8" runs int8 weights x per-token int8 activations (decode/engine/cpu_linear.py)
    prepack: bool = True  # CPU, float32: oneDNN-reordered weights
    backend: str = "auto"  # the target's forward: native (decode/engine/native.py) where supported, else hf
    graphs: bool = True  # CUDA only: the verify forward as CUDA graphs at fixed widths
    store: str | None = None
    occurrence: str = "first"
    method: str = DEFAULT_METHOD
    settings: dict[str, Any] = field(default_factory=dict)
    draft_model: str | None = None
    acc_head: str | None = None
    eagle_head: str | None = None
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat: bool = False  # render prompts with the tokenizer's chat template
    memory_file: str | None = None
    quiet: bool = False  # the session logs no notes of its own (its plan, a prompt near the context)

    def __post_init__(self) -> None:
        if self.method not in ALL_METHODS:
            raise UserError(f"unknown method {self.method!r}: choose from {', '.join(ALL_METHODS)}")
        if self.quantize not in ("none", "int8"):
            raise ConfigError("{quantize} must be none or int8, got {value!r}", value=self.quantize)
        if self.backend not in BACKENDS:
            raise ConfigError("{backend} must be one of " + ", ".join(BACKENDS) + ", got {value!r}", value=self.backend)
        if self.threads is not None and self.threads < 1:
            raise ConfigError("{threads} must be >= 1, got {value}", value=self.threads)
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ConfigError(f"{{max_new_tokens}} must be in [1, {MAX_NEW_TOKENS}] (longer than any context samctl "
                              "runs), got {value}", value=self.max_new_tokens)
        if self.threads is not None and self.threads > MAX_THREADS:
            raise ConfigError(f"{{threads}} must be at most {MAX_THREADS}, got {{value}}: pass the cores to use",
                              value=self.threads)
        unknown = sorted(set(self.settings) - set(setting_names()) - set(DRAFT_SETTINGS))
        if unknown:
            raise UserError(f"unknown setting {unknown[0]!r}: choose from "
                            f"{', '.join(setting_names() + list(DRAFT_SETTINGS))}")
        # Drafter settings are checked before any file is looked for or loaded.
        self._draft_sections()
        method_config(self.settings)

    def _draft_sections(self) -> tuple[DraftConfig, SpecDecConfig]:
        s = self.settings
        bounds = s.get("bounds") or (SpecDecConfig.min_draft, SpecDecConfig.max_draft)
        return (DraftConfig(gamma=s.get("gamma", DraftConfig.gamma)),
                SpecDecConfig(s.get("stop_threshold", SpecDecConfig.stop_threshold), *bounds))

    def method_config(self, device: torch.device) -> MethodConfig:
        """The drafters' settings on `device` (a setting left unset takes that device's default)."""
        draft, specdec = self._draft_sections()
        return replace(method_config(self.settings, device), draft=draft, specdec=specdec)

    def to_record(self) -> dict[str, Any]:
        """The configuration as JSON-ready values, as every output record carries it."""
        return {k: v for k, v in asdict(self).items() if k != "quiet"}
