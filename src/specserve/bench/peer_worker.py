"""One in-process peer (specserve compiled or eager, or transformers) on one dtype and thread count, in a process of
its own: `specserve bench peers` starts one per cell, so each keeps its thread count and compiled graphs while the
runs of all peers interleave.

    python -m specserve.bench.peer_worker --system specserve --model demo --dtype float32 --threads 2

Protocol (JSON lines): the worker prints {"ready": true, "load_s"} once loaded; then for each request line
{"method": "plain" | SPEC | "floor" | "compile", "prompts": [[ids]], "batch": B, "new_tokens": N} it prints
{"seconds", "outputs": [[ids]], "accept_length"} (greedy, EOS ignored, the prompts in batches of B, one after
another), {"floor_ms"} (the matmul floor of one decode step) or, for "compile", {"seconds"} once every compiled
bucket up to B rows and every drafter's verify width is compiled (nothing to do for eager peers). SPEC: a
speculative method the worker was started with (`--speculative ngram,suffix`: specserve takes any
`--speculative-algorithm`, lower-cased; transformers only `ngram`, its prompt lookup). `--dtype int4` runs a
GGUF model's weights in int4 (`--quantization int4`). Logs go to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SYSTEMS = ("specserve", "specserve-eager", "transformers")

# (prompts' ids, new tokens) -> (outputs' ids, accept length per verify step over all prompts; empty when plain)
Decode = Callable[[list[list[int]], int], tuple[list[list[int]], list[int]]]
# max rows -> None: compiles what timed calls could meet (specserve's `LLM.warm_compiled`)
Compile = Callable[[int], None]


def matmul_floor_ms(model: nn.Module, reps: int = 200) -> float:
    """Median ms of one row through every projection and the LM head (`F.linear` on the stored layouts, or the
    quantized layers' own kernel): what a decode step at batch 1 costs with no overhead and these kernels."""
    from specserve.layers.quant import QuantLinear

    mods = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    xs = {(m.in_features, _dtype(m)): torch.randn(1, m.in_features, dtype=_dtype(m), device=_device(m))
          for m in mods}
    sync = torch.cuda.synchronize if _device(mods[0]).type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        for i in range(reps + 20):
            sync()
            t0 = time.perf_counter()
            for m in mods:
                m(xs[(m.in_features, _dtype(m))])
            sync()
            if i >= 20:
                times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _dtype(m: nn.Module) -> torch.dtype:
    return m.weight.dtype if isinstance(m, nn.Linear) else torch.float32  # quantized layers read float32


def _device(m: nn.Module) -> torch.device:
    return (m.weight if isinstance(m, nn.Linear) else next(m.buffers())).device


def specserve_methods(model: str, dtype: str, eager: bool,
                      speculative: tuple[str, ...] = ("ngram",)) -> tuple[dict[str, Decode], nn.Module, Compile]:
    from specserve.config import SpeculativeConfig
    from specserve.engine.llm import LLM, default_draft_dtype
    from specserve.speculative.factory import DrafterBuilder, plan_drafter
    from specserve.speculative.suffix_index import SuffixCache
    from specserve.types import SamplingParams

    quantization = "int4" if dtype == "int4" else "none"
    # no prefix cache: rounds repeat the prompts, and llama.cpp and transformers prefill them every time
    llm = LLM(model, device="cpu", dtype="float32" if dtype == "int4" else dtype, enforce_eager=eager,
              quantization=quantization, prefix_cache=False)

    def plain(ids: list[list[int]], n: int) -> tuple[list[list[int]], list[int]]:
        outs = llm.generate_plain(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        return [o.token_ids for o in outs], []

    def drafting(method: str) -> Decode:
        spec = SpeculativeConfig.resolve(method.upper())
        builder = DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device,
                                 default_draft_dtype(spec.algorithm, llm.dtype, llm.device))

        def decode(ids: list[list[int]], n: int) -> tuple[list[list[int]], list[int]]:
            if builder.suffix_cache is not None:  # outputs of this call's prompts only: rounds repeat the prompts
                builder.suffix_cache = SuffixCache(spec.suffix_max_cached_requests)
            outs = llm.generate_with(builder, ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
            return [o.token_ids for o in outs], [a for o in outs for a in o.accept_lengths]

        return decode

    return {"plain": plain, **{m: drafting(m) for m in speculative}}, llm.model, llm.warm_compiled


def transformers_methods(model: str, dtype: str,
                         speculative: tuple[str, ...] = ("ngram",)) -> tuple[dict[str, Decode], nn.Module]:
    import transformers

    from specserve.models.loader import resolve_model_path

    transformers.logging.set_verbosity_error()  # it warns at every call that EOS -1 never stops generation
    path = resolve_model_path(model)
    target: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = target.generation_config.eos_token_id
    pad = (pad[0] if isinstance(pad, list) else pad) or 0

    def run(ids: list[list[int]], n: int, **extra: Any) -> tuple[list[list[int]], list[int]]:
        width = max(len(x) for x in ids)  # left-padded batch
        x = torch.tensor([[pad] * (width - len(p)) + p for p in ids])  # [B, T]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])  # [B, T]
        # EOS ignored as ignore_eos does in specserve: no token is -1, so nothing stops (min_new_tokens would mask EOS)
        gen = copy.deepcopy(target.generation_config)
        gen.update(do_sample=False, max_new_tokens=n, eos_token_id=[-1], pad_token_id=pad, **extra)
        with torch.inference_mode():
            out = target.generate(x, attention_mask=mask, generation_config=gen)  # [B, T + n]
        return out[:, width:].tolist(), []

    def lookup(ids: list[list[int]], n: int) -> tuple[list[list[int]], list[int]]:
        outs = [run([p], n, prompt_lookup_num_tokens=10)[0][0] for p in ids]  # one prompt at a time
        return outs, []

    if unknown := set(speculative) - {"ngram"}:
        raise ValueError(f"transformers has no {sorted(unknown)} speculation here (only ngram: its prompt lookup)")
    return {"plain": run, **({"ngram": lookup} if "ngram" in speculative else {})}, target


def serve(methods: dict[str, Decode], model: nn.Module, lines: Any, write: Callable[[str], None],
          compile_all: Compile | None = None) -> None:
    """Answer request lines until stdin closes."""
    for line in lines:
        req = json.loads(line)
        if req["method"] == "floor":
            write(json.dumps({"floor_ms": matmul_floor_ms(model)}))
            continue
        if req["method"] == "compile":
            t0 = time.perf_counter()
            if compile_all is not None:
                compile_all(int(req["batch"]))
            write(json.dumps({"seconds": time.perf_counter() - t0}))
            continue
        decode, prompts, batch = methods[req["method"]], req["prompts"], int(req["batch"])
        outs, accepts, seconds = [], [], 0.0
        for i in range(0, len(prompts), batch):
            t0 = time.perf_counter()
            o, a = decode(prompts[i:i + batch], int(req["new_tokens"]))
            seconds += time.perf_counter() - t0
            outs += o
            accepts += a
        write(json.dumps({"seconds": seconds, "outputs": outs,
                          "accept_length": sum(accepts) / len(accepts) if accepts else None}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specserve.bench.peer_worker")
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "int4"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speculative", default="ngram", help="comma-separated speculative methods (may be empty)")
    a = ap.parse_args(argv)
    speculative = tuple(m for m in a.speculative.split(",") if m)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    compile_all: Compile | None = None
    if a.system == "transformers":
        methods, model = transformers_methods(a.model, a.dtype, speculative)
    else:
        methods, model, compile_all = specserve_methods(a.model, a.dtype, eager=a.system == "specserve-eager",
                                                        speculative=speculative)

    def write(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}))
    serve(methods, model, sys.stdin, write, compile_all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
