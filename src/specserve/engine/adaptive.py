"""Adaptive speculation: per step, verify the number of draft tokens that maximises expected tokens/s.

Inputs:
- a cost profile, measured once (`measure_profile`) and saved: seconds of one target forward for
  batch b x q new tokens per row (q = 1 is plain decoding, q = w + 1 verifies w drafts);
- host cost per request (drafting, masks, verification, commit: the step minus its target forward), measured
  online for plain steps and for speculating steps of each batch size (power-of-two bucket: drafting is batched
  across requests, so its cost per request falls with the batch) and width (chains drafted step by step cost
  less at a smaller width; a width not measured yet is charged what the full width costs; a batch size not
  measured yet speculates once to find out);
- acceptance, measured online: P(at least i drafts accepted) from the rounds that verified the full width.
For b running requests the policy scores every candidate width w (0 = plain decoding):
    rate(w) = b * E[tokens | w] / (T(b, w + 1) + b * host_s(w))      E[tokens | 0] = 1
and takes the best. Chains can be cut to any width (E = 1 + sum_{i<=w} P(accepted >= i)); trees are
verified whole or not at all.

Exploration keeps the estimates fresh without paying much for it: while plain decoding wins at a batch size, a
full-width step is tried after `explore_every` plain steps, but only where speculation could win at all
(with every draft accepted), and each try that confirms plain decoding doubles the wait at that batch size
(up to `explore_max` steps; a try where speculation wins resets it). At high concurrency a speculative step
can cost several plain ones, so the wait is also at least long enough that the tries' extra cost stays
under `explore_cost` of the time spent decoding plainly. A try's cost counts both of its steps and the
drafters' catch-up (see below), measured at that batch size: at high concurrency the catch-up runs the drafter
over every prompt and token committed since the last speculation, which can cost many plain steps.

Measured rates are decayed sums of tokens over decayed sums of seconds (not averages of per-pass rates), so one
lucky pass does not flip the decision. The first speculating step after plain ones is not measured: drafters
catch up then on everything the plain steps committed (one forward over the whole stretch), a cost paid once
per switch, not per step; a try therefore speculates for two steps and measures the second. The catch-up
step's host time is kept apart (per batch size) and charged to exploration.
"""

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
                   tuple(tuple(float(x) for x in r) for r in d["seconds"]))


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
    """forward(batch, q) runs one target forward of that shape; the fastest of `repeats` after a warm-up."""
    grid: list[tuple[float, ...]] = []
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
        grid.append(tuple(row))
    return CostProfile(key, tuple(batch_sizes), tuple(widths), tuple(grid))


class AdaptivePolicy:
    def __init__(self, profile: CostProfile, max_width: int, tree: bool, explore_every: int = 16,
                 decay: float = 0.98, explore_max: int = 512, explore_cost: float = 0.03) -> None:
        if max_width < 1:
            raise ValueError(f"adaptive speculation needs a draft width >= 1, got {max_width}")
        if not 1 <= explore_every <= explore_max:
            raise ValueError(f"adaptive speculation: need 1 <= explore_every <= explore_max, got {explore_every}, "
                             f"{explore_max}")
        self.profile = profile
        self.max_width = max_width
        self.tree = tree  # verify whole trees or nothing; chains may be cut to any width
        if explore_cost <= 0:
            raise ValueError(f"adaptive speculation: explore_cost must be > 0, got {explore_cost}")
        self.explore_every = explore_every
        self.explore_max = explore_max
        self.explore_cost = explore_cost
        self.decay = decay
        self._at_least = [0.0] * max_width  # [i]: decayed count of full-width rounds accepting >= i+1 drafts
        self._rounds = 0.0  # decayed count of full-width rounds
        # width -> host seconds per request of a speculating step of that width (EMA): drafting, tree masks,
        # verification, KV compaction, commit — everything but the target forward
        self._draft_s: dict[tuple[int, int], float] = {}  # (batch bucket, width) -> seconds per request
        self._plain_s = 0.0  # host seconds per request of a plain step (EMA; 0 until one is measured)
        self._catch_up_s: dict[int, float] = {}  # batch bucket -> host seconds per request of a catch-up step
        self._plain_streak: dict[int, int] = {}  # batch bucket -> plain steps since speculation was last tried
        self._explore_gap: dict[int, int] = {}  # batch bucket -> plain steps before the next try (backs off)
        self._model_streak = 0  # steps since plain decoding was last tried where measurements favour speculation
        self._last_width = 0  # the previous choice
        self._catch_up = False  # the current step is the first speculating one after plain ones: not measured
        self._tries_left = 0  # further steps of the current try
        # decode passes per batch bucket (power of two) and speculating or not: decayed (tokens, seconds) sums
        self._realized: dict[tuple[int, bool], tuple[float, float]] = {}
        self.choices: dict[int, int] = {}  # width -> steps that chose it

    def record_accept(self, accepted: int, width: int) -> None:
        """A request's round was offered `width` drafts and accepted `accepted` of them."""
        if width < self.max_width:
            return  # a cut round says nothing about the deeper positions
        self._rounds = self._rounds * self.decay + 1.0
        for i in range(self.max_width):
            self._at_least[i] = self._at_least[i] * self.decay + (1.0 if i < accepted else 0.0)

    def record_draft(self, seconds_per_request: float, width: int | None = None, batch: int = 1) -> None:
        """Host time per request of a step of `batch` requests that verified `width` drafts (default: the full
        width), all of the step but the target forward."""
        if self._catch_up:  # the first speculating step after plain ones: drafters catch up on the backlog
            b = _bucket(batch)
            c = self._catch_up_s.get(b)
            self._catch_up_s[b] = seconds_per_request if c is None else 0.5 * c + 0.5 * seconds_per_request
            return
        key = (_bucket(batch), self.max_width if width is None else width)
        s = self._draft_s.get(key)
        self._draft_s[key] = seconds_per_request if s is None else 0.9 * s + 0.1 * seconds_per_request

    def draft_seconds(self, width: int, batch: int = 1) -> float:
        """Host seconds per request of a speculating step of `width` at this batch size (the full width's where
        `width` was not measured there; 0 where nothing was)."""
        b = _bucket(batch)
        return self._draft_s.get((b, width), self._draft_s.get((b, self.max_width), 0.0))

    def record_plain(self, seconds_per_request: float) -> None:
        """Host time per request of a plain step (sampling, commit, the drafters' bookkeeping)."""
        self._plain_s = 0.9 * self._plain_s + 0.1 * seconds_per_request if self._plain_s else seconds_per_request

    def record_pass(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode pass of `batch` requests (drafting, forward, verification) produced `tokens` in `seconds`."""
        if seconds <= 0 or (speculated and self._catch_up):
            return
        bucket = _bucket(batch)
        t, s = self._realized.get((bucket, speculated), (0.0, 0.0))
        self._realized[(bucket, speculated)] = (0.9 * t + tokens, 0.9 * s + seconds)
        plain, spec = self.realized(batch, False), self.realized(batch, True)
        if speculated and plain is not None and spec is not None:  # back off tries where speculation keeps losing
            gap = self._explore_gap.get(bucket, self.explore_every)
            self._explore_gap[bucket] = min(2 * gap, self.explore_max) if spec < plain else self.explore_every

    def realized(self, batch: int, speculated: bool) -> float | None:
        """Output tokens/s measured for decode passes at this batch size (its power-of-two bucket)."""
        sums = self._realized.get((_bucket(batch), speculated))
        return sums[0] / sums[1] if sums is not None else None

    def expected_tokens(self, width: int) -> float:
        if width == 0 or self._rounds == 0:
            return 1.0
        return 1.0 + sum(a / self._rounds for a in self._at_least[:width])

    def rate(self, batch: int, width: int) -> float:
        """Expected output tokens per second of a step of `batch` requests verifying `width` drafts each."""
        if width == 0:
            return batch / (self.profile.cost(batch, 1) + self._plain_s * batch)
        draft = self.draft_seconds(width, batch) * batch
        return batch * self.expected_tokens(width) / (self.profile.cost(batch, width + 1) + draft)

    def choose(self, batch: int) -> int:
        max_width = self.max_width
        if batch == 0:
            return 0
        if self._tries_left > 0:
            self._tries_left -= 1
            best = max_width
        elif self._rounds == 0 or (_bucket(batch), max_width) not in self._draft_s:
            best = max_width  # nothing measured yet (at this batch size): speculate to learn
        else:
            widths = [0, max_width] if self.tree else list(range(max_width + 1))
            best = max(widths, key=lambda w: self.rate(batch, w))
            best = self._check_realized(batch, best)
            if best == 0 and self._explore(batch):
                best, self._tries_left = max_width, 1
        if best > 0:
            self._plain_streak[_bucket(batch)] = 0
        self._catch_up = best > 0 and self._last_width == 0
        self._last_width = best
        self.choices[best] = self.choices.get(best, 0) + 1
        return best

    def _explore(self, batch: int) -> bool:
        """Plain decoding was picked: try the full width now? (See the module docstring.)"""
        bucket = _bucket(batch)
        streak = self._plain_streak[bucket] = self._plain_streak.get(bucket, 0) + 1
        if streak >= self.explore_max:
            return True  # even a hopeless bucket is re-measured now and then: costs and traffic change
        w = self.max_width
        spec_s = self.profile.cost(batch, w + 1) + self.draft_seconds(w, batch) * batch  # one full-width step
        plain_s = batch / self.rate(batch, 0)  # one plain step
        catch_up = max(0.0, self._catch_up_s.get(bucket, 0.0) - self.draft_seconds(w, batch)) * batch
        extra = 2 * (spec_s - plain_s) + catch_up  # a try: two full-width steps, the first one catching up
        affordable = extra / (plain_s * self.explore_cost)  # plain steps per try within the budget
        if streak < max(self._explore_gap.get(bucket, self.explore_every), affordable):
            return False
        return batch * (w + 1) / spec_s > self.rate(batch, 0)  # could win, with every draft accepted

    def _check_realized(self, batch: int, best: int) -> int:
        """The model's pick, unless the rates measured at this batch size say the other side is faster.

        The model misses costs it does not see (padding, cache misses, contention); measured rates do not. When
        speculation is picked, plain decoding is still tried one step in `explore_every` to keep its rate fresh.
        """
        if best == 0:
            return 0
        plain, spec = self.realized(batch, False), self.realized(batch, True)
        if spec is None:
            return best  # speculation not measured at this batch size yet: trust the model
        if plain is None:
            return 0  # measure plain decoding here once
        self._model_streak += 1
        if self._model_streak >= self.explore_every:  # keep plain's rate fresh
            self._model_streak = 0
            return 0
        return 0 if plain > spec else best


def _bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...) for the measured rates."""
    return 1 << max(0, batch - 1).bit_length()
