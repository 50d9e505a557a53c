"""SessionConfig: everything a session's output depends on, frozen and validated when built.

Torch-free, so that a command checks its settings (and says what is wrong in one line) before any
model loads; `samctl.session.Session` builds what it names. Recorded verbatim in every output
record (`to_record`).
"""
from __future__ import annotations

import os
from dataclasses import MISSING, asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from samctl.decode.configs import BACKENDS, SamplingConfig
from samctl.decode.methods import ALL_METHODS, DEFAULT_METHOD, NOT_LOSSLESS, MethodConfig, method_config, setting_names
from samctl.index.errors import ConfigError, UserError

if TYPE_CHECKING:
    import torch

MAX_NEW_TOKENS = 1 << 20  # bounds what is preallocated per generation
MAX_THREADS = 4096


def arg(default: Any = MISSING, help: str = "", **meta: Any) -> Any:
    """A configuration field with its command-line option's metadata (samctl/options.py `field_option`)."""
    return field(default=default, metadata={"help": help, **meta})


DTYPES = ("auto", "float32", "float16", "bfloat16")
PATH_FIELDS = ("model", "store", "draft_model", "acc_head", "eagle_head", "memory_file")


def check_sampling(sampling: object) -> SamplingConfig:
    """A `sampling=` argument, refused in one line unless it is a SamplingConfig (a dict would
    otherwise fail deep inside decoding)."""
    if not isinstance(sampling, SamplingConfig):
        raise ConfigError("{sampling} must be a samctl.decode.configs.SamplingConfig(temperature=, top_k=, top_p=, "
                          "seed=), got {value}", value=type(sampling).__name__)
    return sampling


@dataclass(frozen=True)
class SessionConfig:
    """`settings` holds the drafters' options by their Python names (`max_nodes`, ..., `bounds`; see
    `setting_names()`); options left out take the device's defaults."""

    model: str | None = arg(None, "Local model folder, .gguf file, or a model name already in the local Hugging Face "
                                  "cache (nothing is downloaded; default: the embedded model).", metavar="PATH")
    device: str = arg("auto", "auto, cpu, cuda or cuda:N.")
    dtype: str = arg("auto", "auto: float32 on CPU; on GPU the model's saved dtype (float32 models run in bfloat16). "
                     "Greedy output equals plain greedy decoding token for token in float32; in half precision the "
                     "distribution is the model's and greedy can differ at near-ties.",
                     choices=DTYPES)
    threads: int | None = arg(None, "torch CPU threads (default: torch's choice); 1 is steadier on a busy machine.",
                              type=int)
    quantize: str = arg("none", "CPU only. int8: int8 weights (a scale per output channel) times int8 activations (a "
                        "scale per token) with integer sums, in every linear layer and the output head, and attention "
                        "computed for each token alone: every method's greedy output equals the int8 model's own "
                        "plain greedy decoding, bit for bit, batched too. A different model from float32 (close, not "
                        "equal), in less memory. On one or two threads of an x86 CPU, verifying a few tokens "
                        "costs little more than one (samctl's own AVX512-VNNI or AVX2 kernel). On x86 CPUs without "
                        "VNNI, whose 8-bit int8 products saturate, the sums are exact too (16-bit products, or "
                        "7-bit halves).",
                        choices=("none", "int8"))
    prepack: bool = arg(True, "CPU, float32: reorder the weights once at load for oneDNN, so verifying a few tokens "
                        "costs little more than one (results differ from unpacked weights in the last bits).",
                        cli="--prepack/--no-prepack")
    backend: str = arg("auto", "How the model's forward runs. native: samctl's own forward for Llama, Mistral, Qwen2 "
                       "and Qwen3 models (decode/engine/native.py: much less Python per step); hf: transformers' "
                       "modules (any causal LM). auto: native where supported. Recorded in every output.",
                       choices=BACKENDS)
    graphs: bool = arg(True, "CUDA: run the verify forward eagerly instead of as CUDA graphs at fixed widths (the CPU "
                       "never compiles).", cli="--no-compile", negate=True)
    store: str | None = arg(None, "Static datastore built by `samctl build` with the model's tokenizer: a .sam file "
                            "or a store directory (sharded, or a suffix array).", cli="--sam", metavar="STORE", path={})
    occurrence: str = "first"  # the store's, set by the drafter setting `occurrence` (--occurrence)
    method: str = arg(DEFAULT_METHOD, "Drafting method (README's method table; adaptive needs no tuning). "
                      f"{', '.join(NOT_LOSSLESS)}: NOT lossless when sampling, reference reproductions only.",
                      choices=ALL_METHODS)
    settings: dict[str, Any] = field(default_factory=dict)
    draft_model: str | None = arg(None, "sd, specdec++, sam+draft, ouroboros: a small model sharing the target's "
                                  "tokenizer (default: the embedded draft, with the embedded target only).",
                                  metavar="PATH")
    acc_head: str | None = arg(None, "specdec++: acceptance head folder for this target and draft (required: "
                               "none ships with samctl; `samctl train acc-head` makes one).", metavar="PATH")
    eagle_head: str | None = arg(None, "eagle, sam+eagle, adaptive+eagle: EAGLE head folder for this model (default: "
                                 "the embedded one, with the embedded target only).", metavar="PATH")
    max_new_tokens: int = arg(256, "Longest answer, in tokens.")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat: bool = arg(False, "Apply the tokenizer's chat template to the prompt.")
    memory_file: str | None = arg(None, "adaptive, adaptive+eagle, lookahead, ouroboros: preload the memory of "
                                  "earlier outputs from this store.", metavar="STORE", path={"exists": True, "dir_okay": False})
    quiet: bool = arg(False, "No progress, notes or summary on stderr (warnings and errors only).", cli="-q --quiet")

    def __post_init__(self) -> None:
        for name in PATH_FIELDS:  # a pathlib.Path as a str (the loaders take text); anything else refused
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise ConfigError(f"{{{name}}} must be a path (a str or os.PathLike), got {{value}}",
                                  value=f"{type(value).__name__} {value!r:.40}")
        if self.method not in ALL_METHODS:
            raise UserError(f"unknown method {self.method!r}: choose from {', '.join(ALL_METHODS)}")
        if self.quantize not in ("none", "int8"):
            raise ConfigError("{quantize} must be none or int8, got {value!r}", value=self.quantize)
        if self.dtype not in DTYPES:
            raise ConfigError("{dtype} must be one of " + ", ".join(DTYPES) + ", got {value!r}", value=self.dtype)
        check_sampling(self.sampling)
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
        unknown = sorted(set(self.settings) - set(setting_names()))
        if unknown:
            raise UserError(f"unknown setting {unknown[0]!r}: choose from {', '.join(setting_names())}")
        method_config(self.settings)  # drafter settings are checked before any file is looked for or loaded

    def method_config(self, device: torch.device) -> MethodConfig:
        return method_config(self.settings, device)

    def to_record(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "quiet"}
