"""The CPU kernels (`csrc/qmatmul.cpp`, `csrc/attention.cpp`): build, load, weight packing, portable fallback.

The C++ extension is built once by `scripts/setup.sh` (`qkernel.main`) through
`torch.utils.cpp_extension` into torch's extension folder (`$TORCH_EXTENSIONS_DIR`); later loads reuse it. Its op
`specserve_q::qmatmul` picks the AVX512-VNNI path where the CPU runs it, else a scalar path with the same float
operations in the same order, so every path and every row count give a row bit-identical results; its op
`specserve_q::attend_rows` is attention computed per query row (`layers/attention.py`). Where no
compiler exists, `reference_qmatmul` computes the same blocked products in PyTorch (row-invariant too, not
bit-identical to the kernel).

Packed layout (per group of 16 output channels and block of 32 along K; see the C++ source): Q4 256 bytes,
Q8 512 bytes, fp16 scales d [G, nb, 16] (and m for Q4_1's w = d q + m), Q8's int32 corr = 128 sum(q).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK = 32
LANES = 16
KINDS = {"int4": 4, "int8": 8}
PATHS = {"auto": 0, "scalar": 1, "avx2": 3, "avx512vnni": 2}  # worst to best
_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("qmatmul.cpp", "attention.cpp", "layers.cpp",
                                                                       "peaks.cpp")]


@functools.cache
def load_kernel(verbose: bool = False) -> bool:
    """Build (first time) and load the extension; False, with a warning, where that fails (no compiler)."""
    if hasattr(torch.ops.specserve_q, "qmatmul"):
        return True
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name="specserve_qmatmul", sources=[str(p) for p in _SOURCES], is_python_module=False,
                           extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], verbose=verbose)
    except Exception as e:  # any build failure means the fallback
        warnings.warn(f"specserve: the quantized kernel could not be built ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); int4/int8 products run the slower PyTorch "
                      "fallback. Install g++ and ninja, then run scripts/setup.sh.", stacklevel=2)
        return False
    torch.library.register_fake("specserve_q::qmatmul")(_qmatmul_shape)
    torch.library.register_fake("specserve_q::attend_rows")(_attend_shape)
    torch.library.register_fake("specserve_q::qlinear")(_qlinear_shape)
    torch.library.register_fake("specserve_q::attend_paged")(_attend_paged_shape)
    return True


def kernel_loaded() -> bool:
    """Whether the extension's ops are registered (`load_kernel` ran and succeeded): a check that compiled steps
    trace to a constant, where calling the cached `load_kernel` would make dynamo trace the loader itself."""
    return hasattr(torch.ops.specserve_q, "attend_rows")


def _qmatmul_shape(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, corr: torch.Tensor,
                   kind: int, path: int = 0) -> torch.Tensor:
    return x.new_empty(x.shape[0], d.shape[0] * LANES)


def _attend_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as the kernel returns it


def _qlinear_shape(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, corr: torch.Tensor,
                   kind: int, n_out: int, prologue: int, norm_w: torch.Tensor | None, eps: float,
                   bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], n_out)


def _attend_paged_shape(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                        vc: torch.Tensor, write: torch.Tensor, read: torch.Tensor, mask: torch.Tensor | None,
                        grid: torch.Tensor | None, n_heads: int, n_kv: int, scale: float) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], n_heads * kc.shape[2])


def kernel_paths() -> list[str]:
    """The kernel's paths this machine runs (`scalar` always, once built), for tests and benchmarks."""
    if not load_kernel():
        return []
    return [name for name, code in PATHS.items() if code and torch.ops.specserve_q.path_available(code)]


@dataclass(frozen=True)
class PackedWeight:
    """A weight [N, K] in the kernel's layout: `kind` int4 (Q4_1 blocks) or int8 (Q8_0 blocks)."""

    kind: str
    n: int  # output channels before padding to a multiple of 16
    w: torch.Tensor  # [G * nb * 256 | 512] uint8
    d: torch.Tensor  # [G, nb, 16] fp16
    m: torch.Tensor  # [G, nb, 16] fp16 (int4) or empty
    corr: torch.Tensor  # [G, nb, 16] int32 (int8) or empty

    @property
    def k(self) -> int:
        return self.d.shape[1] * BLOCK


def _groups(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [G*16, ...], zero rows appended up to a multiple of 16."""
    pad = -t.shape[0] % LANES
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _lanes(s: torch.Tensor, g: int) -> torch.Tensor:
    """Per-block values [G*16, nb] -> [G, nb, 16]."""
    return s.reshape(g, LANES, -1).permute(0, 2, 1).contiguous()


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> PackedWeight:
    """Blocks w = d * q + m (q [N, K] in 0..15, d and m [N, K/32]) -> the int4 layout (d, m as fp16)."""
    n, k = q.shape
    qg = _groups(q.to(torch.uint8))
    g, nb = qg.shape[0] // LANES, k // BLOCK
    v = qg.reshape(g, LANES, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [G, nb, j, lane, t, half]
    w = (v[..., 0] | (v[..., 1] << 4)).contiguous().reshape(-1)
    return PackedWeight("int4", n, w, _lanes(_groups(d.float()).half(), g), _lanes(_groups(m.float()).half(), g),
                        torch.empty(0, dtype=torch.int32))


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> PackedWeight:
    """Blocks w = d * q (q [N, K] int8, -128 included, d [N, K/32]) -> the int8 layout (d as fp16)."""
    n, k = q.shape
    qg = _groups(q.to(torch.int8))
    g, nb = qg.shape[0] // LANES, k // BLOCK
    v = qg.reshape(g, LANES, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [G, nb, p, lane, t]
    w = v.contiguous().reshape(-1).view(torch.uint8)
    corr = 128 * qg.reshape(g * LANES, nb, BLOCK).sum(-1, dtype=torch.int32)
    return PackedWeight("int8", n, w, _lanes(_groups(d.float()).half(), g), torch.empty(0, dtype=torch.float16),
                        _lanes(corr, g).to(torch.int32))


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [N, K] weight -> Q8_0 blocks (q [N, K] int8, d [N, K/32]): per block d = amax / 127."""
    n, k = w.shape
    g = w.float().reshape(n, k // BLOCK, BLOCK)
    d = g.abs().amax(-1) / 127.0
    q = (g / torch.where(d > 0, d, torch.ones_like(d))[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), d


def unpack_blocks(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed weight as blocks: (q [N, nb, 32] float32 integers, d [N, nb], m [N, nb] or None for int8),
    from the fp16 scales the kernel reads."""
    g, nb = p.d.shape[0], p.d.shape[1]
    if p.kind == "int4":
        v = p.w.reshape(g, nb, 4, LANES, 4)
        q = torch.stack([v & 0x0F, v >> 4], dim=-1).permute(0, 3, 1, 2, 5, 4)  # [G, lane, nb, j, half, t]
    else:
        q = p.w.view(torch.int8).reshape(g, nb, 8, LANES, 4).permute(0, 3, 1, 2, 4)  # [G, lane, nb, p, t]
    q = q.reshape(g * LANES, nb, BLOCK)[: p.n].float()

    def per_channel(s: torch.Tensor) -> torch.Tensor:
        return s.permute(0, 2, 1).reshape(-1, nb)[: p.n].float()

    return q, per_channel(p.d), per_channel(p.m) if p.kind == "int4" else None


def unpack(p: PackedWeight) -> torch.Tensor:
    """The packed weight's values, [N, K] float32."""
    q, d, m = unpack_blocks(p)
    w = q * d[..., None] + (m[..., None] if m is not None else 0.0)
    return w.reshape(p.n, -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, nb, 32] float32 holding integers in -127..127, scale [M, nb]), as the
    kernel quantizes its input: per row and block of 32, scale = amax / 127, q = round_half_even(x * 127 / amax)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (xb * inv[..., None]).round().clamp(-127, 127), amax / 127.0


def reference_qmatmul(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    """The kernel's product in PyTorch: x [M, K] float32 -> [M, N].

    The quantized integers and each block's integer dot product are exact in float32 (|sum| < 2^24), so this
    differs from the kernel only in how the per-block terms are summed."""
    xq, xd = quantize_activations(x)  # [M, nb, 32], [M, nb]
    q, d, m = unpack_blocks(p)  # [N, nb, 32], [N, nb], [N, nb]
    y = torch.einsum("mbk,nbk->mnb", xq, q) * (d[None] * xd[:, None])  # [M, N, nb]
    if m is not None:
        y = y + m[None] * (xd * xq.sum(-1))[:, None]
    return y.sum(-1)


def qmatmul(x: torch.Tensor, p: PackedWeight, path: str = "auto") -> torch.Tensor:
    """x [M, K] float32 times the packed weight -> [M, N] float32, through the kernel (which must be loaded)."""
    y = torch.ops.specserve_q.qmatmul(x, p.w, p.d, p.m, p.corr, KINDS[p.kind], PATHS[path])
    return y if y.shape[1] == p.n else y[:, : p.n]


def main() -> int:
    """Build the extension now (scripts/setup.sh) and name its paths; 0 on success."""
    print("specserve: building the quantized kernel (torch.utils.cpp_extension, about a minute)...", flush=True)
    if not load_kernel(verbose=False):
        return 1
    print(f"specserve: quantized kernel ready, paths {', '.join(kernel_paths())}", flush=True)
    return 0

