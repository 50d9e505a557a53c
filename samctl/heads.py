"""Head files: SpecDec++ acceptance heads and EAGLE heads, each a folder of safetensors + JSON.

The JSON (format, version, shape, the fingerprints of the models it was trained for, a `training`
record) is untrusted input: every field is checked before use; no pickle. A head is refused for
another model architecture or tokenizer (`model_fingerprint`); other weights of the same
architecture only get a note. This module knows files and fingerprints; the heads themselves are
`decode.acceptance_head` and `decode.eagle_head`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from samctl.decode.acceptance_head import AcceptanceHead, HeadConfig
from samctl.decode.eagle_head import EagleHead
from samctl.gguf_cache import first_line
from samctl.index.errors import UserError
from samctl.tokenizer import tokenizer_fingerprint

log = logging.getLogger(__name__)

FORMAT = "samctl-acceptance-head"
VERSION = 1
WEIGHTS, CONFIG = "head.safetensors", "head.json"
EAGLE_FORMAT = "samctl-eagle-head"
EAGLE_VERSION = 1
EAGLE_WEIGHTS, EAGLE_CONFIG = "eagle.safetensors", "eagle.json"
_EAGLE_HINT = "train one for this model with `samctl train eagle`"
# Config keys that say how a model was saved or run, not what it computes.
_RUNTIME_KEYS = {"transformers_version", "architectures", "output_hidden_states", "output_attentions",
                 "return_dict", "dtype", "torch_dtype", "use_cache", "id2label", "label2id", "problem_type",
                 "chunk_size_feed_forward", "attn_implementation", "pad_token_id"}


def model_fingerprint(model: torch.nn.Module, tokenizer: Any) -> dict[str, str]:
    """{"config": architecture config hash, "tokenizer": tokenizer fingerprint, "weights": digest}."""
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in _RUNTIME_KEYS}
    payload = json.dumps(config, sort_keys=True, default=str).encode("utf-8")
    # bfloat16 of a corner of the input embeddings: exact for weights stored in bf16 and loaded in
    # fp32 or bf16, which is how samctl's reference models ship.
    corner = model.get_input_embeddings().weight[:8, :16].detach().float().cpu().to(torch.bfloat16)
    return {"config": hashlib.sha256(payload).hexdigest()[:16], "tokenizer": tokenizer_fingerprint(tokenizer),
            "weights": hashlib.sha256(corner.view(torch.int16).numpy().tobytes()).hexdigest()[:16]}


def save_head(path: str | Path, head: AcceptanceHead, target: dict[str, str], draft: dict[str, str],
              training: dict[str, Any]) -> None:
    tensors = {name: t.detach().cpu().float().contiguous() for name, t in head.state_dict().items()}
    meta = {
        "format": FORMAT, "version": VERSION,
        "hidden_size": head.config.hidden_size, "num_blocks": head.config.num_blocks,
        "shared_blocks": head.config.shared_blocks,
        "target": target, "draft": draft, "training": training,
    }
    write_head_folder(Path(path), WEIGHTS, tensors, CONFIG, meta)


def load_head(path: str | Path, target: dict[str, str], draft: dict[str, str],
              device: torch.device) -> AcceptanceHead:
    """UserError if the folder is damaged or the head was trained for another pair."""
    folder = Path(path)
    meta = read_head_header(folder, CONFIG, WEIGHTS, FORMAT, VERSION, "an acceptance head",
                            "`samctl train acc-head`")
    for role in ("target", "draft"):
        meta[role] = fingerprint_field(meta.get(role))
    ok = (isinstance(meta.get("hidden_size"), int) and 0 < meta["hidden_size"] <= 1 << 16
          and isinstance(meta.get("num_blocks"), int) and 0 <= meta["num_blocks"] <= 64
          and isinstance(meta.get("shared_blocks"), bool) and meta["target"] and meta["draft"])
    if not ok:
        raise UserError(f"{folder / CONFIG} has missing or invalid fields: retrain the head")
    for role, wanted in (("target", target), ("draft", draft)):
        check_trained_for(f"acceptance head {folder}", f"{role} model", meta[role], wanted,
                          "train a head for this pair with `samctl train acc-head`")
    head = AcceptanceHead(HeadConfig(meta["hidden_size"], meta["num_blocks"], meta["shared_blocks"]))
    load_head_weights(head, read_head_weights(folder, WEIGHTS), folder, WEIGHTS, CONFIG)
    return head.to(device).eval()


def load_acc_head(path: str, engine: Any, draft: Any) -> AcceptanceHead:
    return load_head(path, model_fingerprint(engine.model, engine.tokenizer),
                     model_fingerprint(draft.model, engine.tokenizer), engine.device)


def load_eagle(path: str, engine: Any) -> EagleHead:
    return load_eagle_head(path, engine.model, model_fingerprint(engine.model, engine.tokenizer))


def save_eagle_head(path: str | Path, head: EagleHead, target: dict[str, str], training: dict[str, Any],
                    dtype: torch.dtype = torch.bfloat16) -> None:
    tensors = {name: t.detach().cpu().to(dtype if t.is_floating_point() else t.dtype).contiguous()
               for name, t in head.state_dict().items()}
    meta = {"format": EAGLE_FORMAT, "version": EAGLE_VERSION, "hidden_size": head.hidden_size, "target": target,
            "training": training}
    write_head_folder(Path(path), EAGLE_WEIGHTS, tensors, EAGLE_CONFIG, meta)


def load_eagle_head(path: str | Path, target_model: torch.nn.Module, target: dict[str, str]) -> EagleHead:
    """Bound to `target_model` (its device and dtype); UserError if the folder is damaged or the head
    was trained for another model."""
    folder = Path(path)
    meta = read_head_header(folder, EAGLE_CONFIG, EAGLE_WEIGHTS, EAGLE_FORMAT, EAGLE_VERSION, "an EAGLE head",
                            "`samctl train eagle`")
    meta["target"] = fingerprint_field(meta.get("target"))
    if not (isinstance(meta.get("hidden_size"), int) and 0 < meta["hidden_size"] <= 1 << 16 and meta["target"]):
        raise UserError(f"{folder / EAGLE_CONFIG} has missing or invalid fields: retrain the head")
    check_trained_for(f"EAGLE head {folder}", "model", meta["target"], target, _EAGLE_HINT)
    if meta["hidden_size"] != int(target_model.config.hidden_size):
        raise UserError(f"EAGLE head {folder} has hidden size {meta['hidden_size']}, the model "
                        f"{target_model.config.hidden_size}: {_EAGLE_HINT}")
    tensors = read_head_weights(folder, EAGLE_WEIGHTS)
    param = next(target_model.parameters())
    vocab = tensors.get("vocab")
    if vocab is not None and (vocab.ndim != 1 or vocab.dtype != torch.int64):
        raise UserError(f"{folder / EAGLE_WEIGHTS} has a malformed draft vocabulary: retrain the head")
    head = EagleHead(target_model, vocab=vocab)
    load_head_weights(head, tensors, folder, EAGLE_WEIGHTS, EAGLE_CONFIG)
    return head.to(device=param.device, dtype=param.dtype).eval()  # .to(dtype) leaves the int64 vocab alone


# -- what every kind of head folder shares --

def write_head_folder(folder: Path, weights: str, tensors: dict[str, torch.Tensor], config: str,
                      meta: dict[str, Any]) -> None:
    """Weights first, then the JSON header that makes the folder loadable (renamed into place)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / weights))
    tmp = folder / (config + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, folder / config)


def check_trained_for(what: str, role: str, trained: dict[str, str | None], wanted: dict[str, str], hint: str) -> None:
    if any(trained[k] != wanted[k] for k in ("config", "tokenizer")):
        raise UserError(f"{what} was trained for another {role} (config {trained['config']}, tokenizer "
                        f"{trained['tokenizer']}; this one has {wanted['config']}, {wanted['tokenizer']}): {hint}")
    if trained.get("weights") not in (None, wanted.get("weights")):
        log.warning(f"note: {what} was trained on other weights of this {role.split()[0]} architecture; "
                    "its predictions may be off (retrain it for these weights)")


def read_head_weights(folder: Path, weights: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(folder / weights))
    except (OSError, SafetensorError) as err:
        raise UserError(f"cannot read {folder / weights} ({err}): retrain or copy the head again") from err


def load_head_weights(head: torch.nn.Module, tensors: dict[str, torch.Tensor], folder: Path, weights: str,
                      config: str) -> None:
    try:
        head.load_state_dict(tensors)
    except RuntimeError as err:
        raise UserError(f"{folder / weights} does not match its {config} ({first_line(err)}): retrain the head") from err


def fingerprint_field(value: Any) -> dict[str, str | None] | None:
    """None unless config and tokenizer are strings."""
    if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("config", "tokenizer")):
        return None
    weights = value.get("weights")
    return {"config": value["config"], "tokenizer": value["tokenizer"],
            "weights": weights if isinstance(weights, str) else None}


def read_head_header(folder: Path, config: str, weights: str, form: str, version: int, what: str,
                     tool: str) -> dict[str, Any]:
    if not (folder / config).is_file() or not (folder / weights).is_file():
        raise UserError(f"{folder} is not {what} folder (needs {config} and {weights}): "
                        f"pass a folder that {tool} wrote")
    try:
        meta = json.loads((folder / config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {folder / config} ({err}): retrain the head") from err
    if not isinstance(meta, dict) or meta.get("format") != form:
        raise UserError(f"{folder / config} is not a samctl {what.split(' ', 1)[1]}: pass a folder from {tool}")
    if meta.get("version") != version:
        raise UserError(f"{folder / config} has format version {meta.get('version')!r}, this samctl reads "
                        f"{version}: retrain the head or upgrade samctl")
    return meta
