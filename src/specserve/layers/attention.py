"""Scaled dot-product attention over keys/values that a KV view returns."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.layers.qkernel import kernel_loaded


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, K, D], mask [B|1, 1, Q|1, K] bool or None -> [B, Hq, Q, D].

    On the CPU in float32, with the kernel loaded (`qkernel.load_kernel`, which the model's layers call), each
    query row is computed on its own over the keys its mask admits (`specserve_q::attend_rows`): a token's result
    is then the same in a verify of many tokens as in a one-token step, which keeps greedy speculation exact under
    int4/int8. A head dimension off a multiple of 16 is padded with zeros (exact: they add nothing to a dot
    product). Elsewhere (training, other devices and dtypes, per-head or additive masks), SDPA, which takes
    grouped-query attention as such (no copies of K/V per query group).
    """
    if (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[-1] <= 256
            and not (q.requires_grad or k.requires_grad or v.requires_grad)  # the kernel has no backward
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1))
            and kernel_loaded()):
        if mask is not None:
            mask = mask.expand(mask.shape[0], 1, q.shape[2], k.shape[2])
        d = q.shape[-1]
        if d % 16:
            pad = (0, -d % 16)
            out = torch.ops.specserve_q.attend_rows(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), mask, scale)
            return out[..., :d]
        return torch.ops.specserve_q.attend_rows(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def attend_paged(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    write_slots: torch.Tensor, read_slots: torch.Tensor, mask: torch.Tensor | None, grid: torch.Tensor | None,
    n_heads: int, n_kv: int, scale: float,
) -> torch.Tensor:
    """A decoder layer's attention on a paged float32 cache in one kernel call (`specserve_q::attend_paged`): RoPE
    on qkv's q and k heads, the new K/V written at `write_slots`, each (token, head) attended in place over the
    slots of `read_slots` its mask admits; the same bits as RoPE, `PagedView.update` and `attend`. qkv [T,
    (Hq + 2 Hkv) D]; cos/sin [T, rot]; caches [S, Hkv, D] (D a multiple of 16, at most 256); write_slots [T];
    read_slots [B, K]; mask [B, 1, Q, K] or None; grid [T] each token's place in the [B, Q] grid (None: in order)
    -> [T, Hq D]. The kernel must be loaded."""
    return torch.ops.specserve_q.attend_paged(qkv, cos, sin, k_cache, v_cache, write_slots, read_slots, mask, grid,
                                              n_heads, n_kv, scale)
