"""Loading models: a name (a folder, a `.gguf` file, a hub-cache name; never a download) becomes a
target ready to decode (`Engine`, its device and dtype resolved here) or a draft model. Which files
a run uses is decided first, by samctl.plan; notes go to the `samctl` logger."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from samctl.decode.draft_model import DraftModel
from samctl.decode.engine.cpu_linear import apply_cpu_linear
from samctl.decode.engine.graphs import enable_row_graphs
from samctl.decode.engine.native import native_of, use_backend
from samctl.decode.engine.target import TargetModel
from samctl.gguf_cache import first_line, model_folder
from samctl.index.errors import ConfigError, UserError
from samctl.plan import EMBEDDED_MODEL_NOTE, default_model
from samctl.tokenizer import chat_ids, tokenizer_fingerprint

log = logging.getLogger(__name__)

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
        return chat_ids(self.tokenizer, messages, f"model {self.name}")

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
    """`auto`: float32 on the CPU (greedy output then equals plain greedy decoding token for token);
    on a GPU a half dtype the model was saved in, else bfloat16 (float32's range: no overflow in a
    model never run in float16) where supported, else float16. Half precision keeps sampling
    lossless, but greedy output can differ at near-ties (verifying runs other kernels)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_ok else torch.float16


def _config_dtype(model: str) -> torch.dtype | None:
    from transformers import AutoConfig

    try:
        declared = getattr(AutoConfig.from_pretrained(model, local_files_only=True), "dtype", None)
    except (OSError, ValueError, KeyError):
        return None  # the model load below reports the problem
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else None


def load_engine(model: str | None, device: str = "auto", dtype: str = "auto", quantize: str = "none",
                prepack: bool = True, backend: str = "auto") -> Engine:
    """A causal LM and its tokenizer from a folder, a `.gguf` file or the local HF cache (never a
    download). On a CPU its linear layers run as `quantize` and `prepack` say
    (decode/engine/cpu_linear.py): prepack=False to train its weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its bars would break the one-line-error and stderr contracts
    # transformers' warnings address the developers of code that calls it: samctl, not its user
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")

    if model is None:
        model = default_model()
        log.info(EMBEDDED_MODEL_NOTE)
    if Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        raise UserError(f"model folder {model} has no config.json: pass a folder written by save_pretrained")
    torch_device = resolve_device(device)
    folder = model_folder(model)  # a .gguf becomes its cached, dequantized folder
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
    hf_model.name_or_path = model  # what errors name it by: as given (a .gguf file, not its cached folder)
    hf_model.to(torch_device).eval()
    apply_cpu_linear(hf_model, quantize, prepack)
    return engine_for(hf_model, tokenizer, name=model, backend=backend)


def engine_for(model: torch.nn.Module, tokenizer: object | None, name: str | None = None,
               backend: str = "auto") -> Engine:
    """An Engine around a loaded causal LM. The native backend reads the model's weights once, here:
    a model whose weights change afterwards (training) wants backend="hf"."""
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


def load_draft(path: str, engine: Engine) -> DraftModel:
    """A draft model on the target's device and dtype, refused unless its tokenizer's ids are the target's."""
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
    use_backend(model, "auto" if native_of(engine.model) is not None else "hf")  # the target's forward
    draft = DraftModel(model, vocab_limit=engine.vocab_size)
    if engine.target.rows.graphs is not None:  # the target's CUDA graphs: the draft's batch gets its own
        enable_row_graphs(draft.rows.target)
    return draft