"""Adaptive speculation: per step, verify the number of draft tokens that maximises expected tokens/s.

Inputs:
- a cost profile (`cost_profile.py`), measured once and saved: seconds of one target forward for
  batch b x q new tokens per row (q = 1 is plain decoding, q = w + 1 verifies w drafts);
- host cost per request (drafting, masks, verification, commit: the step minus its target forward), measured
  online for plain steps and for speculating steps of each batch size (power-of-two bucket: drafting is batched
  across requests, so its cost per request falls with the batch) and width (see below; a batch size not
  measured yet speculates once to find out);
- acceptance, measured online: for each request class c and draft node index j (parents precede children, so
  a tree's first w nodes are a tree), P(node j is on the accepted path | the round verified at least j nodes,
  the request is of class c).
For b running requests the policy scores every candidate width w (0 = plain decoding):
    rate(w) = b * E[tokens | w] / (T(b, w + 1) + b * host_s(w))      E[tokens | 0] = 1
    E[tokens | w] = mean over the b requests of 1 + sum_{j <= w} P(node j on the accepted path | its class)
and takes the best. A request's class (`streak_class`) is what its last decided round accepted: none yet, 0 drafts,
1-2, 3 or more. Acceptance runs in streaks: under n-gram lookup on the demo's coding prompts a request's first
rounds accept nothing, and once its text repeats nearly every round accepts the whole chain; a round after one that
accepted nothing accepts 0.54 drafts on average, one after 3 or more 5.78 (`benchmarks/ngram_streaks.py`: full-width
rounds replayed on greedy outputs, 64 tokens, the 32 served prompts). One average over all rounds priced the
deep nodes at the first phase's acceptance while the loops ran (and rounds cut to a few nodes never measured them
again). Classes are used where shadow rounds (below) keep every request's current: a request decoded plainly
otherwise keeps the class of its last verified round until a try. Cutting a round to its first w nodes keeps exactly
the accepted path's nodes of index <= w (the target's picks do not depend on the tree; indices grow along a path),
so one set of measurements prices every cut, of chains and of trees alike. A width not measured yet is charged the
full width's host time, or, where drafting runs one step per draft (`stepwise`: EAGLE-3 and draft-model chains),
that time scaled by (w + 1) / (W + 1); its first step then measures it. Acceptance starts at one pseudo-round
accepting every node (`prior_rounds`), so a fresh engine speculates until real rounds say otherwise. (Drafters that
cost nothing, the n-gram lookup, also draft unverified trees during plain steps to keep measuring acceptance:
`shadow.py`.)

Measured rates (per batch bucket and width, once `MIN_PASSES` passes were seen) replace the model's for that width.
A measured rate is E[tokens | w] of the batch now over the measured seconds per request of a pass: tokens come from
the acceptance model (long memory, per class), time from the passes (short memory: the machine's speed drifts).
Measuring tokens over the last few passes instead let phases decide: a try (four passes) landing on a request's
start measured n-gram speculation at one token a pass, slower than plain decoding, and the next try came 100 plain
passes later. A pass's time is kept as its ratio to the profile's forward of its own shape (decayed mean), and a
batch size's time is that ratio times the profile's forward at that size: a bucket holds several batch sizes, and a
request costs more in a small batch than in a full one (plain passes at batch 10 ran 786 tok/s, at 16 1260), so
seconds per request as measured priced plain decoding of a full batch of 16 at the tail of a level's (DFLASH at
concurrency 16 then speculated at 0.86-0.89x plain, in process: `python benchmarks/inprocess_levels.py --config
DFLASH --concurrency 16,32`). The choice is the best of measured rates where they exist and modelled ones elsewhere,
those scaled by the median ratio of measured to modelled rate of the speculating widths measured at that batch size,
so the model's misses (padding, cache misses, contention) are corrected and a width is tried only where the
corrected model still favours it. While speculating, one step in `explore_every` goes in turn to plain decoding, the
model's best width and the full width, keeping their rates (and the deeper nodes' acceptance) fresh. Leaving plain
decoding for speculation first pays the drafters' catch-up (below), so outside tries it happens only where
`explore_every` speculating steps save more than that catch-up costs at this batch size (as the batch shrinks at the
end of a burst of requests, one long catch-up for a few steps of speculation loses).

A pass right after one of another width is not measured: it runs cold (the drafter and the wide verify
pass left the caches holding their data; served at concurrency 1, EAGLE3's target forward took 4.65 ms after a
speculating pass against 3.53 ms after a plain one, NGRAM's 5.5 ms against 5.0), a cost paid once per switch.
Measured, those passes made plain decoding look slower than it runs once it is chosen, and kept losing
speculation on: NGRAM at temperature 0.7 and concurrency 16 speculated at ~0.8x the plain server. So a refresh
takes two steps (`REFRESH_PASSES`) and measures the second. The cold pass is also why the policy keeps the width
it settled on unless another promises more than `SWITCH_MARGIN` / batch over it (at batch 1, 10%). In process at
concurrency 1 (`python benchmarks/inprocess_levels.py --config NGRAM --modes fixed,adaptive --concurrency 1
--rounds 2 --threads 2`) a fixed full-width engine's 12-row passes took 4.76 ms against the plain engine's 3.37,
the adaptive engine's (switching between widths) 5.02 ms, and its 7-row ones 5.33. At larger batches a cold pass
weighs less in a pass, and the batch's mix of classes changes slowly, so the margin shrinks with the batch.

Host time is measured per batch bucket and width, and the first passes of a new shape can pay one-time costs
(in bf16 on CPU oneDNN compiles a kernel for every new matrix shape: a first pass at batch 4 took 98 ms where
later ones took 40 ms). An estimate from one such pass would price speculation out at that batch size, and with
it the tries that would correct it. So the estimate (of drafting, and of a catch-up step's) is the fastest of
the first `MIN_PASSES` passes, then an average with each pass capped at `OUTLIER` times it; and until a bucket
has `MIN_PASSES` passes its drafting estimate is at most that of the largest smaller bucket that has (drafting
is batched, its cost per request does not grow with the batch).

Exploration keeps the estimates fresh without paying much for it: while plain decoding wins at a batch size, a
try is made after `explore_every` plain steps, at the width the model prefers (where the measured rates
overruled it) or the full width (where the model prefers plain decoding), and each try that confirms plain
decoding doubles the wait at that batch size (up to `explore_max` steps; a try where speculation wins resets
it). At high concurrency a speculative step can cost several plain ones, so the wait is also at least long
enough that the tries' extra cost stays under `explore_cost` of the time spent decoding plainly. A try's cost
counts all of its steps and the drafters' catch-up (see below), measured at that batch size: at high
concurrency the catch-up runs the drafter over every prompt and token committed since the last speculation,
which can cost many plain steps. A batch size where speculation looks hopeless is tried only every
`explore_max` plain steps (and within the budget): where it could not win even with every draft accepted, or,
where a try costs more than `explore_every` plain steps, where the model (corrected by the measured rates, with
the acceptance measured at every batch size) prices every width under `try_within` (0.8) times plain decoding.
Such tries only refresh costs the model already has, and they cost most: DFLASH at concurrency 32 drafts 32
blocks and verifies 160 rows, a width-4 pass took 95 ms against 15 ms plain, and its tries held the engine
3-5% under the plain one (in process, `inprocess_levels.py --config DFLASH --concurrency 16,32`). Cheap tries
(at concurrency 1 a try costs ~8 plain steps) keep coming, as a request's acceptance can turn within a few steps.

Measured seconds decay with the engine's passes, not with their own updates (`PASS_DECAY` per decode pass of any
width or batch size), and one not updated for `4 * explore_every` passes is stale: dropped, and not compared until
`MIN_PASSES` fresh passes measured it (until then the model, scaled by the last measured ratio, prices it). Were the
stale means revived by one pass instead, that pass alone would decide: after a level at another batch size, one try
accepting a single draft sent the engine back to plain decoding at concurrency 1 for 55-77 passes at a time, until
the next try. The machine's speed drifts, so speculation measured now is compared with plain decoding measured about
as recently: plain decoding measured in a slow phase and refreshed once in 32 speculating steps would otherwise keep
a losing width for minutes. A pass slower than `PASS_OUTLIER` (1.5) times the mean of its width counts as that (a
plain step held up 6x by another process once switched a whole level to a losing width; capped at 3x, one 54 ms
hiccup among 17 ms plain passes at batch 32 still cut plain decoding's measured rate by 16%, and EAGLE3 then
speculated at a loss for the rest of the level). The first speculating step after plain ones is not measured: drafters
catch up then on everything the plain steps committed (one forward over the whole stretch), a cost paid once per
switch, not per step; a try therefore speculates for `TRY_PASSES` steps and measures all but the first: `MIN_PASSES`
passes, so its rate can be compared with plain decoding's at once. (With a single measured pass, a try could not
outlive staleness: after a level at another batch size the measured rates at concurrency 1 were dropped, every try
left one pass, stale again by the next try, and the model, scaled by an old ratio, kept plain decoding for whole
levels while the tries' passes ran 1.75x the plain ones.) The catch-up step's host time is kept apart (per batch
size) and charged to exploration. Nor is a step where some request's drafter absorbs more than a round's tokens (a
request joining a speculating batch: EAGLE-3 and draft models take in its prompt on its first propose; the engine
flags it from `Drafter.backlog`): a one-off per request, not the width's cost."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.cost_profile import CostProfile


class AdaptivePolicy:
    def __init__(self, profile: CostProfile, max_width: int, stepwise: bool, explore_every: int = 16,
                 decay: float = 0.98, explore_max: int = 512, explore_cost: float = 0.03,
                 prior_rounds: float = 1.0, try_within: float = 0.8) -> None:
        if max_width < 1:
            raise ValueError(f"adaptive speculation needs a draft width >= 1, got {max_width}")
        if not 1 <= explore_every <= explore_max:
            raise ValueError(f"adaptive speculation: need 1 <= explore_every <= explore_max, got {explore_every}, "
                             f"{explore_max}")
        self.profile = profile
        self._costs: dict[tuple[int, int], float] = {}  # (batch, q) -> profile.cost: asked for at every step
        self.max_width = max_width
        self.stepwise = stepwise  # drafting runs a step per draft token: a cut width drafts less
        if explore_cost <= 0:
            raise ValueError(f"adaptive speculation: explore_cost must be > 0, got {explore_cost}")
        self.explore_every = explore_every
        self.explore_max = explore_max
        self.explore_cost = explore_cost
        if not 0.0 <= try_within <= 1.0:
            raise ValueError(f"adaptive speculation: try_within must be in [0, 1], got {try_within}")
        self.try_within = try_within  # tries only where the model prices speculation at >= this x plain
        self._stale_after = 4 * explore_every  # passes after which a measured rate is stale: not compared
        self.decay = decay
        # [j]: decayed count of rounds whose accepted path holds node j+1 / that verified node j+1 (width > j);
        # both start at `prior_rounds` rounds accepting everything: a fresh engine speculates until rounds say
        # otherwise
        # per request class (`streak_class`), so: [class][j]
        self._on_path = [[prior_rounds] * max_width for _ in range(NUM_CLASSES)]
        self._offered = [[prior_rounds] * max_width for _ in range(NUM_CLASSES)]
        self._mix: Sequence[float] = ALL_NEW  # share of each class in the current batch (`choose`)
        self._refresh_turn = 0  # which other width the next refresh step measures
        # (batch bucket, width) -> (host seconds per request of a speculating step: drafting, tree masks,
        # verification, KV compaction, commit — everything but the target forward; passes measured): the
        # fastest of the first MIN_PASSES passes, then an EMA of passes capped at OUTLIER times it
        self._draft_s: dict[tuple[int, int], tuple[float, int]] = {}
        self._plain_s = 0.0  # host seconds per request of a plain step (EMA; 0 until one is measured)
        # batch bucket -> (host seconds per request of a catch-up step, passes measured), estimated alike
        self._catch_up_s: dict[int, tuple[float, int]] = {}
        self._plain_streak: dict[int, int] = {}  # batch bucket -> plain steps since speculation was last tried
        self._explore_gap: dict[int, int] = {}  # batch bucket -> plain steps before the next try (backs off)
        self._model_streak = 0  # speculating steps since the last refresh step (`_refresh`)
        self._last_width = 0  # the previous choice
        self._catch_up = False  # the current step is the first speculating one after plain ones: not measured
        self._tries_left = 0  # further steps of the current try
        self._refresh_left = 0  # further steps of the current refresh
        self._refresh_width = 0  # the width the current refresh measures
        self._settled = 0  # the width the last step outside tries and refreshes chose
        self._prev_width = 0  # width of the last pass recorded (a pass after one of another width runs cold)
        # decode passes per (batch bucket (power of two), width; 0 = plain): sums of each pass's seconds over the
        # profile's forward of its shape and of passes, decayed to the pass clock of the last update, passes
        # measured, that clock
        self._realized: dict[tuple[int, int], tuple[float, float, int, int]] = {}
        self._clock = 0  # decode passes recorded
        self._calib: dict[int, float] = {}  # batch bucket -> last median ratio of measured to modelled rates
        self._try_width = max_width  # the width the current try verifies
        self.choices: dict[int, int] = {}  # width -> steps that chose it

    def record_accept(self, path: Sequence[int], width: int, cls: int = 0) -> None:
        """A request of class `cls` (`streak_class`) verified its first `width` draft nodes in a round and
        accepted the nodes `path` (their tree indices, root excluded: a chain's are 1..k)."""
        on = set(path)
        offered, on_path = self._offered[cls], self._on_path[cls]
        for j in range(min(width, self.max_width)):
            offered[j] = offered[j] * self.decay + 1.0
            on_path[j] = on_path[j] * self.decay + (1.0 if j + 1 in on else 0.0)

    def record_draft(self, seconds_per_request: float, width: int | None = None, batch: int = 1,
                     catch_up: bool = False) -> None:
        """Host time per request of a step of `batch` requests that verified `width` drafts (default: the full
        width), all of the step but the target forward. `catch_up`: some request's drafter absorbed more than a
        round's tokens this step (a request that joined a speculating batch): not measured."""
        if catch_up and not self._catch_up:
            return
        if self._catch_up:  # the first speculating step after plain ones: drafters catch up on the backlog
            b = _bucket(batch)
            self._catch_up_s[b] = _robust_update(self._catch_up_s.get(b), seconds_per_request, 0.5)
            return
        key = (_bucket(batch), self.max_width if width is None else width)
        self._draft_s[key] = _robust_update(self._draft_s.get(key), seconds_per_request, 0.1)

    def draft_seconds(self, width: int, batch: int = 1) -> float:
        """Host seconds per request of a speculating step of `width` at this batch size; where `width` was not
        measured there, the full width's (scaled by (width + 1) / (max_width + 1) for stepwise drafters); 0 where
        nothing was."""
        b = _bucket(batch)
        if (b, width) in self._draft_s:
            return self._bounded(b, width)
        if (b, self.max_width) not in self._draft_s:
            return 0.0
        full = self._bounded(b, self.max_width)
        return full * (width + 1) / (self.max_width + 1) if self.stepwise else full

    def _bounded(self, bucket: int, width: int) -> float:
        """The estimate for (bucket, width); while fewer than `MIN_PASSES` passes measured it, at most that of
        the largest smaller bucket measured `MIN_PASSES` times (drafting is batched: its cost per request does
        not grow with the batch, so a first pass that paid one-time costs is not taken for this size's cost)."""
        s, n = self._draft_s[(bucket, width)]
        if n >= MIN_PASSES:
            return s
        smaller = [(b, est) for (b, w), (est, m) in self._draft_s.items()
                   if w == width and b < bucket and m >= MIN_PASSES]
        return min(s, max(smaller)[1]) if smaller else s

    def _catch_up_seconds(self, batch: int) -> float:
        """Host seconds per request of a catch-up step at this batch size (0 until one was measured)."""
        return self._catch_up_s.get(_bucket(batch), (0.0, 0))[0]

    def record_plain(self, seconds_per_request: float) -> None:
        """Host time per request of a plain step (sampling, commit, the drafters' bookkeeping); called before
        that pass's `record_pass`. A plain step right after a speculating one runs cold: not measured."""
        if self._prev_width > 0:
            return
        self._plain_s = 0.9 * self._plain_s + 0.1 * seconds_per_request if self._plain_s else seconds_per_request

    def record_pass(self, batch: int, width: int, seconds: float, catch_up: bool = False) -> None:
        """A decode pass of `batch` requests verifying `width` drafts each (0 = plain decoding; drafting,
        forward, verification) took `seconds`; `catch_up` as for `record_draft`."""
        self._clock += 1
        switched, self._prev_width = self._prev_width != width, width
        if seconds <= 0 or switched or (width > 0 and catch_up):
            return
        bucket = _bucket(batch)
        ratio = seconds / self._cost(batch, width + 1)  # to the profile's forward of this very shape
        s, m, n, at = self._realized.get((bucket, width), (0.0, 0.0, 0, self._clock))
        if self._stale(at):
            s, m, n = 0.0, 0.0, 0  # stale: measured afresh, MIN_PASSES passes before it is compared
        if n >= MIN_PASSES:  # a pass slowed by something else (another process, a collection) is capped
            ratio = min(ratio, PASS_OUTLIER * s / m)
        keep = PASS_DECAY ** (self._clock - at)
        s, m = keep * s + ratio, keep * m + 1.0
        self._realized[(bucket, width)] = (s, m, n + 1, self._clock)
        plain = self.realized(batch, 0)
        if width > 0 and plain is not None:  # back off tries where speculation keeps losing
            spec = self.expected_tokens(width) / self._per_request(s / m, batch, width)  # even by one try's pass
            gap = self._explore_gap.get(bucket, self.explore_every)
            self._explore_gap[bucket] = min(2 * gap, self.explore_max) if spec < plain else self.explore_every

    def _stale(self, at: int) -> bool:
        """A measured rate last updated at pass `at` is stale (see the module docstring)."""
        return self._clock - at > self._stale_after

    def realized(self, batch: int, width: int) -> float | None:
        """Output tokens/s of decode passes of this width at this batch size (its power-of-two bucket): the
        acceptance model's tokens per request and pass over the measured seconds per request and pass; None
        until `MIN_PASSES` passes were measured (the first can pay one-time costs), and again once the last one
        is stale (`4 * explore_every` passes old)."""
        seconds = self._pass_seconds(batch, width)
        return None if seconds is None else self.expected_tokens(width) / seconds

    def _pass_seconds(self, batch: int, width: int) -> float | None:
        """Measured seconds per request of a decode pass of this width at this batch size (see `realized`): the
        measured passes' mean ratio to the profile's forward of their shape, times the profile's forward at this
        batch size, per request."""
        sums = self._realized.get((_bucket(batch), width))
        if sums is None or sums[2] < MIN_PASSES or self._stale(sums[3]):
            return None
        return self._per_request(sums[0] / sums[1], batch, width)

    def _per_request(self, ratio: float, batch: int, width: int) -> float:
        """Seconds per request of a pass of this width and batch size that takes `ratio` x the profile's."""
        return ratio * self._cost(batch, width + 1) / batch

    def rounds(self, cls: int) -> float:
        """Decayed count of rounds recorded for requests of class `cls` (the prior's pseudo-rounds included)."""
        return self._offered[cls][0]

    def expected_tokens(self, width: int, cls: int | None = None) -> float:
        """1 + the expected number of accepted drafts when rounds verify their first `width` nodes: for a
        request of class `cls`, or (None) averaged over the current batch's requests."""
        return self._expected_all(cls)[width]

    def _expected_all(self, cls: int | None = None) -> list[float]:
        """`expected_tokens` of every width 0..max_width: running sums of P(node j on the accepted path)."""
        mix = self._mix if cls is None else [1.0 if c == cls else 0.0 for c in range(NUM_CLASSES)]
        p = [0.0] * self.max_width
        for share, on_path, offered in zip(mix, self._on_path, self._offered, strict=True):
            if share:
                for j, (a, n) in enumerate(zip(on_path, offered, strict=True)):
                    p[j] += share * (a / n if n > 0 else 0.0)
        out = [1.0]
        for pj in p:
            out.append(out[-1] + pj)
        return out

    def rate(self, batch: int, width: int) -> float:
        """Expected output tokens per second of a step of `batch` requests verifying `width` drafts each."""
        return self._plain_rate(batch) if width == 0 else self.rates(batch)[width]

    def _plain_rate(self, batch: int) -> float:
        """`rate(batch, 0)` without the other widths' (asked for at every plain step)."""
        return batch / (self._cost(batch, 1) + self._plain_s * batch)

    def _cost(self, batch: int, q: int) -> float:
        """`profile.cost(batch, q)`, interpolated once per shape (the profile does not change)."""
        c = self._costs.get((batch, q))
        if c is None:
            c = self._costs[(batch, q)] = self.profile.cost(batch, q)
        return c

    def rates(self, batch: int) -> list[float]:
        """`rate` of every width 0..max_width at this batch size (the model's; one pass over the nodes)."""
        expected = self._expected_all()
        out = [self._plain_rate(batch)]
        for w in range(1, self.max_width + 1):
            draft = self.draft_seconds(w, batch) * batch
            out.append(batch * expected[w] / (self._cost(batch, w + 1) + draft))
        return out

    def scores(self, batch: int, model: list[float] | None = None) -> list[float]:
        """Tokens/s of every width at this batch size: measured where `MIN_PASSES` passes were; elsewhere the
        model's, for speculating widths scaled by how far the measured ones fell short of (or beat) the model
        (the median ratio; where none is measured now, the last ratio seen at this batch size: a model's bias
        outlives its measurements; where none was ever seen, the nearest batch size's: served DFLASH, with no
        ratio at batch 32 yet, followed the uncorrected model there into speculating at 0.76x plain decoding),
        so one optimistic model does not send the engine through every width in turn.
        `model`: `rates(batch)` where the caller has it already."""
        model = self.rates(batch) if model is None else model
        expected = self._expected_all()
        seconds = [self._pass_seconds(batch, w) for w in range(self.max_width + 1)]
        measured = [None if s is None else e / s for e, s in zip(expected, seconds, strict=True)]
        ratios = sorted(m / model[w] for w, m in enumerate(measured) if w > 0 and m is not None and model[w] > 0)
        bucket = _bucket(batch)
        if ratios:
            self._calib[bucket] = ratios[len(ratios) // 2]
        calib = self._calib.get(bucket)  # where no width is measured now: the last ratio seen
        if calib is None:  # never measured here: the nearest batch size's bias (smaller first: levels ramp up)
            near = sorted(self._calib, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b > bucket))
            calib = self._calib[near[0]] if near else 1.0
        return [m if m is not None else model[w] * (calib if w > 0 else 1.0) for w, m in enumerate(measured)]

    def choose(self, batch: int, classes: Sequence[int] = ()) -> int:
        """Draft tokens to verify per request in the next step of `batch` requests; `classes`: their
        `streak_class`es (empty: all new)."""
        max_width = self.max_width
        if batch == 0:
            return 0
        counts = [0] * NUM_CLASSES
        for c in classes:
            counts[c] += 1
        total = sum(counts)
        self._mix = tuple(n / total for n in counts) if total else ALL_NEW
        if self._refresh_left > 0:  # the measured step of a refresh
            self._refresh_left -= 1
            best = self._refresh_width
        elif self._tries_left > 0:
            self._tries_left -= 1
            best = self._try_width
        elif (_bucket(batch), max_width) not in self._draft_s:
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
                # a try re-measures the width the model prefers, or the full width where it prefers plain
                if self._explore(batch, modelled or max_width, scores):
                    best = self._try_width = modelled or max_width
                    self._tries_left = TRY_PASSES - 1
            else:
                best = self._refresh(best, modelled)
        if best > 0:
            self._plain_streak[_bucket(batch)] = 0
        self._catch_up = best > 0 and self._last_width == 0
        self._last_width = best
        self.choices[best] = self.choices.get(best, 0) + 1
        return best

    def _repays_catch_up(self, batch: int, width: int, scores: list[float]) -> bool:
        """Switching from plain decoding to `width` first pays the drafters' catch-up (measured at this batch
        size): worth it only if `explore_every` steps at `width` save more time than that."""
        catch_up = max(0.0, self._catch_up_seconds(batch) - self.draft_seconds(width, batch)) * batch
        tokens = self.explore_every * batch * self.expected_tokens(width)
        return tokens / scores[0] - tokens / scores[width] > catch_up

    def _refresh(self, best: int, modelled: int) -> int:
        """Speculating at `best`: one step in `explore_every` goes in turn to plain decoding (two steps, the
        second measured), the model's width and the full width instead, so that their measured rates (and the
        deeper nodes' acceptance) stay fresh."""
        self._model_streak += 1
        if self._model_streak < self.explore_every:
            return best
        self._model_streak = 0
        others = [w for w in dict.fromkeys((0, modelled, self.max_width)) if w != best]
        self._refresh_turn = (self._refresh_turn + 1) % len(others)
        self._refresh_width = others[self._refresh_turn]
        self._refresh_left = REFRESH_PASSES - 1  # the first pass after a switch runs cold: measure a second one
        return self._refresh_width

    def _explore(self, batch: int, w: int, scores: list[float]) -> bool:
        """Plain decoding was picked from `scores` (every width's, as `scores()` gave them): try width `w` now?
        (See the module docstring.)"""
        bucket = _bucket(batch)
        streak = self._plain_streak[bucket] = self._plain_streak.get(bucket, 0) + 1
        spec_s = self._cost(batch, w + 1) + self.draft_seconds(w, batch) * batch  # one step of the try
        plain_rate = self._plain_rate(batch)
        plain_s = batch / plain_rate  # one plain step
        catch_up = max(0.0, self._catch_up_seconds(batch) - self.draft_seconds(w, batch)) * batch
        extra = TRY_PASSES * (spec_s - plain_s) + catch_up  # a try's steps, the first one catching up
        affordable = extra / (plain_s * self.explore_cost)  # plain steps per try within the budget
        if streak < max(self._explore_gap.get(bucket, self.explore_every), affordable):
            return False
        if streak >= self.explore_max:
            return True  # even a hopeless bucket is re-measured now and then (within the budget): costs change
        if extra > self.explore_every * plain_s and max(scores[1:]) < self.try_within * scores[0]:
            return False  # an expensive try where the (corrected) model prices every width far under plain
        return batch * (w + 1) / spec_s > plain_rate  # could win, with every draft accepted


NUM_CLASSES = 4  # of `streak_class`
ALL_NEW = (1.0,) + (0.0,) * (NUM_CLASSES - 1)  # a batch's class shares when no classes are given


def streak_class(last_accepted: int | None) -> int:
    """A request's class for the acceptance model, from the drafts its last decided round accepted (None: no
    round yet). Acceptance runs in streaks: on the demo's coding prompts under NGRAM a round after one that
    accepted nothing accepts 0.54 drafts on average, after one that accepted 3 or more 5.78
    (`python benchmarks/ngram_streaks.py`)."""
    if last_accepted is None:
        return 0
    return 1 if last_accepted == 0 else 2 if last_accepted < 3 else 3


MIN_PASSES = 3  # passes of a width measured before its rate is compared with plain decoding's
TRY_PASSES = 1 + MIN_PASSES  # steps of a try: the drafters' catch-up, then enough measured ones to compare
REFRESH_PASSES = 2  # steps of a refresh while speculating: the first runs cold, the second is measured
# a width other than the settled one must promise this much more / batch to be switched to: the cold pass
# weighs most in small passes, and at small batch sizes the batch's acceptance classes change from step to step
SWITCH_MARGIN = 0.1
PASS_DECAY = 0.9  # weight of a measured pass per later decode pass (of any width and batch size)
OUTLIER = 3.0  # a host-time sample counts at most this many times the estimate (`_robust_update`)
PASS_OUTLIER = 1.5  # a measured pass counts at most this many times the mean pass time of its width and batch size


def _robust_update(prev: tuple[float, int] | None, sample: float, weight: float) -> tuple[float, int]:
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


def _bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...) for the measured rates."""
    return 1 << max(0, batch - 1).bit_length()
