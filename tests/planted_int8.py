"""Planted int8 weight quantizers, for the tests that compare int8 with the float model.

Each replaces `decode.engine.cpu_linear.quantize_weight` (weight [out, in] float32 -> qweight
[out, in] int8, scale [out] float32) with the classic slip of its kind; a check against float32
shows its power by failing under every one of them (tests/test_cpu_linear.py).

    seven_bit   scales of max|w| / 63: weights on a grid twice as coarse, half the int8 range unused
    per_tensor  one scale for the whole tensor: channels with small weights get few levels
"""
from __future__ import annotations

import contextlib

import torch

from samctl.decode.engine import cpu_linear


def seven_bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 63.0
    return torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (weight.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / 127.0).expand(len(weight)).clone()
    return torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


PLANTS = {"seven_bit": seven_bit, "per_tensor": per_tensor}


@contextlib.contextmanager
def quantizer(plant: str | None):
    """Int8 layers built inside quantize their weights the true way (None) or with a planted bug."""
    saved = cpu_linear.quantize_weight
    cpu_linear.quantize_weight = saved if plant is None else PLANTS[plant]
    try:
        yield
    finally:
        cpu_linear.quantize_weight = saved
