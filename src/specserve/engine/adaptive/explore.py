"""Exploration for the adaptive policy: the steps that measure a width other than the one it would pick, so that
the measured rates and the deeper nodes' acceptance stay fresh.

While plain decoding wins at a batch size, a try speculates for `TRY_PASSES` steps after a wait that doubles
with each try that confirms plain decoding and is long enough to keep the tries' cost within a budget; while
speculating, one step in `explore_every` refreshes another width for `REFRESH_PASSES` steps. Rules and the
measurements behind them: docs/adaptive.md, "Exploration"."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.adaptive.costs import MIN_PASSES, StepCosts, bucket

TRY_PASSES = 1 + MIN_PASSES  # steps of a try: the drafters' catch-up, then enough measured ones to compare
REFRESH_PASSES = 2  # steps of a refresh while speculating: the first runs cold, the second is measured


@dataclass(frozen=True)
class ExploreConfig:
    explore_every: int = 16  # plain steps before a try / speculating steps between refreshes
    explore_max: int = 512  # the longest wait between tries at a batch size
    explore_cost: float = 0.03  # tries cost at most this share of the time spent decoding plainly
    try_within: float = 0.8  # expensive tries only where the model prices speculation at >= this x plain

    def __post_init__(self) -> None:
        if not 1 <= self.explore_every <= self.explore_max:
            raise ValueError(f"adaptive speculation: need 1 <= explore_every <= explore_max, got "
                             f"{self.explore_every}, {self.explore_max}")
        if self.explore_cost <= 0:
            raise ValueError(f"adaptive speculation: explore_cost must be > 0, got {self.explore_cost}")
        if not 0.0 <= self.try_within <= 1.0:
            raise ValueError(f"adaptive speculation: try_within must be in [0, 1], got {self.try_within}")


class Explorer:
    """The state of tries (per batch bucket: plain steps since the last one, the wait before the next) and of
    the try or refresh under way."""

    def __init__(self, config: ExploreConfig, max_width: int, costs: StepCosts) -> None:
        self.config = config
        self.max_width = max_width
        self._costs = costs
        self._plain_streak: dict[int, int] = {}  # bucket -> plain steps since speculation was last tried
        self._gap: dict[int, int] = {}  # bucket -> plain steps before the next try (backs off)
        self._tries_left = 0  # further steps of the current try
        self._try_width = max_width  # the width the current try verifies
        self._model_streak = 0  # speculating steps since the last refresh
        self._refresh_turn = 0  # which other width the next refresh measures
        self._refresh_left = 0  # further steps of the current refresh
        self._refresh_width = 0  # the width the current refresh measures

    def ongoing(self) -> int | None:
        """The width of the next step of a refresh or try under way; None where none is."""
        if self._refresh_left > 0:
            self._refresh_left -= 1
            return self._refresh_width
        if self._tries_left > 0:
            self._tries_left -= 1
            return self._try_width
        return None

    def speculated(self, batch: int) -> None:
        """A step at this batch size speculates: the wait for the next try starts again."""
        self._plain_streak[bucket(batch)] = 0

    def back_off(self, batch: int, lost: bool) -> None:
        """A measured speculating pass at this batch size `lost` to measured plain decoding (the wait before the
        next try doubles, up to `explore_max`) or did not (the wait is `explore_every` again)."""
        b, cfg = bucket(batch), self.config
        gap = self._gap.get(b, cfg.explore_every)
        self._gap[b] = min(2 * gap, cfg.explore_max) if lost else cfg.explore_every

    def after_plain(self, batch: int, modelled: int, scores: list[float]) -> int:
        """Plain decoding was picked from `scores` (every width's): the width of a try starting now (the one the
        model prefers, or the full width where it prefers plain decoding), or 0."""
        w = modelled or self.max_width
        if not self._try_now(batch, w, scores):
            return 0
        self._try_width = w
        self._tries_left = TRY_PASSES - 1
        return w

    def _try_now(self, batch: int, w: int, scores: list[float]) -> bool:
        cfg, costs = self.config, self._costs
        b = bucket(batch)
        streak = self._plain_streak[b] = self._plain_streak.get(b, 0) + 1
        spec_s = costs.speculating_step(batch, w)  # one step of the try
        plain_rate = batch / costs.plain_step(batch)
        plain_s = batch / plain_rate  # one plain step
        extra = TRY_PASSES * (spec_s - plain_s) + costs.catch_up_extra(batch, w)  # the first step catches up
        affordable = extra / (plain_s * cfg.explore_cost)  # plain steps per try within the budget
        if streak < max(self._gap.get(b, cfg.explore_every), affordable):
            return False
        if streak >= cfg.explore_max:
            return True  # even a hopeless bucket is re-measured now and then (within the budget): costs change
        if extra > cfg.explore_every * plain_s and max(scores[1:]) < cfg.try_within * scores[0]:
            return False  # an expensive try where the (corrected) model prices every width far under plain
        return batch * (w + 1) / spec_s > plain_rate  # could win, with every draft accepted

    def while_speculating(self, best: int, modelled: int) -> int:
        """Speculating at `best`: one step in `explore_every` goes in turn to plain decoding, the model's width
        and the full width instead (for `REFRESH_PASSES` steps, the last measured)."""
        self._model_streak += 1
        if self._model_streak < self.config.explore_every:
            return best
        self._model_streak = 0
        others = [w for w in dict.fromkeys((0, modelled, self.max_width)) if w != best]
        self._refresh_turn = (self._refresh_turn + 1) % len(others)
        self._refresh_width = others[self._refresh_turn]
        self._refresh_left = REFRESH_PASSES - 1
        return self._refresh_width
