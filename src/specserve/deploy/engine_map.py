"""A specserve serve configuration as SGLang or vLLM launch arguments: every flag is either mapped (with
the engine arguments it became, possibly none when the engine's default is the same thing) or listed as
unmapped with the reason. The result passes `known_flags.check_command` or is not produced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.config import MODEL_FREE
from specserve.deploy.engine_args import ArgsBuilder, Mapped, Unmapped
from specserve.deploy.known_flags import EngineFlags, check_command
from specserve.deploy.spec_map import adaptive, sglang_spec, vllm_spec
from specserve.server.serve_config import ServeConfig

API_KEY_REF = "$API_KEY"  # expanded by the launch script from the unit's EnvironmentFile
DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
# specserve parser -> the engine's parser for the same output format (Hermes-style <tool_call> JSON for Qwen)
TOOL_PARSERS = {"sglang": {"hermes": "hermes", "qwen25": "qwen25", "qwen3": "qwen25", "kimi_k2": "kimi_k2"},
                "vllm": {"hermes": "hermes", "qwen25": "hermes", "qwen3": "hermes", "kimi_k2": "kimi_k2"}}


@dataclass(frozen=True)
class EngineCommand:
    engine: str
    argv: tuple[str, ...]  # launcher words + arguments; the API key appears as API_KEY_REF
    mapped: tuple[Mapped, ...]
    unmapped: tuple[Unmapped, ...]
    env: tuple[tuple[str, str], ...]  # extra environment for the unit's EnvironmentFile


def build_command(known: EngineFlags, cfg: ServeConfig, model_path: str, drafter_path: str | None, tp: int = 1,
                  hierarchical_cache: bool = False, dflash2: bool = False) -> EngineCommand:
    engine = known.engine
    b = ArgsBuilder()
    sglang = engine == "sglang"
    if sglang:
        b.map("--model", cfg.model, "--model-path", model_path)
    else:
        b.map("--model", cfg.model, note="positional MODEL of `vllm serve`")
    b.map("--host", cfg.host, "--host", cfg.host)
    b.map("--port", cfg.port, "--port", str(cfg.port))
    b.map("--served-model-name", cfg.model_name, "--served-model-name", cfg.model_name,
          note="keeps the model name clients already send")
    if cfg.api_key:
        b.map("--api-key", "(secret)", "--api-key", API_KEY_REF, note="from API_KEY in the environment file")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype {cfg.dtype!r} has no {engine} equivalent; use one of {', '.join(DTYPES)}")
    b.map("--dtype", cfg.dtype, "--dtype", DTYPES[cfg.dtype])
    if cfg.speculative.enabled and cfg.speculative.algorithm not in MODEL_FREE:
        b.skip("--speculative-draft-dtype", cfg.draft_dtype, "the engine runs the drafter in the model's --dtype "
               "(specserve's auto picks bf16 only for DFLASH on CPUs, which the engines do not serve from)")
    _device(b, cfg.device, sglang)
    if cfg.tool_call_parser:
        parser = TOOL_PARSERS[engine].get(cfg.tool_call_parser)
        extra = () if sglang else ("--enable-auto-tool-choice",)
        if parser is None:
            b.skip("--tool-call-parser", cfg.tool_call_parser, f"{engine} has no parser for this format; tool "
                   "calls come back as text")
        else:
            b.map("--tool-call-parser", cfg.tool_call_parser, *extra, "--tool-call-parser", parser)
    if sglang:
        b.map("--log-level", cfg.log_level, "--log-level", cfg.log_level)
        b.map("--max-queue", cfg.max_queue, "--max-queued-requests", str(cfg.max_queue))
        b.skip("--shutdown-timeout", cfg.shutdown_timeout, "SGLang has no drain-timeout flag; the unit's "
               "TimeoutStopSec gives in-flight requests the same time before SIGKILL")
    else:
        b.map("--log-level", cfg.log_level, "--uvicorn-log-level", cfg.log_level,
              note="HTTP server logs; engine logs follow VLLM_LOGGING_LEVEL in the environment file")
        b.env.append(("VLLM_LOGGING_LEVEL", cfg.log_level.upper()))
        in_flight = cfg.max_queue + cfg.engine.max_num_seqs
        b.map("--max-queue", cfg.max_queue, "--max-num-queued-reqs", str(in_flight),
              note=f"vLLM counts waiting + running requests before its 503: {cfg.max_queue} + --max-num-seqs")
        b.map("--shutdown-timeout", cfg.shutdown_timeout, "--shutdown-timeout",
              str(math.ceil(cfg.shutdown_timeout)), note="whole seconds")
    if tp > 1:
        b.map("--tp (export option)", tp, "--tp-size" if sglang else "--tensor-parallel-size", str(tp))
    _batching(b, cfg, sglang)
    _kv_pool(b, cfg, sglang, tp)
    _prefix_cache(b, cfg, sglang, hierarchical_cache)
    _execution(b, cfg, sglang)
    (sglang_spec if sglang else vllm_spec)(b, cfg, drafter_path, dflash2)
    adaptive(b, cfg, sglang)
    argv = (*known.launcher, *(() if sglang else (model_path,)), *b.args)
    check_command(known, list(argv))
    return EngineCommand(engine, argv, tuple(b.mapped), tuple(b.unmapped), tuple(b.env))


def _batching(b: ArgsBuilder, cfg: ServeConfig, sglang: bool) -> None:
    e = cfg.engine
    b.map("--max-num-seqs", e.max_num_seqs, "--max-running-requests" if sglang else "--max-num-seqs",
          str(e.max_num_seqs))
    if sglang:
        b.map("--max-num-batched-tokens", e.max_num_batched_tokens, "--chunked-prefill-size",
              str(e.max_num_batched_tokens), note="caps the prefill tokens of a step; SGLang runs decode/verify "
              "tokens outside this budget")
    elif e.max_num_batched_tokens >= e.max_num_seqs:
        b.map("--max-num-batched-tokens", e.max_num_batched_tokens, "--max-num-batched-tokens",
              str(e.max_num_batched_tokens), note="prefill chunks + decode/verify tokens per step, as here")
    else:
        b.skip("--max-num-batched-tokens", e.max_num_batched_tokens, f"vLLM refuses a step budget below "
               f"--max-num-seqs ({e.max_num_seqs}); its default budget is used")


def _kv_pool(b: ArgsBuilder, cfg: ServeConfig, sglang: bool, tp: int) -> None:
    e = cfg.engine
    bs, blocks = e.kv_block_size, e.num_kv_blocks
    if sglang:
        b.map("--kv-block-size", bs, *(("--page-size", str(bs)) if bs != 1 else ()),
              note="tokens per KV page (SGLang's default: 1)")
    elif bs != 16 or blocks:  # vLLM's CacheConfig.DEFAULT_BLOCK_SIZE
        b.map("--kv-block-size", bs, "--block-size", str(bs), note="tokens per KV block")
    else:
        b.map("--kv-block-size", bs, note="vLLM's default block size")
    if blocks:
        if sglang:
            b.map("--num-kv-blocks", blocks, "--max-total-tokens", str(blocks * bs),
                  note=f"{blocks} blocks x {bs} tokens; a cap within --mem-fraction-static")
        else:
            b.map("--num-kv-blocks", blocks, "--num-gpu-blocks-override", str(blocks),
                  note="replaces vLLM's profiled block count; it must fit in GPU memory")
        b.map("--kv-cache-gb", e.kv_cache_gb, note="not used: --num-kv-blocks sizes the pool")
        return
    fraction = "--mem-fraction-static" if sglang else "--gpu-memory-utilization"
    pin = ("a token count with --max-total-tokens" if sglang else
           f"the same bytes with --kv-cache-memory-bytes {int(e.kv_cache_gb * 2**30) // tp} (per GPU)")
    b.skip("--kv-cache-gb", e.kv_cache_gb, f"specserve's pool is a fixed size on one device; the engine gives its "
           f"pool the GPU memory left after weights and activations ({fraction}, its default), which depends on "
           f"the GPU it runs on; to pin the pool anyway, add {pin} to launch.sh")


def _prefix_cache(b: ArgsBuilder, cfg: ServeConfig, sglang: bool, export_option: bool) -> None:
    e = cfg.engine
    if e.enable_prefix_cache:
        b.map("--disable-radix-cache", False, note="prefix caching on: the engine default")
    else:
        b.map("--disable-radix-cache", True, "--disable-radix-cache" if sglang else "--no-enable-prefix-caching")
    option = "--hierarchical-cache (export option)"
    if e.hicache_gb > 0:
        if sglang:
            gb = max(1, round(e.hicache_gb * 2**30 / 1e9))
            b.map("--enable-hierarchical-cache", True, "--enable-hierarchical-cache")
            b.map("--hicache-size", e.hicache_gb, "--hicache-size", str(gb), note=f"SGLang takes whole GB of 1e9 "
                  f"bytes: {e.hicache_gb:g} GiB = {e.hicache_gb * 2**30 / 1e9:.2f} GB")
        else:
            b.map("--enable-hierarchical-cache", True, note="vLLM's native CPU KV offloading")
            b.map("--hicache-size", e.hicache_gb, "--kv-offloading-size", f"{e.hicache_gb:g}", note="GiB of host "
                  "memory; evicted blocks are kept there and loaded back on a prefix hit")
        if export_option:
            b.map(option, True, note="already on from --enable-hierarchical-cache")
        return
    b.map("--enable-hierarchical-cache", False, note="no host KV tier: the engine default")
    if export_option and sglang:
        b.map(option, True, "--enable-hierarchical-cache", note="host tier sized by SGLang's --hicache-ratio default")
    elif export_option:
        b.skip(option, True, "vLLM's CPU KV offloading (--kv-offloading-size) needs a size; set "
               "enable-hierarchical-cache and hicache-size in serve.yaml instead")


def _execution(b: ArgsBuilder, cfg: ServeConfig, sglang: bool) -> None:
    if cfg.engine.enforce_eager:
        b.map("--enforce-eager", True, "--disable-cuda-graph" if sglang else "--enforce-eager")
    else:
        b.map("--enforce-eager", False, note="the engine captures CUDA graphs by default")
    b.skip("--cuda-graph-max-bs", cfg.engine.cuda_graph_max_bs, "bounds specserve's own compiled steps, sized for "
           "their compile time on its device; the engine sizes its CUDA graph batches for the GPU")
    if cfg.overlap_schedule:
        b.map("--disable-overlap-schedule", False, note="SGLang's overlap scheduler, on by default" if sglang else
              "vLLM's async scheduling, on by default where the configuration supports it")
    else:
        b.map("--disable-overlap-schedule", True, "--disable-overlap-schedule" if sglang else "--no-async-scheduling")
    if not cfg.engine.batch_invariant:
        b.map("--enable-deterministic-inference", False, note="off: the engine default")
    elif sglang:
        b.map("--enable-deterministic-inference", True, "--enable-deterministic-inference",
              note="batch-invariant ops; SGLang restricts the attention backend (and the radix cache with some)")
    else:
        b.env.append(("VLLM_BATCH_INVARIANT", "1"))
        b.map("--enable-deterministic-inference", True, note="VLLM_BATCH_INVARIANT=1 in the environment file; "
              "attention backends without batch-invariant kernels refuse to start")


def _device(b: ArgsBuilder, device: str, sglang: bool) -> None:
    if device == "auto":
        b.map("--device", device, note="engine default (the GPU platform)")
        return
    kind, _, index = device.partition(":")
    if index:
        b.env.append(("CUDA_VISIBLE_DEVICES", index))
    if sglang:
        b.map("--device", device, "--device", kind, note=f"GPU {index} via CUDA_VISIBLE_DEVICES" if index else "")
    elif kind == "cuda":
        b.map("--device", device, note=f"GPU {index} via CUDA_VISIBLE_DEVICES" if index else "vLLM default")
    else:
        b.skip("--device", device, "vLLM selects its platform from the installed build, not from a flag")
