"""The CPU step against the machine's own limits: what this machine can do, and how close the real target's
products and whole forwards come to it.

    python benchmarks/roofline.py --rounds 3 --llama-cpp > runs/roofline.json

Measured in one process, the arms interleaved (the order reversed every other round), medians over rounds:
- the machine: read bandwidth (a float32 sum over 400 MB, best of 5), the int8 multiply-add peak of each kernel
  path's instruction (`specserve_q::peak`: vpdpbusd for AVX512-VNNI, vpmaddubsw + vpaddw for AVX2) and the float32
  FMA peak, on torch's threads;
- the products: SmolLM2-135M's int4 projections (30 layers) and its int8 LM head, as the engine loads them, on
  every kernel path this CPU runs, at 1..64 rows: ms, the one-row read rate as a fraction of the bandwidth (every
  weight byte counted, the head included) and each width's multiply-adds as a fraction of its path's int8 peak;
- the forward: the engine's default (eager) target forward after 128 tokens of context, at 1..32 new tokens (what
  a verify of that width costs), its ratio to one token, its ratio to its products and attention timed alone, and
  the one-token forward's read rate as a fraction of the bandwidth (every weight byte the step reads);
- decoding: plain greedy tokens/s at batch 1 and 16 through `LLM.generate`;
- with `--llama-cpp`: llama.cpp on the same GGUF file and threads (`llama-bench` decode `-p 0 -n 64` and prompt
  batches of 1/4/16), built once from the llama-cpp-python sdist (`bench/llama_cpp.py`, the folder `bench peers`
  uses).
The goals of the CPU-step issue are printed beside the figures (`goals`), for whatever machine this runs on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.bench import llama_cpp
from specserve.bench.machine import cpu_info
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.runner import Row
from specserve.layers import qkernel as qk
from specserve.layers.attention import attend_paged
from specserve.layers.quant import QuantLinear
from specserve.models.gguf_dir import smollm2_gguf
from specserve.types import SamplingParams

WIDTHS = (1, 2, 4, 8, 16, 32, 64)
FORWARD_WIDTHS = (1, 2, 4, 8, 16, 32)
PEAK_OF_PATH = {"avx512vnni": 0, "avx2": 1}  # `specserve_q::peak` ids
CONTEXT = 128


def best_of(fn: Callable[[], object], reps: int = 3) -> float:
    """Seconds of the fastest of `reps` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bandwidth_gbs() -> float:
    x = torch.ones(100_000_000)  # 400 MB, far beyond any cache
    x.sum()
    return 400e6 / best_of(x.sum, 5) / 1e9


def packed_bytes(lin: QuantLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (lin.w, lin.d, lin.m, lin.corr))


def forward_fn(llm: LLM, q: int) -> Callable[[], object]:
    """One eager target forward of q new tokens after CONTEXT tokens of context (logits at every new token)."""
    engine = llm.make_engine(EngineConfig(num_kv_blocks=(CONTEXT + 64) // 16 + 1, enforce_eager=True), plain=True)
    runner = engine.runner
    runner.forward([Row(list(range(100, 100 + CONTEXT)), list(range(CONTEXT)), list(range(CONTEXT)), [],
                        logits="none")])
    row = Row(list(range(200, 200 + q)), list(range(CONTEXT, CONTEXT + q)), list(range(CONTEXT, CONTEXT + q)),
              list(range(CONTEXT)))
    return lambda: runner.forward([row])


def attention_fn(llm: LLM, q: int) -> Callable[[], object]:
    """The 30 layers' attention of one forward of q new tokens after CONTEXT tokens, alone: `attend_paged` on a
    cache of the target's shape (RoPE, the KV write and the attention over the context and the new tokens)."""
    cfg = llm.model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    caches = [torch.randn(CONTEXT + q + 1, hkv, d) for _ in range(2)]
    qkv = torch.randn(q, (hq + 2 * hkv) * d)
    cos, sin = llm.model.rotary.cos_sin(torch.arange(CONTEXT, CONTEXT + q)[None], torch.float32)
    cos, sin = cos.reshape(q, -1), sin.reshape(q, -1)
    write = torch.arange(CONTEXT, CONTEXT + q)
    read = torch.arange(CONTEXT + q)[None]
    mask = torch.ones(1, 1, q, CONTEXT + q, dtype=torch.bool)
    mask[0, 0, :, CONTEXT:] = torch.ones(q, q, dtype=torch.bool).tril()

    def run() -> None:
        for _ in range(cfg.num_hidden_layers):
            attend_paged(qkv, cos, sin, *caches, write, read, mask, None, hq, hkv, d**-0.5)
    return run


def llama_bench(llama: llama_cpp.LlamaCpp, gguf: Path, threads: int) -> dict[str, float]:
    """llama.cpp's decode (-p 0 -n 64) and prompt batches of 1/4/16 tokens, tokens/s (mean of its repetitions
    after the first)."""
    t = str(threads)
    out, _ = llama.run("llama-bench", ["-m", str(gguf), "-p", "0", "-n", "64", "-t", t, "-r", "4", "-o", "json"],
                       threads)
    res = {"tg64": statistics.mean(llama_cpp.parse_bench_json(out)[1:])}
    for n in (1, 4, 16):
        out, _ = llama.run("llama-bench", ["-m", str(gguf), "-n", "0", "-p", str(n), "-t", t, "-r", "6", "-o",
                                           "json"], threads)
        res[f"pp{n}"] = statistics.mean(llama_cpp.parse_bench_json(out)[1:])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp on the same file (built once, ~20 min)")
    ap.add_argument("--llama-cpp-work", type=Path, default=Path("runs/peers"), help="where llama.cpp is built")
    ap.add_argument("--decode-tokens", type=int, default=64)
    a = ap.parse_args()
    assert qk.load_kernel(), "the kernel did not build: see the warning above"
    threads = torch.get_num_threads()
    gguf = smollm2_gguf()
    llm = LLM("smollm2", quantization="int4", enforce_eager=True, prefix_cache=False)
    mods = [m for m in llm.model.modules() if isinstance(m, QuantLinear)]  # 120 projections, then the head
    n_bytes = sum(packed_bytes(m) for m in mods)
    macs_per_row = sum(m.in_features * m.out_features for m in mods)
    paths = [p for p in qk.kernel_paths() if p != "scalar"]
    packs = [m.packed() for m in mods]
    xs = {w: [torch.randn(w, m.in_features) for m in mods] for w in WIDTHS}
    forwards = {q: forward_fn(llm, q) for q in FORWARD_WIDTHS}
    attentions = {q: attention_fn(llm, q) for q in FORWARD_WIDTHS}
    llama = llama_cpp.build(llama_cpp.fetch_sources(a.llama_cpp_work / "src")) if a.llama_cpp else None
    prompts = ["def fizzbuzz(n):", "class Stack:", "import os\n", "def merge_sort(items):"] * 4
    params = SamplingParams(max_new_tokens=a.decode_tokens, ignore_eos=True)

    arms: dict[str, Callable[[], Any]] = {"bandwidth": bandwidth_gbs}
    for name, which in (("int8_vnni", 0), ("int8_avx2", 1), ("fp32_fma", 2)):
        arms[f"peak_{name}"] = lambda which=which: torch.ops.specserve_q.peak(which, 4_000_000) / 1e9
    for path in paths:
        for w in WIDTHS:
            def products(path: str = path, w: int = w) -> float:
                def run() -> None:
                    for x, p in zip(xs[w], packs, strict=True):
                        qk.qmatmul(x, p, path)
                return 1e3 * best_of(run)
            arms[f"products_{path}_{w}"] = products
    for q in FORWARD_WIDTHS:
        arms[f"forward_{q}"] = lambda q=q: 1e3 * best_of(forwards[q])
        arms[f"attention_{q}"] = lambda q=q: 1e3 * best_of(attentions[q])
    arms["decode_b1"] = lambda: a.decode_tokens / best_of(lambda: llm.generate(prompts[:1], params), 1)
    arms["decode_b16"] = lambda: 16 * a.decode_tokens / best_of(lambda: llm.generate(prompts, params), 1)
    if llama is not None:
        arms["llama_cpp"] = lambda: llama_bench(llama, gguf, threads)
    for fn in arms.values():  # warm-up: caches, the kernel's pool, the engine's buffers
        if fn is not arms.get("llama_cpp"):
            fn()
    got: dict[str, list[Any]] = {k: [] for k in arms}
    for r in tqdm(range(a.rounds), desc="rounds"):
        for key in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            got[key].append(arms[key]())
    med = {k: statistics.median(v) for k, v in got.items() if k != "llama_cpp"}

    bw = med["bandwidth"]
    peaks = {"int8_vnni": med["peak_int8_vnni"], "int8_avx2": med["peak_int8_avx2"], "fp32_fma": med["peak_fp32_fma"]}
    products: dict[str, Any] = {}
    for path in paths:
        peak = peaks["int8_vnni" if path == "avx512vnni" else "int8_avx2"]
        ms = {w: med[f"products_{path}_{w}"] for w in WIDTHS}
        # the read rate against the bandwidth measured beside it in the same round (the machine's varies)
        per_round = [n_bytes / t / 1e6 / b for t, b in zip(got[f"products_{path}_1"], got["bandwidth"], strict=True)]
        products[path] = {
            "ms": {w: round(v, 3) for w, v in ms.items()},
            "one_row_gbs": round(n_bytes / ms[1] / 1e6, 2),
            "one_row_of_bandwidth": round(statistics.median(per_round), 3),
            "one_row_of_bandwidth_rounds": [round(x, 3) for x in per_round],
            "of_int8_peak": {w: round(macs_per_row * w / ms[w] / 1e6 / peak, 3) for w in WIDTHS},
            "ratio_to_one_row": {w: round(ms[w] / ms[1], 2) for w in WIDTHS},
        }
    best = paths[-1] if paths else None  # kernel_paths lists worst to best: the one the engine runs
    fwd = {q: med[f"forward_{q}"] for q in FORWARD_WIDTHS}
    att = {q: med[f"attention_{q}"] for q in FORWARD_WIDTHS}
    forward: dict[str, Any] = {"ms": {q: round(v, 3) for q, v in fwd.items()},
                               "attention_ms": {q: round(v, 3) for q, v in att.items()},
                               "ratio_to_one_token": {q: round(v / fwd[1], 2) for q, v in fwd.items()}}
    if best is not None:
        prod = products[best]["ms"]
        # the forward against its parts timed alone (each product a call of its own, paying a parallel region
        # that the forward's one team of threads does not): above 1 is time outside products and attention
        forward["over_products_and_attention"] = {q: round(fwd[q] / (prod[q] + att[q]), 3) for q in FORWARD_WIDTHS}
    # the whole one-token forward's read rate: every weight byte the step reads, against its round's bandwidth
    per_round = [n_bytes / t / 1e6 / b for t, b in zip(got["forward_1"], got["bandwidth"], strict=True)]
    forward["one_token_gbs"] = round(n_bytes / fwd[1] / 1e6, 2)
    forward["one_token_of_bandwidth"] = round(statistics.median(per_round), 3)
    forward["one_token_of_bandwidth_rounds"] = [round(x, 3) for x in per_round]
    result: dict[str, Any] = {
        "benchmark": "roofline", "command_line": sys.argv, "cpu": cpu_info(), "threads": threads,
        "torch": torch.__version__, "rounds": a.rounds, "kernel_path": best,
        "machine": {"read_gbs": round(bw, 2), "rounds_read_gbs": [round(x, 2) for x in got["bandwidth"]],
                    "peak_g_per_s": {k: round(v, 1) for k, v in peaks.items()}},
        "weights": {"bytes": n_bytes, "multiply_adds_per_row": macs_per_row, "products": len(mods),
                    "floor_ms_at_bandwidth": round(n_bytes / bw / 1e6, 3)},
        "products": products, "forward": forward,
        "decode_tok_s": {"batch1": round(med["decode_b1"], 1), "batch16": round(med["decode_b16"], 1),
                         "rounds_batch1": [round(x, 1) for x in got["decode_b1"]],
                         "batch16_over_batch1": round(med["decode_b16"] / med["decode_b1"], 2)},
    }
    if llama is not None:
        runs = got["llama_cpp"]
        lc = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
        result["llama_cpp"] = {"sdist": llama_cpp.SDIST_VERSION, "tok_s": lc,
                               "rounds_tg64": [round(r["tg64"], 1) for r in runs],
                               # llama.cpp reads about the file's bytes per token
                               "one_row_of_bandwidth": round(gguf.stat().st_size * lc["tg64"] / 1e9 / bw, 3)}
        ratios = [ours / r["tg64"] for ours, r in zip(got["decode_b1"], runs, strict=True)]  # paired by round
        result["decode_over_llama_cpp"] = round(statistics.median(ratios), 2)
        result["decode_over_llama_cpp_rounds"] = [round(x, 2) for x in ratios]
    if best is not None:
        result["goals"] = {
            "forward_one_token_of_bandwidth >= 0.75": forward["one_token_of_bandwidth"],
            "16_rows_of_int8_peak >= 0.5": products[best]["of_int8_peak"][16],
            "forward_16_over_1 <= 2.5 (AVX2) / 1.5 (AVX512-VNNI)": forward["ratio_to_one_token"][16],
            "forward_over_products_and_attention_at_1 <= 1.15": forward["over_products_and_attention"][1],
            "batch16_over_batch1 >= 6": result["decode_tok_s"]["batch16_over_batch1"],
            "decode_over_llama_cpp >= 1.5": result.get("decode_over_llama_cpp"),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
