"""Timing helpers shared by the micro-benchmarks in this folder (imported as a sibling module)."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Mean seconds of one call of `fn` over `repeats` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats
