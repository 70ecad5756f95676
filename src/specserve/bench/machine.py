"""The machine a figure was measured on: the CPU's model name and the vector features the kernels pick from."""

from __future__ import annotations

import platform
from pathlib import Path

FEATURE_PREFIXES = ("avx512", "amx", "avx_vnni", "avx2")


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """{"model": name, "features": the avx2/avx512/amx flags}, from /proc/cpuinfo (the platform's name where
    that file is missing)."""
    info: dict[str, object] = {"model": platform.processor() or platform.machine(), "features": []}
    try:
        text = cpuinfo.read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name"):
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["features"] = sorted(f for f in flags if f.startswith(FEATURE_PREFIXES))
            break
    return info
