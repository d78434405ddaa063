"""Next-token sampling's nucleus (server/engine/sampling.py): pure tensor functions."""

from __future__ import annotations

import pytest
import torch

from server.engine.sampling import SamplingParams, sample, top_p_filter

PROBS = torch.tensor([[0.1, 0.5, 0.3, 0.1]])


def kept(top_p: float) -> list[int]:
    """The tokens left in the nucleus, their probabilities unchanged."""
    out = top_p_filter(PROBS, torch.tensor([top_p], dtype=torch.float32))[0]
    assert torch.equal(out[out > 0], PROBS[0][out > 0])
    return (out > 0).nonzero().flatten().tolist()


@pytest.mark.unit
def test_the_nucleus_is_the_smallest_set_of_tokens_with_the_mass_asked_for():
    assert kept(0.7) == [1, 2]
    assert kept(0.5) == [1]
    assert kept(1.0) == [0, 1, 2, 3]


@pytest.mark.unit
def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """5e-324 is a valid top_p (> 0) and 0 in float32: every token was cut, and torch.multinomial failed."""
    assert kept(5e-324) == [1]
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.6, 0.2, 0.1, 0.1]]))
    rows = sample(logits, [SamplingParams(top_p=5e-324), SamplingParams(top_p=5e-324, seed=1)],
                  [None, torch.Generator().manual_seed(1)])
    assert rows.tokens.tolist() == [1, 0]
