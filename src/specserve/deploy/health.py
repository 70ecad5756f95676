"""Wait until a server's health URL answers 200, or give up: the units' `ExecStartPost=` check.

    python -m specserve.deploy.health --url http://127.0.0.1:30000/health --timeout 600

Exit 0 once the URL answers 200; exit 1 when --timeout seconds pass first. Standard library only, so
`deploy export` copies this file next to an engine unit and runs it with the engine's own Python.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(url: str, timeout_s: float, interval_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if healthy(url, timeout=min(5.0, max(0.5, deadline - time.monotonic()))):
            return True
        if time.monotonic() + interval_s > deadline:
            return False
        time.sleep(interval_s)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wait-healthy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="health URL, e.g. http://127.0.0.1:30000/health")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait before failing")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    args = p.parse_args(argv)
    if args.timeout <= 0 or args.interval <= 0:
        p.error("--timeout and --interval must be > 0 seconds")
    if wait_healthy(args.url, args.timeout, args.interval):
        print(f"healthy: {args.url}")
        return 0
    print(f"not healthy after {args.timeout:g} s: {args.url}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
