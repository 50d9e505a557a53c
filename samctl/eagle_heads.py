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

import json
import os
from pathlib import Path
from typing import Any

import click
import torch

from samctl.decode.eagle_head import EagleHead
from samctl.index.errors import UserError
from samctl.heads import read_head_header

FORMAT = "samctl-eagle-head"
VERSION = 1
WEIGHTS, CONFIG = "eagle.safetensors", "eagle.json"
_TRAIN_HINT = "train one for this model with `samctl train eagle`"


def save_eagle_head(path: str | Path, head: EagleHead, target: dict[str, str], training: dict[str, Any],
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the head folder (weights first, then the JSON that makes it loadable)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().to(dtype if t.is_floating_point() else t.dtype).contiguous()
               for name, t in head.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS))
    meta = {"format": FORMAT, "version": VERSION, "hidden_size": head.hidden_size, "target": target,
            "training": training}
    tmp = folder / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, folder / CONFIG)


def load_eagle_head(path: str | Path, target_model: torch.nn.Module, target: dict[str, str]) -> EagleHead:
    """The head in `path`, bound to `target_model` (its device and dtype); UserError if the folder is
    damaged or the head was trained for another model."""
    folder = Path(path)
    meta = read_meta(folder)
    trained = meta["target"]
    if any(trained[k] != target[k] for k in ("config", "tokenizer")):
        raise UserError(f"EAGLE head {folder} was trained for another model (config {trained['config']}, "
                        f"tokenizer {trained['tokenizer']}; this one has {target['config']}, {target['tokenizer']}): "
                        f"{_TRAIN_HINT}")
    if trained.get("weights") not in (None, target.get("weights")):
        click.echo(f"samctl: note: EAGLE head {folder} was trained on other weights of this architecture; "
                   "its drafts may be accepted less often (retrain it for these weights)", err=True)
    if meta["hidden_size"] != int(target_model.config.hidden_size):
        raise UserError(f"EAGLE head {folder} has hidden size {meta['hidden_size']}, the model "
                        f"{target_model.config.hidden_size}: {_TRAIN_HINT}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / WEIGHTS))
    except (OSError, SafetensorError) as err:
        raise UserError(f"cannot read {folder / WEIGHTS} ({err}): retrain or copy the head again") from err
    param = next(target_model.parameters())
    vocab = tensors.get("vocab")
    if vocab is not None and (vocab.ndim != 1 or vocab.dtype != torch.int64):
        raise UserError(f"{folder / WEIGHTS} has a malformed draft vocabulary: retrain the head")
    head = EagleHead(target_model, vocab=vocab)
    try:
        head.load_state_dict(tensors)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0][:200]
        raise UserError(f"{folder / WEIGHTS} does not match its {CONFIG} ({first}): retrain the head") from err
    return head.to(device=param.device, dtype=param.dtype).eval()  # .to(dtype) leaves the int64 vocab alone


def read_meta(folder: Path) -> dict[str, Any]:
    meta = read_head_header(folder, CONFIG, WEIGHTS, FORMAT, VERSION, "an EAGLE head", "`samctl train eagle`")
    target = meta.get("target")
    ok = (isinstance(meta.get("hidden_size"), int) and 0 < meta["hidden_size"] <= 1 << 16
          and isinstance(target, dict) and all(isinstance(target.get(k), str) for k in ("config", "tokenizer")))
    if not ok:
        raise UserError(f"{folder / CONFIG} has missing or invalid fields: retrain the head")
    weights = target.get("weights")
    meta["target"] = {"config": target["config"], "tokenizer": target["tokenizer"],
                      "weights": weights if isinstance(weights, str) else None}
    return meta
