"""What a decode step costs, for the adaptive policy: the target forward from a saved cost profile (batch b x q new
tokens per row, measured once, interpolated in between) plus host time per request, estimated online.

Host time is estimated robustly because the first passes of a new shape can pay one-time costs (kernel
compilation): see docs/adaptive.md, "Host time"."""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from pathlib import Path

MIN_PASSES = 3  # samples of a shape before its estimate (host time, a measured rate) is believed
OUTLIER = 3.0  # a host-time sample counts at most this many times the estimate (`robust_update`)


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
    least its own). More rows cost at least as much and noise only ever adds time, so a time above a larger
    shape's is noise, which would otherwise price every width around it out."""
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


def bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...) for what is measured per batch size."""
    return 1 << max(0, batch - 1).bit_length()


def robust_update(prev: tuple[float, int] | None, sample: float, weight: float) -> tuple[float, int]:
    """(estimate, samples) after `sample`: the fastest of the first `MIN_PASSES` samples (the first passes of a
    shape can pay one-time costs), then a moving average with weight `weight`, each sample capped at `OUTLIER`
    times a positive estimate."""
    if prev is None:
        return sample, 1
    est, n = prev
    if n < MIN_PASSES:
        return min(est, sample), n + 1
    capped = min(sample, OUTLIER * est) if est > 0 else sample
    return (1 - weight) * est + weight * capped, n + 1


class StepCosts:
    """Seconds of a decode step: the profile's target forward plus host time per request (everything but the
    forward: drafting, tree masks, verification, KV compaction, commit), kept for plain steps, per (batch bucket,
    width) for speculating ones (drafting is batched, so its cost per request falls with the batch), and per
    batch bucket for catch-up steps (the first speculating step after plain ones)."""

    def __init__(self, profile: CostProfile, max_width: int, stepwise: bool) -> None:
        self.profile = profile
        self.max_width = max_width
        self.stepwise = stepwise  # drafting runs a step per draft token: a cut width drafts less
        self._forward: dict[tuple[int, int], float] = {}  # (batch, q) -> profile.cost: asked for at every step
        self._draft_s: dict[tuple[int, int], tuple[float, int]] = {}  # (bucket, width) -> `robust_update` state
        self.plain_s = 0.0  # host seconds per request of a plain step (EMA; 0 until one is measured)
        self._catch_up_s: dict[int, tuple[float, int]] = {}  # bucket -> `robust_update` state

    def forward(self, batch: int, q: int) -> float:
        """`profile.cost(batch, q)`, interpolated once per shape (the profile does not change)."""
        c = self._forward.get((batch, q))
        if c is None:
            c = self._forward[(batch, q)] = self.profile.cost(batch, q)
        return c

    def plain_step(self, batch: int) -> float:
        """Seconds of a plain step of `batch` requests."""
        return self.forward(batch, 1) + self.plain_s * batch

    def speculating_step(self, batch: int, width: int) -> float:
        """Seconds of a step of `batch` requests verifying `width` drafts each."""
        return self.forward(batch, width + 1) + self.draft_seconds(width, batch) * batch

    def catch_up_extra(self, batch: int, width: int) -> float:
        """Seconds a catch-up step of `width` costs over a speculating step of `width`."""
        return max(0.0, self.catch_up_seconds(batch) - self.draft_seconds(width, batch)) * batch

    def drafting_measured(self, batch: int) -> bool:
        """Whether a full-width speculating step was measured at this batch size."""
        return (bucket(batch), self.max_width) in self._draft_s

    def record_draft(self, seconds_per_request: float, width: int, batch: int) -> None:
        key = (bucket(batch), width)
        self._draft_s[key] = robust_update(self._draft_s.get(key), seconds_per_request, 0.1)

    def record_catch_up(self, seconds_per_request: float, batch: int) -> None:
        b = bucket(batch)
        self._catch_up_s[b] = robust_update(self._catch_up_s.get(b), seconds_per_request, 0.5)

    def record_plain(self, seconds_per_request: float) -> None:
        self.plain_s = 0.9 * self.plain_s + 0.1 * seconds_per_request if self.plain_s else seconds_per_request

    def draft_seconds(self, width: int, batch: int = 1) -> float:
        """Host seconds per request of a speculating step of `width` at this batch size; where `width` was not
        measured there, the full width's (scaled by (width + 1) / (max_width + 1) for stepwise drafters); 0 where
        nothing was."""
        b = bucket(batch)
        if (b, width) in self._draft_s:
            return self._bounded(b, width)
        if (b, self.max_width) not in self._draft_s:
            return 0.0
        full = self._bounded(b, self.max_width)
        return full * (width + 1) / (self.max_width + 1) if self.stepwise else full

    def _bounded(self, b: int, width: int) -> float:
        """The estimate for (bucket, width); while fewer than `MIN_PASSES` passes measured it, at most that of
        the largest smaller bucket measured `MIN_PASSES` times (drafting is batched: its cost per request does
        not grow with the batch, so a first pass that paid one-time costs is not taken for this size's cost)."""
        s, n = self._draft_s[(b, width)]
        if n >= MIN_PASSES:
            return s
        smaller = [(other, est) for (other, w), (est, m) in self._draft_s.items()
                   if w == width and other < b and m >= MIN_PASSES]
        return min(s, max(smaller)[1]) if smaller else s

    def catch_up_seconds(self, batch: int) -> float:
        """Host seconds per request of a catch-up step at this batch size (0 until one was measured)."""
        return self._catch_up_s.get(bucket(batch), (0.0, 0))[0]
