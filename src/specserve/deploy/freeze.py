"""`specserve deploy freeze`: a serve configuration and the benchmark runs behind it -> a deploy directory.

    DIR/serve.yaml          every flag explicit (defaults resolved), model and drafter paths absolute, plus
                            model-sha256 / drafter-sha256: the server refuses to start when a file changed
    DIR/specserve.env       EnvironmentFile of the unit (the API key lives here, not in serve.yaml); mode 0600
    DIR/specserve.service   the systemd unit running the exact start command
    DIR/production.md       what runs and why, the command, the measurements, known limits, operations
    DIR/deploy.json         the same facts for `deploy install` / `deploy status` and for tests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from specserve.deploy.evidence import load_evidence
from specserve.deploy.report import DeploySummary, render_production
from specserve.deploy.systemd import Unit, exec_line, render
from specserve.models.loader import BUNDLED, resolve_model_path
from specserve.server.serve_config import (
    ServeConfig,
    add_serve_arguments,
    checkpoint_sha256,
    mark_defaults,
    read_config_file,
    serve_config_from_args,
)

SERVICE = "specserve"
API_KEY_VAR = "SPECSERVE_API_KEY"
CACHE_DIR = f"/var/cache/{SERVICE}"  # systemd CacheDirectory=, owned by the service user


@dataclass(frozen=True)
class FreezeConfig:
    config: Path
    out: Path
    bench: tuple[Path, ...] = ()
    user: str = "specserve"
    python: str = sys.executable  # the interpreter (virtualenv) that has specserve installed on the server
    target_dir: Path | None = None  # where DIR will live on the server (default: --out, absolute)
    health_timeout: int = 600

    def __post_init__(self) -> None:
        if not self.config.is_file():
            raise ValueError(f"--config {self.config}: no such file")
        if not Path(self.python).is_absolute():
            raise ValueError(f"--python {self.python!r} must be an absolute path (systemd runs it without a PATH)")
        if self.target_dir is not None and not self.target_dir.is_absolute():
            raise ValueError(f"--target-dir {self.target_dir} must be an absolute path")
        if self.health_timeout < 1:
            raise ValueError(f"--health-timeout must be >= 1 second, got {self.health_timeout}")


def load_serve_config(path: Path) -> ServeConfig:
    """The ServeConfig `specserve serve --config path` would run (checked the same way)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    mark_defaults(parser)
    return serve_config_from_args(parser.parse_args(["--config", str(path)]))


def _pinned_name(name: str) -> str:
    """Bundled names stay (they resolve inside the installed package); directories become absolute."""
    return name if name in BUNDLED else str(resolve_model_path(name).resolve())


def frozen_entries(cfg: ServeConfig) -> dict[str, Any]:
    """Every serve flag explicit, by dest name, as the frozen serve.yaml holds them (without the API key)."""
    e: dict[str, Any] = {"model": _pinned_name(cfg.model)}
    if cfg.served_model_name:
        e["served_model_name"] = cfg.served_model_name
    e.update(device=cfg.device, dtype=cfg.dtype, host=cfg.host, port=cfg.port, max_queue=cfg.max_queue)
    if cfg.tool_call_parser:
        e["tool_call_parser"] = cfg.tool_call_parser
    e.update(shutdown_timeout=cfg.shutdown_timeout, log_level=cfg.log_level)
    g = cfg.engine
    e.update(max_num_seqs=g.max_num_seqs, max_num_batched_tokens=g.max_num_batched_tokens,
             kv_block_size=g.kv_block_size, num_kv_blocks=g.num_kv_blocks, kv_cache_gb=g.kv_cache_gb,
             disable_radix_cache=not g.enable_prefix_cache, enable_hierarchical_cache=g.hicache_gb > 0)
    if g.hicache_gb > 0:
        e["hicache_size"] = g.hicache_gb
    e.update(disable_overlap_schedule=not cfg.overlap_schedule, enable_deterministic_inference=g.batch_invariant)
    e.update(_speculative_entries(cfg))
    e["speculative_adaptive"] = cfg.speculative_adaptive
    if cfg.speculative_adaptive_profile:
        e["speculative_adaptive_profile"] = str(Path(cfg.speculative_adaptive_profile).resolve())
    return e


def _speculative_entries(cfg: ServeConfig) -> dict[str, Any]:
    s = cfg.speculative
    e: dict[str, Any] = {"speculative_algorithm": s.algorithm}
    if not s.enabled:
        return e
    if s.draft_model_path:
        e["speculative_draft_model_path"] = _pinned_name(s.draft_model_path)
    e.update(speculative_num_steps=s.num_steps, speculative_eagle_topk=s.eagle_topk,
             speculative_num_draft_tokens=s.num_draft_tokens)
    if s.dflash_block_size is not None:
        e["speculative_dflash_block_size"] = s.dflash_block_size
    e["speculative_draft_dtype"] = cfg.draft_dtype
    e["speculative_tree"] = s.tree
    if s.algorithm == "NGRAM":
        e.update(speculative_ngram_min_match=s.ngram_min_match, speculative_ngram_max_match=s.ngram_max_match,
                 speculative_ngram_max_breadth=s.ngram_max_breadth)
    if s.algorithm == "SUFFIX":
        e.update(speculative_suffix_max_tree_depth=s.suffix_max_tree_depth,
                 speculative_suffix_max_cached_requests=s.suffix_max_cached_requests,
                 speculative_suffix_max_spec_factor=s.suffix_max_spec_factor,
                 speculative_suffix_min_token_prob=s.suffix_min_token_prob)
    return e


def local_url(host: str, port: int, path: str) -> str:
    """The URL a process on the server itself reaches the bound address with."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}{path}"


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temporary file and rename, with `mode`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    tmp.replace(path)


def freeze(fc: FreezeConfig) -> dict[str, Any]:
    cfg = load_serve_config(fc.config)
    entries = frozen_entries(cfg)
    explicit = {k.replace("-", "_") for k in read_config_file(fc.config)}
    model_dir = resolve_model_path(cfg.model).resolve()
    draft_dir = resolve_model_path(cfg.speculative.draft_model_path).resolve() \
        if cfg.speculative.draft_model_path else None
    hashes = {"model": checkpoint_sha256(model_dir)}
    if draft_dir is not None:
        hashes["drafter"] = checkpoint_sha256(draft_dir)
    evidence = load_evidence(fc.bench, entries, cfg.speculative)

    target = fc.target_dir or fc.out.resolve()
    argv = [fc.python, "-m", "specserve.cli", "serve", "--config", str(target / "serve.yaml")]
    key_ref = "${" + API_KEY_VAR + "}"
    if cfg.api_key:
        argv += ["--api-key", key_ref]
    health_url, info_url = local_url(cfg.host, cfg.port, "/health"), local_url(cfg.host, cfg.port, "/server_info")
    unit = Unit(
        description=f"specserve: {cfg.model_name} ({cfg.speculative.algorithm}) on {cfg.host}:{cfg.port}",
        documentation=f"file://{target / 'production.md'}",
        exec_start=exec_line(argv, variables=(key_ref,)),
        exec_start_post=exec_line([fc.python, "-m", "specserve.deploy.health", "--url", health_url,
                                   "--timeout", str(fc.health_timeout)]),
        user=fc.user, environment_file=target / f"{SERVICE}.env", working_directory=target,
        timeout_start_sec=fc.health_timeout + 60, timeout_stop_sec=math.ceil(cfg.shutdown_timeout) + 15,
        syslog_identifier=SERVICE,
        extra_service=(("RestartPreventExitStatus", "2"),  # 2 = unusable configuration or refused checkpoint
                       # the service account has no home: a writable cache (adaptive cost profile) under /var/cache
                       ("CacheDirectory", SERVICE), ("Environment", f"XDG_CACHE_HOME={CACHE_DIR}")),
    )
    now = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    foreground = (f"set -a; . {target / (SERVICE + '.env')}; set +a; "
                  + " ".join(f'"${API_KEY_VAR}"' if w == key_ref else w for w in argv))
    summary = DeploySummary(
        directory=str(target), config_file=str(target / "serve.yaml"), exec_start=unit.exec_start,
        foreground=foreground, service=SERVICE, health_url=health_url, info_url=info_url, user=fc.user,
        model_dir=str(model_dir), drafter_dir=str(draft_dir) if draft_dir else None, hashes=hashes,
        cache_dir=CACHE_DIR,
    )

    fc.out.mkdir(parents=True, exist_ok=True)
    frozen_yaml = {k.replace("_", "-"): v for k, v in entries.items()}
    frozen_yaml["model-sha256"] = hashes["model"]
    if "drafter" in hashes:
        frozen_yaml["drafter-sha256"] = hashes["drafter"]
    header = (f"# Frozen by `specserve deploy freeze` on {now} from {fc.config.resolve()}.\n"
              "# `specserve serve --config` refuses to start when a model or drafter file no longer matches its "
              "sha256 below.\n")
    write_file(fc.out / "serve.yaml", header + yaml.safe_dump(frozen_yaml, sort_keys=False))
    env = ["# Environment of specserve.service (EnvironmentFile=). Keep this file readable by root only.",
           "PYTHONUNBUFFERED=1"]
    if cfg.api_key:
        env.append(f"{API_KEY_VAR}={cfg.api_key}")
    write_file(fc.out / f"{SERVICE}.env", "\n".join(env) + "\n", mode=0o600)
    write_file(fc.out / f"{SERVICE}.service", render(unit, header=f"Generated by `specserve deploy freeze` on {now}.\n"
                                                 f"Install: specserve deploy install {target}"))
    write_file(fc.out / "production.md", render_production(cfg, entries, explicit, evidence, summary,
                                                       str(fc.config.resolve()), now))
    facts = {"service": SERVICE, "unit": f"{SERVICE}.service", "command": argv, "exec_start": unit.exec_start,
             "health_url": health_url, "server_info_url": info_url, "directory": str(target), "user": fc.user,
             "frozen_at": now, "bench": [str(p) for p in fc.bench],
             "measured_levels": [r.concurrency for r in evidence.rows]}
    write_file(fc.out / "deploy.json", json.dumps(facts, indent=2) + "\n")
    return facts
