"""Measured decode passes for the adaptive policy: seconds per request of each width at each batch bucket, and
the correction they imply for the model's rates where a width is not measured.

A pass's time is kept as its ratio to the profile's forward of its own shape (a bucket holds several batch
sizes), decayed by the engine's pass clock (the machine's speed drifts), with outliers capped and passes that
run cold (right after a pass of another width) or catch up left out. Why each of these: docs/adaptive.md."""

from __future__ import annotations

from specserve.engine.adaptive.costs import MIN_PASSES, StepCosts, bucket

PASS_DECAY = 0.9  # weight of a measured pass per later decode pass (of any width and batch size)
PASS_OUTLIER = 1.5  # a measured pass counts at most this many times the mean pass time of its width and batch size


class PassRates:
    """Decode passes per (batch bucket, width; 0 = plain), `stale_after` passes of memory."""

    def __init__(self, costs: StepCosts, stale_after: int) -> None:
        self._costs = costs
        self._stale_after = stale_after  # passes after which a measured rate is stale: not compared
        # (bucket, width) -> sums of each pass's seconds over the profile's forward of its shape and of passes,
        # decayed to the pass clock of the last update; passes measured; that clock
        self._sums: dict[tuple[int, int], tuple[float, float, int, int]] = {}
        self._clock = 0  # decode passes recorded
        self.prev_width = 0  # width of the last pass recorded (a pass after one of another width runs cold)
        self._calib: dict[int, float] = {}  # bucket -> last median ratio of measured to modelled rates

    def record(self, batch: int, width: int, seconds: float, catch_up: bool) -> float | None:
        """A decode pass of `batch` requests verifying `width` drafts took `seconds`: the measured seconds per
        request of this width and batch size after it (counting this pass even where fewer than `MIN_PASSES`
        were measured), or None where the pass is not measured (cold, catching up, or no time)."""
        self._clock += 1
        switched, self.prev_width = self.prev_width != width, width
        if seconds <= 0 or switched or (width > 0 and catch_up):
            return None
        key = (bucket(batch), width)
        ratio = seconds / self._costs.forward(batch, width + 1)  # to the profile's forward of this very shape
        s, m, n, at = self._sums.get(key, (0.0, 0.0, 0, self._clock))
        if self._stale(at):
            s, m, n = 0.0, 0.0, 0  # stale: measured afresh, MIN_PASSES passes before it is compared
        if n >= MIN_PASSES:  # a pass slowed by something else (another process, a collection) is capped
            ratio = min(ratio, PASS_OUTLIER * s / m)
        keep = PASS_DECAY ** (self._clock - at)
        s, m = keep * s + ratio, keep * m + 1.0
        self._sums[key] = (s, m, n + 1, self._clock)
        return self._per_request(s / m, batch, width)

    def _stale(self, at: int) -> bool:
        """A measured rate last updated at pass `at` is stale."""
        return self._clock - at > self._stale_after

    def seconds(self, batch: int, width: int) -> float | None:
        """Measured seconds per request of a pass of this width at this batch size: the measured passes' mean
        ratio to the profile's forward of their shape, times the profile's forward at this batch size; None
        until `MIN_PASSES` passes were measured (the first can pay one-time costs), and again once stale."""
        sums = self._sums.get((bucket(batch), width))
        if sums is None or sums[2] < MIN_PASSES or self._stale(sums[3]):
            return None
        return self._per_request(sums[0] / sums[1], batch, width)

    def _per_request(self, ratio: float, batch: int, width: int) -> float:
        """Seconds per request of a pass of this width and batch size that takes `ratio` x the profile's."""
        return ratio * self._costs.forward(batch, width + 1) / batch

    def scores(self, batch: int, model: list[float], expected: list[float]) -> list[float]:
        """Tokens/s of every width at this batch size, given the model's rates and expected tokens per request:
        measured where a width's passes are; elsewhere the model's, for speculating widths scaled by the median
        ratio of measured to modelled rate of the widths measured here (where none is now, the last ratio seen
        here; where none ever was, the nearest batch bucket's, smaller first), so that one optimistic model does
        not send the engine through every width in turn."""
        seconds = [self.seconds(batch, w) for w in range(len(model))]
        measured = [None if s is None else e / s for e, s in zip(expected, seconds, strict=True)]
        ratios = sorted(m / model[w] for w, m in enumerate(measured) if w > 0 and m is not None and model[w] > 0)
        b = bucket(batch)
        if ratios:
            self._calib[b] = ratios[len(ratios) // 2]
        calib = self._calib.get(b)
        if calib is None:
            near = sorted(self._calib, key=lambda o: (abs(o.bit_length() - b.bit_length()), o > b))
            calib = self._calib[near[0]] if near else 1.0
        return [m if m is not None else model[w] * (calib if w > 0 else 1.0) for w, m in enumerate(measured)]
