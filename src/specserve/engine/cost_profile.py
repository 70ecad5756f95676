"""The cost profile adaptive speculation prices steps with: seconds of one target forward for batch b x q new
tokens per row, measured once on a grid (`measure_profile`), saved, and interpolated in between."""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CostProfile:
    key: str  # what it was measured for (model, device, dtype, width); a mismatch means re-measure
    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]  # q = new tokens per row
    seconds: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][len(widths)]

    def __post_init__(self) -> None:
        if len(self.seconds) != len(self.batch_sizes) or any(len(r) != len(self.widths) for r in self.seconds):
            raise ValueError("adaptive profile: seconds must be [batch_sizes][widths]")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.widths) != sorted(set(self.widths)):
            raise ValueError("adaptive profile: batch_sizes and widths must be increasing")

    def cost(self, batch: int, q: int) -> float:
        """Seconds of one forward of `batch` rows x `q` tokens: linear between grid points and beyond them."""
        row = [_interp(self.widths, list(r), q) for r in self.seconds]
        return _interp(self.batch_sizes, row, batch)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> CostProfile:
        d = json.loads(path.read_text())
        return cls(d["key"], tuple(d["batch_sizes"]), tuple(d["widths"]),
                   monotone([[float(x) for x in r] for r in d["seconds"]]))


def monotone(seconds: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    """The grid [batch][q] with each time cut to the least of the times of larger shapes (batch and q both at
    least its own). More rows cost at least as much, and noise only ever adds time, so a measurement above a
    larger shape's is noise: a slow stretch during one shape (a batch-1 profile read 18.4 ms at q = 9 between
    7.2 ms at q = 5 and 10.5 ms at q = 12) would otherwise price every width around it out."""
    grid = [list(r) for r in seconds]
    for i in range(len(grid) - 1, -1, -1):
        for j in range(len(grid[i]) - 1, -1, -1):
            if j + 1 < len(grid[i]):
                grid[i][j] = min(grid[i][j], grid[i][j + 1])
            if i + 1 < len(grid):
                grid[i][j] = min(grid[i][j], grid[i + 1][j])
    return tuple(tuple(r) for r in grid)


def _interp(xs: tuple[int, ...], ys: list[float], x: int) -> float:
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] > 1 else ys[0]
    if x >= xs[-1]:  # beyond the grid: the last segment's slope, never below the last measurement
        if len(xs) == 1:
            return ys[-1] * x / xs[-1]
        return max(ys[-1], ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1]))
    i = bisect.bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


def measure_profile(
    forward: Callable[[int, int], None], key: str, batch_sizes: list[int], widths: list[int], repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> CostProfile:
    """forward(batch, q) runs one target forward of that shape; the fastest of `repeats` after a warm-up, the
    grid then made `monotone`."""
    grid: list[list[float]] = []
    total, done = len(batch_sizes) * len(widths), 0
    for b in batch_sizes:
        row: list[float] = []
        for q in widths:
            forward(b, q)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(b, q)
                times.append(time.perf_counter() - t0)
            row.append(min(times))  # noise (other processes, page faults) only ever adds time
            done += 1
            if progress is not None:
                progress(done, total)
        grid.append(row)
    return CostProfile(key, tuple(batch_sizes), tuple(widths), monotone(grid))
