"""`specserve deploy freeze | install | status | export`.

The main CLI wires these in with `add_deploy_parsers(deploy_subparsers)`; every parser sets `func`, a
handler taking the parsed namespace and returning the exit code (0 ok, 1 failed/unhealthy, 2 bad input).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_deploy_parsers(subparsers: Any) -> None:
    """Adds freeze, install, status and export to the `specserve deploy` subparsers."""
    f = subparsers.add_parser("freeze", help="freeze a measured serve.yaml into production.md + a systemd service")
    f.add_argument("--config", required=True, type=Path, help="serve.yaml (keys = `specserve serve` flags)")
    f.add_argument("--bench", type=Path, action="append", default=[],
                   help="bench JSON behind the configuration: serving, acceptance or tune.json (repeatable)")
    f.add_argument("--out", required=True, type=Path, help="deploy directory to write")
    f.add_argument("--user", default="specserve", help="dedicated account the service runs as")
    f.add_argument("--python", default=sys.executable, help="interpreter with specserve installed, on the server")
    f.add_argument("--target-dir", type=Path, default=None, help="where --out will live on the server")
    f.add_argument("--health-timeout", type=int, default=600, help="seconds the unit waits for /health at start")
    t = f.add_argument_group("from a tune (the winner's speculative flags replace those of --config)")
    t.add_argument("--from-tune", type=Path, default=None, help="a `bench tune` tune.json")
    t.add_argument("--concurrency", type=int, default=None, help="the level whose winner is frozen")
    t.add_argument("--engine", choices=("specserve", "sglang", "vllm"), default=None,
                   help="default: the engine the tune ran on")
    t.add_argument("--engine-version", default=None, help="the release deployed (default: the tune's)")
    t.add_argument("--force", action="store_true", help="write a command that release's parser rejects (warned)")
    t.add_argument("--hierarchical-cache", action="store_true", help="SGLang HiCache (GPU -> host KV tier)")
    f.set_defaults(func=cmd_freeze)

    i = subparsers.add_parser("install", help="install a frozen deploy directory as a systemd service")
    i.add_argument("dir", type=Path)
    i.add_argument("--dry-run", action="store_true", help="print every action, change nothing")
    i.add_argument("--systemd-dir", type=Path, default=Path("/etc/systemd/system"))
    i.set_defaults(func=cmd_install)

    s = subparsers.add_parser("status", help="service state, live /health and accept length")
    s.add_argument("dir", type=Path, nargs="?", default=None, help="deploy directory (for its URL and service)")
    s.add_argument("--url", default=None, help="server base URL (default: from DIR, else http://127.0.0.1:30000)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    e = subparsers.add_parser("export", help="the configuration as an SGLang or vLLM launch command + unit")
    e.add_argument("--engine", required=True, choices=("sglang", "vllm"))
    e.add_argument("--config", required=True, type=Path)
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel size on the engine")
    e.add_argument("--hierarchical-cache", action="store_true", help="SGLang HiCache (GPU -> host KV tier)")
    e.add_argument("--engine-bin", type=Path, default=None, help="bin/ of the engine's environment on the server")
    e.add_argument("--user", default="specserve")
    e.add_argument("--target-dir", type=Path, default=None, help="where --out will live on the server")
    e.add_argument("--drafter-dtype", default="bfloat16")
    e.set_defaults(func=cmd_export)


def _error(command: str, e: Exception) -> int:
    print(f"specserve deploy {command}: error: {e}", file=sys.stderr)
    return 2


def cmd_freeze(a: argparse.Namespace) -> int:
    from specserve.deploy.freeze import FreezeConfig, freeze

    if a.from_tune is not None or a.concurrency is not None or a.engine not in (None, "specserve"):
        return _freeze_tuned(a)
    try:
        facts = freeze(FreezeConfig(config=a.config, out=a.out, bench=tuple(a.bench), user=a.user, python=a.python,
                                    target_dir=a.target_dir, health_timeout=a.health_timeout))
    except (ValueError, OSError) as e:
        return _error("freeze", e)
    print(f"wrote {a.out}/production.md, {facts['unit']}, specserve.env, serve.yaml, deploy.json")
    print(f"start command: {facts['exec_start']}")
    return 0


def _freeze_tuned(a: argparse.Namespace) -> int:
    from specserve.deploy.freeze_tuned import freeze_tuned

    try:
        if a.from_tune is None or a.concurrency is None:
            raise ValueError("--engine sglang|vllm and --concurrency freeze a tune's winner: give --from-tune "
                             "tune.json and --concurrency N")
        if a.bench:
            raise ValueError("--bench is not used with --from-tune (the tune's runs are the evidence)")
        facts = freeze_tuned(a.config, a.from_tune, a.concurrency, a.out, a.engine, a.engine_version, a.force,
                             a.hierarchical_cache)
    except (ValueError, OSError) as e:
        return _error("freeze", e)
    if "argv" in facts:
        print(f"wrote {a.out}: tuned.yaml, production.md, launch.sh, {facts['unit']}, EXPORT.md, export.json")
    else:
        print(f"wrote {a.out}: tuned.yaml, production.md, {facts['unit']}, specserve.env, serve.yaml, deploy.json")
        print(f"start command: {facts['exec_start']}")
    return 0


def cmd_install(a: argparse.Namespace) -> int:
    from specserve.deploy.install import install

    try:
        install(a.dir, dry_run=a.dry_run, systemd_dir=a.systemd_dir)
    except (ValueError, OSError) as e:
        return _error("install", e)
    except RuntimeError as e:
        print(f"specserve deploy install: failed: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    from specserve.deploy.install import format_status, status

    try:
        st = status(a.dir, a.url)
    except (ValueError, OSError) as e:
        return _error("status", e)
    print(json.dumps(st, indent=2) if a.json else "\n".join(format_status(st)))
    return 0 if st["live"].get("health") == "ok" else 1


def cmd_export(a: argparse.Namespace) -> int:
    from specserve.deploy.export import EngineExportConfig, export_engine

    try:
        facts = export_engine(EngineExportConfig(
            engine=a.engine, config=a.config, out=a.out, tp=a.tp, hierarchical_cache=a.hierarchical_cache,
            engine_bin=a.engine_bin, user=a.user, target_dir=a.target_dir, drafter_dtype=a.drafter_dtype))
    except (ValueError, OSError) as e:
        return _error("export", e)
    print(f"wrote {a.out}: launch.sh, {facts['unit']}, EXPORT.md, export.json")
    for u in facts["unmapped"]:
        print(f"  no {a.engine} equivalent: {u['flag']} {u['value']}: {u['reason']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m specserve.deploy.cli freeze|install|status|export ...` (the same as `specserve deploy ...`)."""
    parser = argparse.ArgumentParser(prog="specserve deploy")
    add_deploy_parsers(parser.add_subparsers(dest="deploy_command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
