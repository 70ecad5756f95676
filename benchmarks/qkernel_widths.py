"""The quantized product kernel against PyTorch's own, per width, on SmolLM2-135M's 30 layers of projections.

    python benchmarks/qkernel_widths.py --rounds 5 > runs/qkernel_widths.json

The weights are the real target's Q4_1 blocks as stored (int4) and the same values re-cut into Q8_0 blocks
(int8). Arms, each over the 30 layers' four products (fused qkv, o, fused gate/up, down) at M rows:
- `qmatmul_int4`, `qmatmul_int8`: specserve's kernel (`layers/csrc/qmatmul.cpp`), float32 activations, on the
  path this CPU picks (and `..._scalar`, its portable path, at 1 and 16 rows);
- `aten_int4pack`: `aten._weight_int4pack_mm_for_cpu` (bf16 activations), the previous narrow int4 product;
- `aten_int8pack`: `aten._weight_int8pack_mm` (bf16 activations, per-channel int8);
- `onednn_bf16`: oneDNN's bf16 product on a pre-packed bf16 copy, the previous wide path.
Rounds interleave the arms, the order reversed every other round; each figure is the median over rounds of the
best of 3 calls, ms. Also each kernel's 16-row cost over its 1-row cost, per round (median and spread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from specserve.bench.machine import cpu_info
from specserve.layers import qkernel as qk
from specserve.models.gguf import GGUFModel
from specserve.models.gguf_dir import smollm2_gguf
from specserve.models.gguf_quants import Q4Blocks

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
GROUP = 32


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks -> aten's int4 layout: w = (q - 8) * scale + zero with scale = d, zero = m + 8 d (bf16)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    sz = torch.stack([d.t(), (m + 8.0 * d).t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def onednn_packed(w: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight reordered for oneDNN's product."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 16)


def onednn_bf16(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def layer_blocks(model: GGUFModel) -> list[Q4Blocks]:
    """The 30 layers' fused projections as Q4 blocks, in forward order."""
    q4 = model.q4()
    layers = sorted({int(n.split(".")[2]) for n in q4})
    return [Q4Blocks.cat([q4[f"model.layers.{i}.{p}.weight"] for p in parts])
            for i in layers for parts in PARTS.values()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    assert qk.load_kernel(), "the kernel did not build: see the warning above"
    blocks = layer_blocks(GGUFModel(smollm2_gguf()))
    ks = [b.q.shape[1] for b in blocks]
    p4 = [qk.pack_q4(b.q, b.d, b.m) for b in tqdm(blocks, desc="packing int4", leave=False)]
    p8 = [qk.pack_q8(*qk.quantize_q8(b.dequantize())) for b in tqdm(blocks, desc="packing int8", leave=False)]
    old4 = [pack_int4(b.q, b.d, b.m) for b in blocks]
    old8 = []
    for b in blocks:
        w = b.dequantize()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        old8.append(((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale.bfloat16()))
    no_onednn = None  # why oneDNN's bf16 arm is left out: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT
    try:
        dense = [onednn_packed(b.dequantize().bfloat16().contiguous()) for b in blocks]
    except RuntimeError as e:
        dense, no_onednn = [], str(e).splitlines()[0]
    path = qk.kernel_paths()[-1]

    def over(items: list, call: Callable) -> Callable[[tuple[torch.Tensor, torch.Tensor]], None]:
        def run(xs: tuple[torch.Tensor, torch.Tensor]) -> None:
            for item, k in zip(items, ks, strict=True):
                call(item, xs[0 if k == ks[0] else 1])
        return run

    arms: dict[str, tuple[Callable, bool]] = {  # name -> (pass over all products, bf16 input)
        "qmatmul_int4": (over(p4, lambda p, x: qk.qmatmul(x, p, path)), False),
        "qmatmul_int8": (over(p8, lambda p, x: qk.qmatmul(x, p, path)), False),
        "aten_int4pack": (over(old4, lambda o, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, o[0], GROUP, o[1])),
                          True),
        "aten_int8pack": (over(old8, lambda o, x: torch.ops.aten._weight_int8pack_mm(x, o[0], o[1])), True),
        "onednn_bf16": (over(dense, lambda w, x: onednn_bf16(x, w)), True),
    }
    if no_onednn:
        del arms["onednn_bf16"]
    scalar = {"qmatmul_int4_scalar": over(p4, lambda p, x: qk.qmatmul(x, p, "scalar")),
              "qmatmul_int8_scalar": over(p8, lambda p, x: qk.qmatmul(x, p, "scalar"))}
    k_small, k_big = ks[0], max(ks)
    runs: dict[str, dict[int, list[float]]] = {n: {w: [] for w in WIDTHS} for n in arms}
    runs.update({n: {w: [] for w in (1, 16)} for n in scalar})
    for r in tqdm(range(a.rounds), desc="rounds"):
        names = list(arms) if r % 2 == 0 else list(reversed(arms))
        for w in WIDTHS:
            xf = (torch.randn(w, k_small), torch.randn(w, k_big))
            xb = (xf[0].bfloat16(), xf[1].bfloat16())
            for n in names:
                fn, bf = arms[n]
                runs[n][w].append(_best(fn, xb if bf else xf))
            if w in (1, 16):
                for n, fn in scalar.items():
                    runs[n][w].append(_best(fn, xf))
    out = {"cpu": cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__, "kernel_path": path,
           "rounds": a.rounds, "ms_30_layers": {n: {w: round(statistics.median(v), 2) for w, v in t.items()}
                                                 for n, t in runs.items()},
           "ratio_16_over_1": {}, "all_rounds": runs}
    if no_onednn:
        out["onednn_bf16"] = f"not on this CPU: {no_onednn}"
    for n, t in runs.items():
        ratios = [b / a_ for a_, b in zip(t[1], t[16], strict=True)]
        out["ratio_16_over_1"][n] = {"median": round(statistics.median(ratios), 2),
                                     "min": round(min(ratios), 2), "max": round(max(ratios), 2)}
    print(json.dumps(out, indent=1))


def _best(fn: Callable, xs: tuple[torch.Tensor, torch.Tensor]) -> float:
    fn(xs)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn(xs)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


if __name__ == "__main__":
    main()
