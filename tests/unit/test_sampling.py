"""The processed target distribution: temperature, top-k, top-p, min-p; and drawing from it."""

from __future__ import annotations

import pytest
import torch

from specserve.layers.sampling import pick, sample, target_probs
from specserve.types import SamplingParams


def test_top_k_top_p_min_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]), atol=1e-6)
    k2 = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(k2, torch.tensor([[0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]]), atol=1e-6)
    # top-p 0.8 keeps the smallest prefix whose mass reaches 0.8: 0.5 + 0.2 + 0.15
    p8 = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert (p8[0] > 0).tolist() == [True, True, True, False, False]
    m = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))  # keep p >= 0.15
    assert (m[0] > 0).tolist() == [True, True, True, False, False]
    hot = target_probs(logits, SamplingParams(temperature=2.0))
    assert hot[0, 4] > p[0, 4] and abs(hot.sum().item() - 1) < 1e-6


def test_pick_greedy_and_seeded() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pick(logits, SamplingParams(), None), logits.argmax(-1))
    params = SamplingParams(temperature=1.0)
    a = pick(logits, params, torch.Generator().manual_seed(5))
    b = pick(logits, params, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_sample_draws_each_row_from_its_weights() -> None:
    """Rows of different (unnormalised) weights, zeros included: frequencies over 40k draws per row match the
    weights within 4.5 standard errors, and a zero-weight token is never drawn (leading, inner, trailing)."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0],
                            [0.2, 0.2, 0.2, 0.2, 0.2],
                            [0.0, 0.0, 0.0, 0.0, 7.0],
                            [0.9, 0.0999, 0.0001, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(1)
    n = 40_000
    draws = torch.stack([sample(weights, gen) for _ in range(n)])  # [n, 4]
    p = weights / weights.sum(-1, keepdim=True)
    for row in range(4):
        freq = torch.bincount(draws[:, row], minlength=5).float() / n
        assert freq[p[row] == 0].sum() == 0, (row, freq)
        se = (p[row] * (1 - p[row]) / n).sqrt()
        assert ((freq - p[row]).abs() <= 4.5 * se + 1e-9).all(), (row, freq, p[row])
    # u * total rounding up to the row's total (a uniform of 1.0 stands in) lands on the last token of positive
    # weight, not past the row or on a trailing zero
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "rand", lambda *a, **k: torch.ones(1, 1))
        assert sample(torch.tensor([[0.3, 0.3, 0.0]]), None).tolist() == [1]
