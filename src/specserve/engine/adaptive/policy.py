"""Adaptive speculation: per step, verify the number of draft tokens that maximises expected tokens/s.

For b running requests the policy scores every width w (0 = plain decoding) as
    rate(w) = b * E[tokens | w] / (T(b, w + 1) + b * host_s(w))
from the cost profile T, the host time per request and the acceptance model, replaces modelled rates by
measured ones where passes measured them, and keeps the width it settled on unless another gains clearly.
The model, the rules and the measurements behind them: docs/adaptive.md."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.adaptive.acceptance import AcceptanceModel
from specserve.engine.adaptive.costs import CostProfile, StepCosts
from specserve.engine.adaptive.explore import ExploreConfig, Explorer
from specserve.engine.adaptive.pass_rates import PassRates

# a width other than the settled one must promise this much more / batch to be switched to: the cold pass
# weighs most in small passes, and at small batch sizes the batch's acceptance classes change from step to step
SWITCH_MARGIN = 0.1


class AdaptivePolicy:
    """The engine's width per step (`choose`), from what the engine records after each step (`record_*`)."""

    def __init__(self, profile: CostProfile, max_width: int, stepwise: bool, explore_every: int = 16,
                 decay: float = 0.98, explore_max: int = 512, explore_cost: float = 0.03,
                 prior_rounds: float = 1.0, try_within: float = 0.8) -> None:
        if max_width < 1:
            raise ValueError(f"adaptive speculation needs a draft width >= 1, got {max_width}")
        explore = ExploreConfig(explore_every, explore_max, explore_cost, try_within)
        self.profile = profile
        self.max_width = max_width
        self.stepwise = stepwise  # drafting runs a step per draft token: a cut width drafts less
        self.acceptance = AcceptanceModel(max_width, decay, prior_rounds)
        self.costs = StepCosts(profile, max_width, stepwise)
        self.passes = PassRates(self.costs, stale_after=4 * explore_every)
        self.explorer = Explorer(explore, max_width, self.costs)
        self._last_width = 0  # the previous choice
        self._catch_up = False  # the current step is the first speculating one after plain ones: not measured
        self._settled = 0  # the width the last step outside tries and refreshes chose
        self.choices: dict[int, int] = {}  # width -> steps that chose it

    # -- what the engine records

    def record_accept(self, path: Sequence[int], width: int, cls: int = 0) -> None:
        """A request of class `cls` (`streak_class`) verified its first `width` draft nodes in a round and
        accepted the nodes `path` (their tree indices, root excluded: a chain's are 1..k)."""
        self.acceptance.record(path, width, cls)

    def record_draft(self, seconds_per_request: float, width: int | None = None, batch: int = 1,
                     catch_up: bool = False) -> None:
        """Host time per request of a step of `batch` requests that verified `width` drafts (default: the full
        width), all of the step but the target forward. `catch_up`: some request's drafter absorbed more than a
        round's tokens this step (a request that joined a speculating batch): not measured."""
        if catch_up and not self._catch_up:
            return
        if self._catch_up:  # the first speculating step after plain ones: drafters catch up on the backlog
            self.costs.record_catch_up(seconds_per_request, batch)
            return
        self.costs.record_draft(seconds_per_request, self.max_width if width is None else width, batch)

    def record_plain(self, seconds_per_request: float) -> None:
        """Host time per request of a plain step (sampling, commit, the drafters' bookkeeping); called before
        that pass's `record_pass`. A plain step right after a speculating one runs cold: not measured."""
        if self.passes.prev_width > 0:
            return
        self.costs.record_plain(seconds_per_request)

    def record_pass(self, batch: int, width: int, seconds: float, catch_up: bool = False) -> None:
        """A decode pass of `batch` requests verifying `width` drafts each (0 = plain decoding; drafting,
        forward, verification) took `seconds`; `catch_up` as for `record_draft`."""
        per_request = self.passes.record(batch, width, seconds, catch_up)
        if per_request is None or width == 0:
            return
        plain = self.realized(batch, 0)
        if plain is not None:  # back off tries where speculation keeps losing (even by one try's pass)
            self.explorer.back_off(batch, lost=self.expected_tokens(width) / per_request < plain)

    # -- what the policy knows

    def draft_seconds(self, width: int, batch: int = 1) -> float:
        """Host seconds per request of a speculating step of `width` at this batch size (`StepCosts`)."""
        return self.costs.draft_seconds(width, batch)

    def rounds(self, cls: int) -> float:
        """Decayed count of rounds recorded for requests of class `cls` (the prior's pseudo-rounds included)."""
        return self.acceptance.rounds(cls)

    def expected_tokens(self, width: int, cls: int | None = None) -> float:
        """1 + the expected number of accepted drafts when rounds verify their first `width` nodes: for a
        request of class `cls`, or (None) averaged over the current batch's requests."""
        return self.acceptance.expected(cls)[width]

    def realized(self, batch: int, width: int) -> float | None:
        """Measured output tokens/s of this width at this batch size: the acceptance model's tokens per request
        and pass over the measured seconds per request and pass (`PassRates.seconds`); None where not measured."""
        seconds = self.passes.seconds(batch, width)
        return None if seconds is None else self.expected_tokens(width) / seconds

    def rate(self, batch: int, width: int) -> float:
        """Expected output tokens per second of a step of `batch` requests verifying `width` drafts each."""
        return self._plain_rate(batch) if width == 0 else self.rates(batch)[width]

    def _plain_rate(self, batch: int) -> float:
        """`rate(batch, 0)` without the other widths' (asked for at every plain step)."""
        return batch / self.costs.plain_step(batch)

    def rates(self, batch: int) -> list[float]:
        """`rate` of every width 0..max_width at this batch size (the model's; one pass over the nodes)."""
        expected = self.acceptance.expected()
        out = [self._plain_rate(batch)]
        for w in range(1, self.max_width + 1):
            out.append(batch * expected[w] / self.costs.speculating_step(batch, w))
        return out

    def scores(self, batch: int, model: list[float] | None = None) -> list[float]:
        """Tokens/s of every width at this batch size: measured where passes were, the model's corrected by the
        measured ones elsewhere (`PassRates.scores`). `model`: `rates(batch)` where the caller has it already."""
        model = self.rates(batch) if model is None else model
        return self.passes.scores(batch, model, self.acceptance.expected())

    # -- the choice

    def choose(self, batch: int, classes: Sequence[int] = ()) -> int:
        """Draft tokens to verify per request in the next step of `batch` requests; `classes`: their
        `streak_class`es (empty: all new)."""
        max_width = self.max_width
        if batch == 0:
            return 0
        self.acceptance.set_batch(classes)
        ongoing = self.explorer.ongoing()
        if ongoing is not None:
            best = ongoing
        elif not self.costs.drafting_measured(batch):
            best = max_width  # drafting not measured at this batch size yet: speculate to learn
        else:
            model = self.rates(batch)
            scores = self.scores(batch, model)
            modelled = max(range(max_width + 1), key=model.__getitem__)
            best = max(range(max_width + 1), key=scores.__getitem__)
            if best != self._settled and scores[best] < (1 + SWITCH_MARGIN / batch) * scores[self._settled]:
                best = self._settled  # a switch runs the next pass cold: worth it only for a clear gain
            if best > 0 and self.realized(batch, best) is not None and self.realized(batch, 0) is None:
                best = 0  # measured speculation is compared with measured plain decoding: measure it
            elif best > 0 and self._last_width == 0 and not self._repays_catch_up(batch, best, scores):
                best = 0
            self._settled = best
            if best == 0:
                best = self.explorer.after_plain(batch, modelled, scores)
            else:
                best = self.explorer.while_speculating(best, modelled)
        if best > 0:
            self.explorer.speculated(batch)
        self._catch_up = best > 0 and self._last_width == 0
        self._last_width = best
        self.choices[best] = self.choices.get(best, 0) + 1
        return best

    def _repays_catch_up(self, batch: int, width: int, scores: list[float]) -> bool:
        """Switching from plain decoding to `width` first pays the drafters' catch-up (measured at this batch
        size): worth it only if `explore_every` steps at `width` save more time than that."""
        catch_up = self.costs.catch_up_extra(batch, width)
        tokens = self.explorer.config.explore_every * batch * self.expected_tokens(width)
        return tokens / scores[0] - tokens / scores[width] > catch_up
