"""`specserve serve` configuration: flags, or a YAML file (`--config serve.yaml`) whose keys are the flags.

    model: demo
    speculative-algorithm: NGRAM
    max_queue: 64          # dashes or underscores
    api-key: secret

Flags given on the command line override the file; an unknown key is an error naming it. File values
go through the same argparse types and choices as flags.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from specserve.cli_args import add_model_args, add_speculative_args, speculative_from_args
from specserve.config import DTYPES, SpeculativeConfig
from specserve.engine.engine_config import EngineConfig, eager_by_default
from specserve.models.loader import resolve_model_path
from specserve.models.quantize import check_quantization
from specserve.server.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "demo"
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"  # --quantization (models/quantize.py)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_queue: int = 256
    served_model_name: str | None = None
    tool_call_parser: str | None = None
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    draft_dtype: str = "auto"  # --speculative-draft-dtype
    engine: EngineConfig = field(default_factory=EngineConfig)
    speculative_adaptive: bool = True
    speculative_adaptive_profile: str | None = None
    speculative_adaptive_trace: str | None = None  # JSON-lines log of every decode pass
    overlap_schedule: bool = True
    background_compile: bool = True  # compiled steps built while serving eager (engine/warmup.py)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 1:
            raise ValueError(f"--max-queue must be at least 1 (requests waiting before 503), got {self.max_queue}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty; leave it out to serve without a key")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not known; "
                             f"use one of {', '.join(TOOL_PARSERS)}")
        if self.draft_dtype != "auto" and self.draft_dtype.lower() not in DTYPES:
            raise ValueError(f"--speculative-draft-dtype {self.draft_dtype!r} is not known; "
                             f"use auto or one of {', '.join(DTYPES)}")
        check_quantization(self.quantization)
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r} is not known; use one of {', '.join(LOG_LEVELS)}")

    @property
    def model_name(self) -> str:
        """The name clients send as `model` (and /v1/models lists)."""
        return self.served_model_name or self.model

    def public(self) -> dict[str, Any]:
        """The configuration as /server_info shows it (the API key itself is not shown)."""
        return {
            "model": self.model, "served_model_name": self.model_name, "device": self.device, "dtype": self.dtype,
            "quantization": self.quantization,
            "host": self.host, "port": self.port, "api_key_required": self.api_key is not None,
            "max_queue": self.max_queue, "tool_call_parser": self.tool_call_parser,
            "shutdown_timeout": self.shutdown_timeout, "speculative_adaptive": self.speculative_adaptive,
            "speculative_draft_dtype": self.draft_dtype,
        }


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None, help="YAML file whose keys are these flags (flags override it)")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 and /server_info")
    g.add_argument("--max-queue", type=int, default=256, help="waiting requests before new ones get 503")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS))
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    e = p.add_argument_group("engine (continuous batching, paged KV cache)")
    e.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most")
    e.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="tokens per engine step (prefill chunks + decode/verify tokens)")
    e.add_argument("--kv-block-size", type=int, default=16, help="token slots per KV block")
    e.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks in the device pool (0: from --kv-cache-gb)")
    e.add_argument("--kv-cache-gb", type=float, default=1.0, help="device memory for the KV pool")
    e.add_argument("--disable-radix-cache", action="store_true", help="no prefix sharing between requests")
    e.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="keep prefix blocks evicted from the device pool in host memory (HiCache)")
    e.add_argument("--hicache-size", type=float, default=2.0, help="GB of host memory for the host KV tier")
    e.add_argument("--disable-overlap-schedule", action="store_true",
                   help="deliver each step's outputs before starting the next (no output/compute overlap)")
    e.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant forwards: a request's tokens do not depend on the rest of the batch")
    e.add_argument("--enforce-eager", "--disable-cuda-graph", action=argparse.BooleanOptionalAction,
                   dest="enforce_eager",
                   default=eager_by_default(),
                   help="no compiled decode steps (vLLM's --enforce-eager; SGLang's --disable-cuda-graph)")
    e.add_argument("--cuda-graph-max-bs", type=int, default=16,
                   help="the largest decode batch a compiled step is built for (larger batches run eager)")
    e.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="serve at once, eager, while the decode steps compile on a thread of their own (a missing "
                        "adaptive profile is measured once they are ready); --no-background-compile compiles them "
                        "before the server listens")
    add_speculative_args(p)
    s = p.add_argument_group("adaptive speculation")
    s.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="per step, verify as many drafts as pays at the current batch size (or none)")
    s.add_argument("--speculative-adaptive-profile", default=None,
                   help="JSON cost profile to reuse (measured and written there when missing or stale)")
    s.add_argument("--speculative-adaptive-trace", default=None, metavar="FILE",
                   help="append a JSON line per engine pass to FILE (decode: batch, draft width, tokens, seconds; "
                        "prefill: prompt tokens, seconds); with or without speculation")


class _Default:
    """A parser default, wrapped so that flags given on the command line can be told apart from it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def mark_defaults(p: argparse.ArgumentParser) -> None:
    """Wrap every default of `p` in `_Default` (undone by `serve_config_from_args`)."""
    defaults = vars(p.parse_args([]))
    p.set_defaults(**{k: _Default(v) for k, v in defaults.items() if k != "func"})


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _file_parser() -> argparse.ArgumentParser:
    p = _RaisingParser(prog="specserve serve", allow_abbrev=False, add_help=False)
    add_serve_arguments(p)
    return p


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Keys (flag names, dashes or underscores) -> values of a serve YAML file, unchecked."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(raw).__name__}")
    return {str(k): v for k, v in raw.items()}


def parse_config_file(path: str | Path) -> dict[str, Any]:
    """dest -> value for the keys of the file, converted and checked as the flags would be."""
    entries = {k: v for k, v in read_config_file(path).items() if k.replace("-", "_") not in FROZEN_KEYS}
    parser = _file_parser()
    dests = set(vars(parser.parse_args([]))) - {"config"}
    tokens: list[str] = []
    for key, value in entries.items():
        dest = key.replace("-", "_")
        if dest not in dests:
            raise ValueError(f"--config {path}: unknown key {key!r}; the keys are the flags of `specserve serve` "
                             "without their dashes, e.g. max-queue or speculative-algorithm")
        flag = "--" + dest.replace("_", "-")
        for v in value if isinstance(value, list) else [value]:
            if v is False and "--no-" + flag[2:] in parser._option_string_actions:
                tokens.append("--no-" + flag[2:])
                continue
            if v is None or v is False:
                continue
            tokens += [flag] if v is True else [flag, str(v)]
    try:
        ns = parser.parse_args(tokens)
    except ValueError as e:
        raise ValueError(f"--config {path}: {e}") from None
    return {k.replace("-", "_"): getattr(ns, k.replace("-", "_")) for k in entries}


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults < the --config file < flags given on the command line."""
    given = {k: v for k, v in vars(args).items() if not isinstance(v, _Default)}
    merged = {k: v.value if isinstance(v, _Default) else v for k, v in vars(args).items()}
    config_path = merged.get("config")
    if config_path:
        merged.update(parse_config_file(config_path))
        merged.update(given)
    ns = argparse.Namespace(**merged)
    cfg = ServeConfig(
        model=ns.model, device=ns.device, dtype=ns.dtype, quantization=ns.quantization,
        host=ns.host, port=ns.port, api_key=ns.api_key,
        max_queue=ns.max_queue, served_model_name=ns.served_model_name, tool_call_parser=ns.tool_call_parser,
        shutdown_timeout=ns.shutdown_timeout, log_level=ns.log_level, speculative=speculative_from_args(ns),
        draft_dtype=ns.speculative_draft_dtype,
        engine=EngineConfig(
            num_kv_blocks=ns.num_kv_blocks, kv_block_size=ns.kv_block_size, kv_cache_gb=ns.kv_cache_gb,
            max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
            # the server admits at most --max-queue waiting requests; preempted ones come back to the waiting
            # queue on top, so the engine's own bound leaves room for them: an admitted request is never refused
            max_waiting=max(ns.max_queue, 1) + ns.max_num_seqs,
            enable_prefix_cache=not ns.disable_radix_cache,
            hicache_gb=ns.hicache_size if ns.enable_hierarchical_cache else 0.0,
            batch_invariant=ns.enable_deterministic_inference,
            enforce_eager=ns.enforce_eager, cuda_graph_max_bs=ns.cuda_graph_max_bs,
        ),
        speculative_adaptive=ns.speculative_adaptive, speculative_adaptive_profile=ns.speculative_adaptive_profile,
        speculative_adaptive_trace=ns.speculative_adaptive_trace,
        overlap_schedule=not ns.disable_overlap_schedule, background_compile=ns.background_compile,
    )
    if config_path:
        check_frozen(config_path, cfg)
    return cfg


# --- Frozen deployments (`specserve deploy freeze`) -----------------------------------------------------------
# A frozen serve.yaml also carries `model-sha256` and `drafter-sha256`: {file path relative to the checkpoint
# directory: sha256}. They are not flags. Before anything is loaded, the files of the model (and drafter) the
# configuration resolves to must hash exactly to them, or the server refuses to start.
FROZEN_KEYS = ("model_sha256", "drafter_sha256")


def checkpoint_sha256(directory: Path) -> dict[str, str]:
    """sha256 of every file under a checkpoint directory (hidden files and folders and *.md documentation skipped)."""
    out: dict[str, str] = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if not path.is_file() or path.suffix == ".md" or any(part.startswith(".") for part in rel.parts):
            continue
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        out[rel.as_posix()] = digest.hexdigest()
    return out


def check_frozen(path: str | Path, cfg: ServeConfig) -> None:
    """Refuse (ValueError) when the checkpoints `cfg` resolves to differ from the hashes frozen in the file."""
    raw = {k.replace("-", "_"): v for k, v in read_config_file(path).items()}
    if not any(key in raw for key in FROZEN_KEYS):
        return
    draft = cfg.speculative.draft_model_path
    for key, what, name in (("model_sha256", "model", cfg.model), ("drafter_sha256", "drafter", draft)):
        expected = raw.get(key)
        if expected is None and name is None:
            continue
        if expected is None or name is None:
            state = f"without a {what} hash" if expected is None else "with a drafter, but none is configured now"
            raise ValueError(f"--config {path}: this configuration was frozen {state}; run `specserve deploy "
                             "freeze` again for the configuration you want to serve")
        if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
            raise ValueError(f"--config {path}: {key} must map file names to sha256 hex digests")
        directory = resolve_model_path(name)
        found = checkpoint_sha256(directory)
        changed = sorted(f for f in expected if f in found and found[f] != expected[f])
        missing = sorted(f for f in expected if f not in found)
        added = sorted(f for f in found if f not in expected)
        if changed or missing or added:
            parts = [f"{label}: {', '.join(files)}" for label, files in
                     (("changed", changed), ("missing", missing), ("new", added)) if files]
            raise ValueError(f"--config {path}: refusing to start: the {what} checkpoint {directory} differs from "
                             f"the frozen one ({'; '.join(parts)}). Restore the frozen files, or run "
                             "`specserve deploy freeze` again to deploy the new checkpoint.")
