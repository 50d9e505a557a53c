"""`samctl serve`'s start-up (issue 42, item 8): the verify-cost measurements take few forwards
and stop when asked. Measurements are counted in forwards and tokens, never timed."""
from __future__ import annotations

import pytest

from samctl.decode.engine.batched import measure_batch_cost
from samctl.decode.engine.cost import Stopped, measure_verify_cost
from samctl.decode.engine.target import TargetModel


class _Fed:
    """Counts the forwards a model runs and the input tokens they take (at its embedding)."""

    def __init__(self, model) -> None:
        self.forwards = self.tokens = 0
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.forwards += 1
        self.tokens += int(args[0].numel())


def test_the_verify_cost_curves_take_few_forwards(tiny_llama):
    """Batch 1: 7 widths (1..64, doubling) x 3 rounds after one prefill of the context, 637
    tokens in all (was 12 widths x 5 rounds, 1356 tokens). 16 rows: 7 shapes x 3 rounds and one
    token per row where 16 x 256 context tokens were prefilled (6637 tokens, now 1519)."""
    fed = _Fed(tiny_llama)
    try:
        t_ms = measure_verify_cost(TargetModel(tiny_llama), 64, context=256)
        assert len(t_ms) == 64 and all(b >= a for a, b in zip(t_ms, t_ms[1:]))
        assert (fed.forwards, fed.tokens) == (1 + 3 * 7, 256 + 3 * (1 + 2 + 4 + 8 + 16 + 32 + 64))
        fed.forwards = fed.tokens = 0
        t_ms = measure_batch_cost(tiny_llama, 16, 16, context=256)
        assert len(t_ms) == 16 * 16
        shapes = [(1, 1), (4, 1), (16, 1), (16, 2), (16, 4), (16, 8), (16, 16)]
        assert (fed.forwards, fed.tokens) == (1 + 3 * len(shapes), 16 + 3 * sum(b * w for b, w in shapes))
    finally:
        fed.handle.remove()


def test_a_measurement_stops_at_its_next_forward(tiny_llama):
    fed = _Fed(tiny_llama)
    try:
        with pytest.raises(Stopped):
            measure_batch_cost(tiny_llama, 4, 8, stop=lambda: fed.forwards >= 3)
        assert fed.forwards == 3
        with pytest.raises(Stopped):
            measure_verify_cost(TargetModel(tiny_llama), 64, stop=lambda: fed.forwards >= 5)
        assert fed.forwards == 5
    finally:
        fed.handle.remove()
