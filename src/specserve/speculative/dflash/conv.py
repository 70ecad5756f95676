"""DFlash 2's grouped dynamic causal convolution, one around each attention and MLP sublayer of the drafter.

Hidden channels are cut into groups of `group_size`. Per position t, a linear projection of the (normed) sublayer
input gives K taps per group for the convolution before the sublayer and K more for the one after it; a learnt
per-channel base kernel is added to each:
    y[t, c] = sum_{o < K} (base[o, c] + dyn[t, o, group(c)]) * x[t - o, c]     (x before the segment's start = 0)
The taps look only at a position and the ones before it, never across a block's boundary: a segment is one
block (inference: the whole sequence; training: each of the N blocks laid end to end).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                        segment: int | None = None) -> torch.Tensor:
    """x [B, L, H]; dynamic [B, L, K, G] taps per position and group; base [K, H] -> [B, L, H].
    segment: positions per block (L a multiple of it); None: the whole sequence is one block."""
    b, length, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    seg = length if segment is None else segment
    if length % seg:
        raise ValueError(f"sequence length {length} is not a whole number of {seg}-position blocks")
    xs = x.view(b, length // seg, seg, groups, group_size)
    dyn = dynamic.reshape(b, length // seg, seg, taps, groups, 1)
    out = torch.zeros_like(xs)
    for o in range(min(taps, seg)):
        shifted = xs if o == 0 else F.pad(xs[:, :, :-o], (0, 0, 0, 0, o, 0))  # x[t - o], zeros before the block
        out = out + base[o].view(groups, group_size).to(x.dtype) * shifted
        out = torch.addcmul(out, dyn[:, :, :, o], shifted)
    return out.view(b, length, hidden)


class GroupedCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: `before` on its input, `after` on its output, both with taps
    projected from the input (z-lab's layout: `base_kernel` [2, K, H], `kernel_projection` [2*K*G, H])."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def before(self, x: torch.Tensor, segment: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, H] the normed sublayer input -> (convolved x [B, L, H], the `after` taps [B, L, K, G])."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return (grouped_causal_conv(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size, segment),
                dyn[..., 1, :, :])

    def after(self, y: torch.Tensor, taps: torch.Tensor, segment: int | None) -> torch.Tensor:
        """y [B, q, H] the sublayer's output at the first q positions; taps [B, >=q, K, G] from `before`."""
        return grouped_causal_conv(y, taps[:, : y.shape[1]], self.base_kernel[1], self.group_size, segment)

    def reset_identity(self) -> None:
        """Taps that pass x through unchanged (base tap 0 = 1, the rest and the projection 0): a DFlash drafter
        given these convolutions computes exactly what it did without them."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()
