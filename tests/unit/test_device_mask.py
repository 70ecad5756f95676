"""The compiled steps' in-graph attention mask equals the eager runner's host-built one, for plain decodes, chains,
trees and padding rows alike."""

from __future__ import annotations

import random

import torch

from specserve.engine.compiled import device_mask
from specserve.engine.runner import Row, mask


def _tree(q: int, rng: random.Random) -> torch.Tensor:
    """A random ancestor mask: node i's parent is one of 0..i-1 (root 0)."""
    m = torch.eye(q, dtype=torch.bool)
    for i in range(1, q):
        m[i] |= m[rng.randrange(i)]
    return m


def test_device_mask_equals_the_runner_mask() -> None:
    rng = random.Random(0)
    for _ in range(200):
        q_max = rng.choice([1, 2, 3, 6])
        rows, trees = [], []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(0, q_max)  # 0: a padding row
            c = rng.randint(0, 9) if n else 0
            t = _tree(n, rng) if n > 1 and rng.random() < 0.5 else None
            rows.append(Row([0] * n, list(range(n)), [0] * n, [0] * c, tree_mask=t))
            causal = torch.ones(q_max, q_max, dtype=torch.bool).tril()
            if t is not None:
                causal[:n, :n] = t
            trees.append(causal)
        qs, cs = [r.q for r in rows], [len(r.context) for r in rows]
        k_len = max(2, max(c + n for c, n in zip(cs, qs, strict=True)) + rng.randint(0, 3))  # padding keys too
        want = mask(rows, qs, cs, q_max, k_len)
        got = device_mask(torch.tensor([cs, qs]).T, torch.stack(trees), k_len)
        assert torch.equal(got, want), (qs, cs, k_len)
