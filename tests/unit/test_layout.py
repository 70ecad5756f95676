"""`models/layout.py`: projection weights stored column-major keep their shape, values and names."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.models.layout import column_major_projections
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
