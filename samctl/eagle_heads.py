"""EAGLE head files: a folder with `eagle.safetensors` and `eagle.json`.

`eagle.json` holds the format name and version, the fingerprint of the target the head was trained
for (samctl.heads.model_fingerprint: architecture config, tokenizer, a digest of a few embedding
weights) and a free-form `training` record (data, steps, held-out accuracy). The head's shapes
follow from the target's config, so a head is refused for any other target architecture or
tokenizer; other weights of the same architecture only get a note. The weights hold the head's own
parameters (fc and one decoder layer) and, if it has one, its draft vocabulary (int64 ids); the
target's embedding and lm_head are never stored. The
JSON is untrusted input: every field is checked before use. No pickle.

This module knows files and fingerprints; the head itself is `decode.eagle_head`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from samctl.decode.eagle_head import EagleHead
from samctl.index.errors import UserError
from samctl.heads import (check_trained_for, fingerprint_field, load_head_weights, read_head_header,
                          read_head_weights, write_head_folder)

FORMAT = "samctl-eagle-head"
VERSION = 1
WEIGHTS, CONFIG = "eagle.safetensors", "eagle.json"
_TRAIN_HINT = "train one for this model with `samctl train eagle`"


def save_eagle_head(path: str | Path, head: EagleHead, target: dict[str, str], training: dict[str, Any],
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the head folder (weights first, then the JSON that makes it loadable)."""
    tensors = {name: t.detach().cpu().to(dtype if t.is_floating_point() else t.dtype).contiguous()
               for name, t in head.state_dict().items()}
    meta = {"format": FORMAT, "version": VERSION, "hidden_size": head.hidden_size, "target": target,
            "training": training}
    write_head_folder(Path(path), WEIGHTS, tensors, CONFIG, meta)


def load_eagle_head(path: str | Path, target_model: torch.nn.Module, target: dict[str, str]) -> EagleHead:
    """The head in `path`, bound to `target_model` (its device and dtype); UserError if the folder is
    damaged or the head was trained for another model."""
    folder = Path(path)
    meta = read_meta(folder)
    check_trained_for(f"EAGLE head {folder}", "model", meta["target"], target, _TRAIN_HINT)
    if meta["hidden_size"] != int(target_model.config.hidden_size):
        raise UserError(f"EAGLE head {folder} has hidden size {meta['hidden_size']}, the model "
                        f"{target_model.config.hidden_size}: {_TRAIN_HINT}")
    tensors = read_head_weights(folder, WEIGHTS)
    param = next(target_model.parameters())
    vocab = tensors.get("vocab")
    if vocab is not None and (vocab.ndim != 1 or vocab.dtype != torch.int64):
        raise UserError(f"{folder / WEIGHTS} has a malformed draft vocabulary: retrain the head")
    head = EagleHead(target_model, vocab=vocab)
    load_head_weights(head, tensors, folder, WEIGHTS, CONFIG)
    return head.to(device=param.device, dtype=param.dtype).eval()  # .to(dtype) leaves the int64 vocab alone


def read_meta(folder: Path) -> dict[str, Any]:
    meta = read_head_header(folder, CONFIG, WEIGHTS, FORMAT, VERSION, "an EAGLE head", "`samctl train eagle`")
    meta["target"] = fingerprint_field(meta.get("target"))
    if not (isinstance(meta.get("hidden_size"), int) and 0 < meta["hidden_size"] <= 1 << 16 and meta["target"]):
        raise UserError(f"{folder / CONFIG} has missing or invalid fields: retrain the head")
    return meta
