"""Semantic adaptive tokens (SDSAT, Liu & Zhu 2024): the model-folder settings and the training layout.

A model fine-tuned for SDSAT predicts the tokens after t0 at k placeholder inputs appended after
it: feeding `[t0, SAT x k]` at positions p..p+k, the logits at t0 give x_{p+1} and the logits at
SAT j (position p+j) predict x_{p+j+1}. One token id is repeated k times; RoPE tells the slots
apart. The settings live in the model folder's config.json under "sdsat", so a fine-tuned folder
is all `--method sdsat` needs:

    "sdsat": {"sat_token_id": 7, "sat_token": "<gh_stars>", "sat_count": 5, "added_to_vocab": false, ...}

Training layout (the paper released no code; this reconstruction is recorded in the folder):
one row holds the standard sequence x_0..x_{T-1} followed by B blocks of k SATs. Block b, anchored
at p_b, sits at positions p_b+1..p_b+k, sees x_0..x_{p_b} and the earlier SATs of its own block,
and SAT j is labelled x_{p_b+j+1}. Standard tokens never see a SAT, so their logits are exactly
those of the same model without the blocks: the standard next-token loss is the ordinary one.
Knows nothing of files, tokenizers or the decoding loop.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from samctl.index.errors import UserError

CONFIG_KEY = "sdsat"
IGNORE = -100  # label of a position without a loss term (torch cross_entropy's ignore_index)


@dataclass(frozen=True)
class SatSettings:
    sat_token_id: int  # the id fed at every SAT slot
    sat_count: int  # k: SAT slots the model was trained with
    sat_token: str = ""  # the token's text, for people reading the config
    added_to_vocab: bool = False  # True when training added the token (vocabulary grew by one)

    def __post_init__(self) -> None:
        if self.sat_count < 1:
            raise UserError(f"sdsat settings need sat_count >= 1, got {self.sat_count}")
        if self.sat_token_id < 0:
            raise UserError(f"sdsat settings need a token id >= 0, got {self.sat_token_id}")


def read_settings(config: Any, name: str = "the model") -> SatSettings:
    """The SAT settings of a transformers config, or a one-line error saying how to make them."""
    raw = getattr(config, CONFIG_KEY, None)
    if not isinstance(raw, dict):
        raise UserError(f"{name} has no semantic adaptive tokens (no \"{CONFIG_KEY}\" in its config.json): "
                        f"fine-tune it with `samctl train sdsat --model {name} --out DIR`, "
                        "then run that folder as the model")
    try:
        settings = SatSettings(int(raw["sat_token_id"]), int(raw["sat_count"]), str(raw.get("sat_token", "")),
                               bool(raw.get("added_to_vocab", False)))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{name}: the \"{CONFIG_KEY}\" section of config.json is damaged ({err}): "
                        "fine-tune again with `samctl train sdsat`") from None
    vocab = int(getattr(config, "vocab_size", settings.sat_token_id + 1))
    if settings.sat_token_id >= vocab:
        raise UserError(f"{name}: SAT id {settings.sat_token_id} is outside the vocabulary ({vocab}): "
                        "fine-tune again with `samctl train sdsat`")
    return settings


def write_settings(config: Any, settings: SatSettings, record: dict[str, Any]) -> None:
    """Store the settings (and how they were trained) in a transformers config before save_pretrained."""
    setattr(config, CONFIG_KEY, {**asdict(settings), "training": record})


@dataclass
class SatBatch:
    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, 1, L, L] additive float (0 = attend, finfo.min = blocked)
    labels: torch.Tensor  # [B, L] int64, IGNORE where no loss
    is_sat: torch.Tensor  # [B, L] bool: the SAT slots
    slot: torch.Tensor  # [B, L] int64: j in 1..k at SAT slots, 0 elsewhere


def sat_layout(length: int, anchors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # length: T standard tokens; anchors: [B] int, 0 <= p < T
    # -> positions [T + B k] int64, visible [T + B k, T + B k] bool (row attends to column),
    #    source [T + B k] int64: for a SAT slot j of block b the index p_b + j + 1 of its label in
    #    the standard sequence (may be >= T: no label), -1 for standard rows.
    b = len(anchors)
    n = length + b * k
    positions = np.empty(n, dtype=np.int64)
    positions[:length] = np.arange(length)
    source = np.full(n, -1, dtype=np.int64)
    visible = np.zeros((n, n), dtype=bool)
    visible[:length, :length] = np.tril(np.ones((length, length), dtype=bool))
    j = np.arange(1, k + 1)
    for i, p in enumerate(anchors):
        rows = length + i * k + np.arange(k)
        positions[rows] = p + j
        source[rows] = p + j + 1
        visible[rows, : p + 1] = True  # x_0..x_p, t0 = x_p included
        visible[np.ix_(rows, rows)] = np.tril(np.ones((k, k), dtype=bool))  # earlier SATs of this block
    return positions, visible, source


def make_batch(sequences: list[np.ndarray], starts: list[int], anchors: list[np.ndarray], k: int,
               sat_id: int, pad_id: int, dtype: torch.dtype = torch.float32) -> SatBatch:
    """Rows of [standard tokens (right-padded) | SAT blocks]; standard labels from index starts[r]
    on (the response), SAT labels wherever the sequence has the token."""
    width = max(len(s) for s in sequences)
    blocks = max(len(a) for a in anchors)
    n = width + blocks * k
    ids = np.full((len(sequences), n), pad_id, dtype=np.int64)
    pos = np.zeros((len(sequences), n), dtype=np.int64)
    labels = np.full((len(sequences), n), IGNORE, dtype=np.int64)
    slot = np.zeros((len(sequences), n), dtype=np.int64)
    visible = np.zeros((len(sequences), n, n), dtype=bool)
    for r, (seq, start, anchor) in enumerate(zip(sequences, starts, anchors)):
        t = len(seq)
        positions, vis, source = sat_layout(t, np.asarray(anchor, dtype=np.int64), k)
        # standard part: tokens at 0..t-1 (padding after them is seen by nobody that has a label)
        ids[r, :t] = seq
        pos[r, :t] = positions[:t]
        pos[r, t:width] = np.arange(t, width)
        labels[r, max(start - 1, 0) : t - 1] = seq[max(start, 1) :]
        visible[r, :width, :width] = np.tril(np.ones((width, width), dtype=bool))
        # SAT blocks: moved from index t.. of the unpadded layout to width..
        m = len(anchor) * k
        sat_rows = np.arange(width, width + m)
        ids[r, sat_rows] = sat_id
        pos[r, sat_rows] = positions[t:]
        has = source[t:] < t
        labels[r, sat_rows[has]] = seq[source[t:][has]]
        slot[r, sat_rows] = np.tile(np.arange(1, k + 1), len(anchor))
        visible[r, width : width + m, :t] = vis[t:, :t]
        visible[r, width : width + m, width : width + m] = vis[t:, t:]
        # rows of unused block slots (fewer anchors than `blocks`) see themselves only
        idle = np.arange(width + m, n)
        visible[r, idle, idle] = True
    blocked = torch.finfo(dtype).min
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(torch.from_numpy(~visible), blocked)[:, None]
    return SatBatch(torch.from_numpy(ids), torch.from_numpy(pos), mask, torch.from_numpy(labels),
                    torch.from_numpy(slot > 0), torch.from_numpy(slot))


def sample_anchors(start: int, length: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `blocks` distinct anchors p in [start - 1, length - 2] (t0 is the last prompt token or a
    response token that still has a next token), uniformly."""
    low, high = max(start - 1, 0), length - 2
    if high < low:
        return np.zeros(0, dtype=np.int64)
    count = min(blocks, high - low + 1)
    return np.sort(rng.choice(np.arange(low, high + 1), size=count, replace=False))
