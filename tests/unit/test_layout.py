"""`models/layout.py`: projection weights stored column-major keep their shape, values and names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.layout import FEW_ROWS, TwoLayoutLinear, column_major_projections, two_layout_heads
from specserve.models.weights import save_safetensors


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 20, bias=True)
        self.down = nn.Linear(20, 12, bias=False)
        self.lm_head = nn.Linear(12, 30, bias=False)


def test_projections_become_column_major_with_the_same_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = _Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(17, 12)
    ref = net.down(net.proj(x))
    assert column_major_projections(net) == 2
    assert net.proj.weight.shape == (20, 12) and net.proj.weight.stride() == (1, 20)
    assert net.down.weight.stride() == (1, 12) and not net.down.weight.is_contiguous()
    assert net.lm_head.weight.is_contiguous(), "the LM head stays row-major"
    assert column_major_projections(net) == 0, "already column-major: nothing to do"
    after = net.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(net.down(net.proj(x)), ref, atol=1e-5, rtol=1e-5)
    assert isinstance(net.proj.weight, nn.Parameter) and net.proj.weight.requires_grad
    save_safetensors(dict(after), tmp_path / "w.safetensors")  # checkpoints still write



def test_two_layout_heads_keep_the_parameters_and_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head keeps its (tied) parameter and state dict; products of FEW_ROWS rows read a column-major copy of the
    same values, others the weight itself."""
    torch.manual_seed(0)
    emb = nn.Embedding(30, 12)
    net = _Net()
    net.lm_head.weight = emb.weight  # tied
    before = {k: v.clone() for k, v in net.state_dict().items()}
    xs = {rows: torch.randn(rows, 12) for rows in (1, FEW_ROWS.start, FEW_ROWS.stop - 1, FEW_ROWS.stop)}
    refs = {rows: net.lm_head(x) for rows, x in xs.items()}
    assert two_layout_heads(net) == 1 and two_layout_heads(net) == 0
    head = net.lm_head
    assert isinstance(head, TwoLayoutLinear) and head.weight is emb.weight
    assert head.weight_cm.stride() == (1, 30) and torch.equal(head.weight_cm, emb.weight)
    assert net.state_dict().keys() == before.keys()
    assert all(torch.equal(net.state_dict()[k], before[k]) for k in before)
    read: list[bool] = []
    linear = F.linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        read.append(w is head.weight_cm)
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", spy)
    for rows, x in xs.items():
        torch.testing.assert_close(head(x), refs[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head(x[None]), refs[rows][None], atol=1e-5, rtol=1e-5)  # [1, rows, K]
    assert read == [False, False, True, True, True, True, False, False]
