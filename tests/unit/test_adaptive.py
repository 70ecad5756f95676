"""Adaptive speculation: the cost profile's interpolation and storage, the width policy, and the
measure-once-then-load profile of a real (tiny) engine."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

import specserve.engine.adaptive.measure as measure_mod
from specserve.config import SpeculativeConfig
from specserve.engine.adaptive import (
    MIN_PASSES,
    OUTLIER,
    PASS_DECAY,
    PASS_OUTLIER,
    AdaptivePolicy,
    CostProfile,
    engine_profile,
    measure_profile,
    monotone,
    profile_grid,
    profile_key,
    streak_class,
)
from specserve.engine.adaptive.costs import robust_update
from specserve.engine.adaptive.explore import REFRESH_PASSES, TRY_PASSES
from specserve.engine.adaptive.measure import extend_row, measured_widths
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.types import SamplingParams

# -- CostProfile


def grid() -> CostProfile:
    # T(b, q) at b in {1, 4}, q in {1, 3}
    return CostProfile("k", (1, 4), (1, 3), ((1.0, 3.0), (2.0, 6.0)))


def test_cost_on_and_between_grid_points() -> None:
    p = grid()
    assert p.cost(1, 1) == 1.0 and p.cost(4, 3) == 6.0
    assert p.cost(1, 2) == pytest.approx(2.0)  # between widths
    assert p.cost(4, 2) == pytest.approx(4.0)
    assert p.cost(2, 2) == pytest.approx(2.0 + (4.0 - 2.0) / 3)  # between batches of interpolated widths


def test_cost_extrapolates_past_the_grid() -> None:
    p = grid()
    assert p.cost(1, 5) == pytest.approx(5.0)  # the last segment's slope continues: 3 + 1 * (5 - 3)
    assert p.cost(8, 3) == pytest.approx(10.0)  # 6 + (6 - 3) / 3 * (8 - 4)
    assert p.cost(1, 0) == 1.0  # below a grid starting at 1: the first value
    # below a grid starting above 1: proportional to the size
    assert CostProfile("k", (2, 4), (1,), ((2.0,), (4.0,))).cost(1, 1) == pytest.approx(1.0)
    # one measured batch size: cost scales with the batch
    assert CostProfile("k", (2,), (1, 2), ((2.0, 4.0),)).cost(6, 2) == pytest.approx(12.0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    p = grid()
    path = tmp_path / "nested" / "profile.json"
    p.save(path)
    assert CostProfile.load(path) == p
    assert [f.name for f in path.parent.iterdir()] == ["profile.json"]  # no temporary file left behind
    assert json.loads(path.read_text())["key"] == "k"


@pytest.mark.parametrize("batches, widths, seconds", [
    ((1, 4), (1, 3), ((1.0, 3.0),)),  # one row missing
    ((1, 4), (1, 3), ((1.0, 3.0), (2.0,))),  # a short row
    ((4, 1), (1, 3), ((1.0, 3.0), (2.0, 6.0))),  # batch sizes decreasing
    ((1, 1), (1, 3), ((1.0, 3.0), (2.0, 6.0))),  # a repeated batch size
    ((1, 4), (3, 1), ((1.0, 3.0), (2.0, 6.0))),  # widths decreasing
])
def test_profile_rejects_a_bad_grid(batches: tuple[int, ...], widths: tuple[int, ...],
                                    seconds: tuple[tuple[float, ...], ...]) -> None:
    with pytest.raises(ValueError, match="adaptive profile"):
        CostProfile("k", batches, widths, seconds)


def test_profile_grid_is_made_monotone(tmp_path: Path) -> None:
    """A time above that of a larger shape is noise (a slow stretch during one shape): cut to the larger's, on
    load as after measuring, so one bad shape does not price the widths around it out."""
    noisy = [[5.9, 6.0, 18.4, 10.5], [7.2, 5.0, 12.0, 12.5]]
    assert monotone(noisy) == ((5.0, 5.0, 10.5, 10.5), (5.0, 5.0, 12.0, 12.5))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"key": "k", "batch_sizes": [1, 2], "widths": [1, 2, 3, 5], "seconds": noisy}))
    assert CostProfile.load(path).seconds == monotone(noisy)


def test_load_rejects_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"key": "k", "batch_sizes": [1, 2], "widths": [1], "seconds": [[1.0]]}))
    with pytest.raises(ValueError, match="adaptive profile"):
        CostProfile.load(path)


# -- AdaptivePolicy


def flat(max_q: int = 9) -> CostProfile:
    """Verifying more tokens costs (almost) nothing more."""
    return CostProfile("k", (1, 8), (1, max_q), ((1.0, 1.01), (2.0, 2.02)))


def steep() -> CostProfile:
    """One forward costs 1 s + 0.5 s per extra token verified."""
    return CostProfile("k", (1,), (1, 2, 3, 5), ((1.0, 1.5, 2.0, 3.0),))


def measure(policy: AdaptivePolicy, batch: int, width: int, tok_s: float, passes: int = 1) -> None:
    """Record `passes` decode passes of `width` at `batch` that ran at `tok_s` output tokens/s: seconds per pass =
    batch x the acceptance model's tokens per request / tok_s (what `realized` divides)."""
    for _ in range(passes):
        policy.record_pass(batch, width, seconds=batch * policy.expected_tokens(width) / tok_s)


def chain(accepted: int) -> list[int]:
    """The accepted path of a chain round that accepted `accepted` drafts: node indices 1..accepted."""
    return list(range(1, accepted + 1))


def tries(picks: list[int]) -> list[tuple[int, list[int]]]:
    """Each run of speculating steps in `picks` with its wait: the steps since the previous run, up to and
    including the run's first (the policy counts the step that starts a try among the plain ones)."""
    out: list[tuple[int, list[int]]] = []
    wait, prev = 0, 0
    for w in picks:
        if w > 0 and prev > 0:
            out[-1][1].append(w)
        elif w > 0:
            out.append((wait + 1, [w]))
            wait = 0
        else:
            wait += 1
        prev = w
    return out


def test_policy_needs_a_width() -> None:
    with pytest.raises(ValueError, match="draft width"):
        AdaptivePolicy(flat(), max_width=0, stepwise=True)


def test_no_data_speculates() -> None:
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=True)
    assert policy.choose(3) == 4
    policy.record_draft(0.001)
    assert policy.choose(3) == 4  # drafting measured, acceptance not yet
    assert policy.expected_tokens(4) == 5.0  # before any round: one pseudo-round accepting every node
    policy.record_accept(chain(0), 2)  # a cut round measures only its own nodes, not the full width's
    assert policy.expected_tokens(2) == pytest.approx(1.0 + 2 * 0.98 / 1.98)
    assert policy.expected_tokens(4) == pytest.approx(policy.expected_tokens(2) + 2.0)
    assert policy.choose(3) == 4
    assert policy.choose(0) == 0  # nothing running
    assert policy.choices == {4: 3}


def test_high_acceptance_cheap_drafting_takes_the_max_width() -> None:
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=True)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0)
    assert policy.expected_tokens(4) == pytest.approx(5.0)
    assert policy.expected_tokens(2) == pytest.approx(3.0)
    assert policy.rate(1, 4) == pytest.approx(5.0 / flat().cost(1, 5))
    assert policy.choose(1) == 4 and policy.choose(8) == 4
    # the same acceptance with drafting as slow as 5 target forwards: plain decoding wins
    slow = AdaptivePolicy(flat(), max_width=4, stepwise=True)
    for _ in range(20):
        slow.record_accept(chain(4), 4)
    slow.record_draft(5.0)
    assert slow.rate(1, 4) == pytest.approx(5.0 / (flat().cost(1, 5) + 5.0))
    assert slow.choose(1) == 0


def test_plain_host_cost_counts_against_plain_decoding() -> None:
    """Host work per request of plain steps (sampling, commits, drafter bookkeeping) enters plain's rate, so a
    speculative round that costs 1.5 extra forward-equivalents per request wins once plain steps pay as much."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False)
    for _ in range(20):
        policy.record_accept(chain(1), 4)  # one draft accepted per round: E[tokens] = 2
    policy.record_draft(1.5)
    assert policy.choose(1) == 0  # plain: 1 token / T(1,1) = 1; speculation: 2 / (T(1,w+1) + 1.5) ~ 0.8
    before = policy.rate(1, 0)
    policy.record_plain(1.5)
    assert policy.rate(1, 0) == pytest.approx(1 / (flat().cost(1, 1) + 1.5))
    assert policy.rate(1, 0) < before
    assert policy.choose(1) > 0


@pytest.mark.parametrize("tree", [False, True])
def test_zero_acceptance_decodes_plainly_but_explores(tree: bool) -> None:
    policy = AdaptivePolicy(steep(), max_width=4, stepwise=tree, explore_every=4, explore_cost=10.0, prior_rounds=0,
                            try_within=0.0)  # tries even where the model prices speculation far under plain
    for _ in range(20):
        policy.record_accept(chain(0), 4)
    policy.record_draft(0.01)
    assert policy.expected_tokens(4) == 1.0
    picks = [policy.choose(1) for _ in range(60)]
    assert picks[0] == 0  # nothing is accepted: plain decoding
    assert len(tries(picks)) >= 5
    for wait, run in tries(picks)[:-1]:  # (the last may run past the end)
        assert wait <= 4  # a try every explore_every steps (cheap here, and never confirmed by measured passes)
        # of the full width, TRY_PASSES steps: the first catches the drafter up (not measured), MIN_PASSES are
        assert run == [4] * TRY_PASSES


def test_chains_and_trees_are_cut_to_the_best_width() -> None:
    """Rates at b = 1 on the steep profile are E[tokens | w] / (1 + w / 2). A chain whose first draft is always
    accepted and its second never verifies 1 draft (2 / 1.5). A tree whose accepted path is nodes 2 then 3 (node 1
    a rejected sibling of node 2) gains nothing from w = 1, one token from w = 2 and two from w = 3: 3 / 2.5 beats
    plain (1), w = 2 (2 / 2) and the whole tree (3 / 3)."""
    for path, want in (([1], 1), ([2, 3], 3)):
        policy = AdaptivePolicy(steep(), max_width=4, stepwise=False, prior_rounds=0)
        for _ in range(20):
            policy.record_accept(path, 4)
        policy.record_draft(0.0)
        assert [policy.expected_tokens(w) for w in range(5)] == pytest.approx(
            [1.0, *(1.0 + sum(1 for j in path if j <= w) for w in range(1, 5))])
        assert policy.choose(1) == want, path


def test_cut_rounds_measure_their_own_nodes_and_the_full_width_is_revisited() -> None:
    """Rounds cut to 2 nodes update nodes 1-2 only; while speculating, every `explore_every`-th step verifies the
    full width (so that deeper nodes stay measured) or decodes plainly (so that its rate stays measured)."""
    policy = AdaptivePolicy(steep(), max_width=4, stepwise=False, explore_every=4, prior_rounds=0)
    for _ in range(20):
        policy.record_accept([1], 4)  # E = 2 at every width >= 1: the best is w = 1
    assert policy.expected_tokens(2) == pytest.approx(2.0)
    for _ in range(50):
        policy.record_accept([1, 2], 2)  # node 2 is now accepted too (only rounds of width >= 2 say so)
    assert 2.8 < policy.expected_tokens(2) < 3.0  # decayed: the 20 older rounds still weigh 0.98^50
    assert policy.expected_tokens(4) == policy.expected_tokens(2)  # nodes 3, 4: measured never accepted
    policy.record_draft(0.0)
    picks = [policy.choose(1) for _ in range(40)]
    assert max(range(5), key=picks.count) == 2  # w = 2 (2.84 / 2) beats w = 1 (2 / 1.5)
    # one step in explore_every (4) speculating ones goes to the full width or to plain decoding, in turn, for
    # REFRESH_PASSES steps (the first pass after a switch runs cold: the second is measured)
    runs = [(settled, list(g)) for settled, g in itertools.groupby(picks, key=lambda w: w == 2)]
    assert max(len(g) for settled, g in runs if settled) < 4, picks
    refreshes = [g for settled, g in runs if not settled]
    assert len(refreshes) >= 40 // (4 + REFRESH_PASSES)
    assert all(r in ([4] * REFRESH_PASSES, [0] * REFRESH_PASSES) for r in refreshes), picks
    assert all(a != b for a, b in itertools.pairwise(r[0] for r in refreshes)), picks


# -- engine_profile on a tiny engine


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    spec = SpeculativeConfig.resolve("NGRAM", num_draft_tokens=3, tree="chain")
    return LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec)


def tiny_engine(llm: LLM, max_num_seqs: int = 2, num_kv_blocks: int = 64) -> BatchEngine:
    cfg = EngineConfig(num_kv_blocks=num_kv_blocks, kv_block_size=4, max_num_seqs=max_num_seqs)
    return BatchEngine(llm.model, llm.eos_ids, llm.tokenizer.decode, cfg, llm.drafter_builder)


def test_profile_grid() -> None:
    assert profile_grid(64, 11) == ([1, 2, 4, 8, 16, 32, 64], [1, 2, 3, 5, 9, 12])
    assert profile_grid(6, 2) == ([1, 2, 4, 6], [1, 2, 3])
    assert profile_grid(1, 1) == ([1], [1, 2])


def test_tall_shapes_are_continued_in_proportion_to_their_tokens() -> None:
    """Shapes of more than `max_tokens` tokens are not run (two widths per batch always are): past the widest
    one run, a batch's time grows with its tokens."""
    ran: list[tuple[int, int]] = []

    def forward(b: int, q: int) -> None:
        ran.append((b, q))

    profile = measure_profile(forward, "k", [1, 4, 32], [1, 2, 3, 5, 9], repeats=1, max_tokens=16)
    assert sorted(set(ran)) == [(1, 1), (1, 2), (1, 3), (1, 5), (1, 9), (4, 1), (4, 2), (4, 3), (32, 1), (32, 2)]
    assert measured_widths(32, [1, 2, 3], 16) == [1, 2] and measured_widths(4, [1, 2, 3], None) == [1, 2, 3]
    assert extend_row([1, 2, 3, 5, 9], [1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0, 5.0, 9.0]
    assert extend_row([1, 2, 3, 5], [0.5, 4.0]) == [0.5, 4.0, 6.0, 10.0]
    assert len(profile.seconds[2]) == 5


def test_engine_profile_measures_once_then_loads(llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []
    real = measure_mod.measure_profile

    def counting(*args: Any, **kwargs: Any) -> CostProfile:
        measured.append(args[1])  # the key
        return real(*args, **kwargs)

    monkeypatch.setattr(measure_mod, "measure_profile", counting)
    path = tmp_path / "profile.json"
    eng = tiny_engine(llm)
    first, at = engine_profile(eng, path, progress=False)
    assert at == path and path.exists() and measured == [profile_key(eng)]
    assert first.key == profile_key(eng)
    assert (first.batch_sizes, first.widths) == ((1, 2), (1, 2, 3))  # max_num_seqs 2; 2 drafts + the root
    assert all(s > 0 for row in first.seconds for s in row)
    assert CostProfile.load(path) == first

    again, _ = engine_profile(tiny_engine(llm), path, progress=False)  # same key: loaded, not measured
    assert again == first and len(measured) == 1

    other = tiny_engine(llm, max_num_seqs=4)
    assert profile_key(other) != profile_key(eng)
    third, _ = engine_profile(other, path, progress=False)  # another key: measured again, file replaced
    assert len(measured) == 2 and third.key == profile_key(other) and third.batch_sizes == (1, 2, 4)
    assert CostProfile.load(path) == third

    path.write_text("{not json")  # unreadable: measured again
    engine_profile(other, path, progress=False)
    assert len(measured) == 3 and CostProfile.load(path).key == profile_key(other)


def test_engine_profile_refuses_a_busy_or_small_engine(llm: LLM, tmp_path: Path) -> None:
    busy = tiny_engine(llm)
    busy.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        engine_profile(busy, tmp_path / "a.json", progress=False)
    with pytest.raises(ValueError, match="too small to profile"):
        engine_profile(tiny_engine(llm, num_kv_blocks=8), tmp_path / "b.json", progress=False)
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()



def test_measured_rates_overrule_the_model() -> None:
    """The model (free drafting, full acceptance) picks speculation; passes measured at this batch size show plain
    decoding producing more tokens per second, so plain wins, and speculation is still re-tried now and then.
    A width's rate counts once MIN_PASSES passes of it were measured (one pass can be a request's last, cut
    short by its token limit)."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=8, explore_cost=10.0, try_within=0.0)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0, batch=2)
    assert policy.choose(2) == 4  # nothing measured at batch 2
    measure(policy, 2, 4, 1000.0)  # the first speculating step catches up (and follows a plain one): not measured
    assert policy.realized(2, 4) is None
    for _ in range(MIN_PASSES - 1):
        assert policy.choose(2) == 4
        measure(policy, 2, 4, 10.0)
        assert policy.realized(2, 4) is None  # too few passes to judge
    assert policy.choose(2) == 4
    measure(policy, 2, 4, 10.0)
    assert policy.realized(2, 4) == pytest.approx(10.0)
    for _ in range(MIN_PASSES + 1):  # (the first plain pass after speculation runs cold: not measured)
        assert policy.choose(2) == 0  # speculation measured, plain not yet: measure it
        measure(policy, 2, 0, 30.0)
    picks = [policy.choose(2) for _ in range(12)]
    assert picks.count(0) >= 6 and 4 in picks, picks  # plain is faster here; speculation explored
    assert policy.choose(1) == 4 and policy.choose(8) == 4  # other batch sizes: their own measurements (none)
    measure(policy, 2, 4, 100.0, passes=8)
    picks = [policy.choose(2) for _ in range(8)]
    assert picks.count(4) >= 6, picks  # speculation has become faster at batch 2 (plain re-measured now and then)


def test_measured_rates_are_kept_per_width_and_correct_the_model_elsewhere() -> None:
    """Width 1 is measured at a fraction of its modelled rate; the widths not measured are scaled by that
    fraction: at half, width 4 (modelled at 2 x 5 / 1.14 s = 8.8 tok/s) still beats plain's measured 3 tok/s and
    is tried; at a fifth it does not, and plain decoding is kept."""
    for fraction, want in ((0.5, 4), (0.2, 0)):
        policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, prior_rounds=0)
        for _ in range(20):
            policy.record_accept(chain(4), 4)
        policy.record_draft(0.0, batch=2)
        modelled = policy.rate(2, 1)
        measure(policy, 2, 0, 3.0, passes=MIN_PASSES)
        measure(policy, 2, 1, fraction * modelled, passes=MIN_PASSES + 1)  # (the first after a switch runs cold)
        assert policy.realized(2, 1) == pytest.approx(fraction * modelled) and policy.realized(2, 4) is None
        assert policy.scores(2)[4] == pytest.approx(fraction * policy.rate(2, 4))
        assert policy.choose(2) == want, fraction


def test_exploration_backs_off_where_speculation_keeps_losing() -> None:
    """Passes at batch 2 measure plain decoding at 30 tok/s and speculation at 10: each try that confirms it
    doubles the wait, so over 400 steps speculation is tried a handful of times, not once in 4 steps."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=4, explore_max=256, explore_cost=10.0,
                            try_within=0.0)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0, batch=2)
    picks = []
    for _ in range(400):
        w = policy.choose(2)
        picks.append(w)
        measure(policy, 2, w, 10.0 if w > 0 else 30.0)
    tries = [i for i, w in enumerate(picks) if w > 0 and (i == 0 or picks[i - 1] == 0)]  # first steps of tries
    assert 3 <= len(tries) <= 8, tries
    gaps = [b - a for a, b in itertools.pairwise(tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 64  # the waits grow
    measure(policy, 2, 4, 500.0, passes=2)  # speculation has become the faster: tries come back
    assert 4 in [policy.choose(2) for _ in range(8)]


def test_no_exploration_where_speculation_cannot_win() -> None:
    """Drafting as slow as 5 target forwards per request: even with every draft accepted speculation loses, so
    it is only re-measured after `explore_max` plain steps, and only within the cost budget (a try's four steps
    cost 4 x 5 plain ones more: at 3% of the time, one try in 668 plain steps)."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=True, explore_every=4, explore_max=64, explore_cost=10.0)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(5.0)
    picks = [policy.choose(1) for _ in range(128)]
    assert [(wait >= 64, run) for wait, run in tries(picks)] == [(True, [4] * TRY_PASSES)]  # one try, late
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=True, explore_every=4, explore_max=64, explore_cost=0.03)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(5.0)
    picks = [policy.choose(1) for _ in range(1000)]
    extra = TRY_PASSES * (policy.costs.speculating_step(1, 4) - policy.costs.plain_step(1))  # a try's extra seconds
    assert len(tries(picks)) == 1  # still re-measured now and then...
    assert all(extra <= 0.03 * wait * policy.costs.plain_step(1) for wait, _ in tries(picks))  # ...within budget


def test_no_exploration_where_the_model_prices_speculation_far_under_plain() -> None:
    """Rounds accept nothing (measured at any batch size: acceptance does not depend on it), so the model prices
    every width under `try_within` x plain decoding. Where a try costs more than `explore_every` plain steps
    (drafting 2 s a step: four steps cost 8 plain ones more), tries come only every `explore_max` plain steps,
    not after `explore_every`; with try_within 0, or where tries are cheap (drafting 0.5 s), they come as soon as
    the budget allows."""
    picks = {}
    for within, draft in ((0.8, 2.0), (0.0, 2.0), (0.8, 0.5)):
        policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=4, explore_max=64,
                                explore_cost=10.0, prior_rounds=0, try_within=within)
        for _ in range(20):
            policy.record_accept(chain(0), 4)
        policy.record_draft(draft)  # with every draft accepted, 5 tokens / 3.01 s would beat plain decoding
        assert policy.rate(1, 4) < 0.8 * policy.rate(1, 0)
        picks[within, draft] = tries([policy.choose(1) for _ in range(70)])
    assert [wait >= 64 for wait, _ in picks[0.8, 2.0]] == [True]  # one try, after explore_max plain steps
    assert picks[0.0, 2.0][0][0] <= 4 and picks[0.8, 0.5][0][0] <= 4  # after explore_every
    with pytest.raises(ValueError, match="try_within"):
        AdaptivePolicy(flat(), max_width=4, stepwise=False, try_within=1.5)


def test_exploration_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="explore_every <= explore_max"):
        AdaptivePolicy(flat(), max_width=4, stepwise=True, explore_every=32, explore_max=16)


def test_host_cost_is_kept_per_width() -> None:
    """A chain cut to 1 draft costs less to draft than the full 4; until measured it is charged the full cost
    (where drafting is one forward whatever the width), or the full cost scaled by (1 + 1) / (4 + 1) where each
    draft is a drafter step."""
    stepwise = AdaptivePolicy(flat(), max_width=4, stepwise=True)
    stepwise.record_draft(1.0)
    assert stepwise.draft_seconds(1) == pytest.approx(0.4) and stepwise.draft_seconds(4) == 1.0
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, prior_rounds=0)
    for _ in range(20):
        policy.record_accept(chain(1), 4)  # E[tokens | w >= 1] = 2
    policy.record_draft(1.0)  # the full width's drafting: as slow as a forward per request
    assert policy.draft_seconds(1) == policy.draft_seconds(4) == 1.0
    assert policy.choose(1) == 0  # 1 token / 1 s beats 2 / (1.5 + 1) s
    policy.record_draft(0.1, width=1)
    assert policy.draft_seconds(1) == 0.1 and policy.draft_seconds(4) == 1.0
    assert policy.rate(1, 1) == pytest.approx(2 / (flat().cost(1, 2) + 0.1))
    assert policy.choose(1) == 1  # 2 / 1.6 s beats plain


def test_exploration_stays_within_its_cost_budget() -> None:
    """A full-width step costs 3x a plain one (steep profile, free drafting): a try (four such steps) after every
    4 plain steps would spend 200% more time; with a 5% budget the tries come 160 plain steps apart. Once a try's
    first step is seen to pay a catch-up of 6 plain steps' worth, they come 280 apart."""
    policy = AdaptivePolicy(steep(), max_width=4, stepwise=False, explore_every=4, explore_cost=0.05, try_within=0.0)
    for _ in range(20):
        policy.record_accept(chain(0), 4)  # nothing accepted: the model picks plain decoding
    policy.record_draft(0.0)
    picks = [policy.choose(1) for _ in range(330)]
    plain_s = policy.costs.plain_step(1)
    extra = TRY_PASSES * (policy.costs.speculating_step(1, 4) - plain_s)  # a try's time over plain steps'
    assert extra == pytest.approx(8 * plain_s)
    assert len(tries(picks)) == 2 and all(run == [4] * TRY_PASSES for _, run in tries(picks))  # tries come...
    assert all(extra <= 0.05 * wait * plain_s for wait, _ in tries(picks))  # ...within the budget
    first = len(tries(picks))
    for _ in range(900):
        picks.append(policy.choose(1))
        if picks[-1] > 0:  # the engine reports each speculating step's host time; a try's first one catches up
            policy.record_draft(6.0 if picks[-2] == 0 else 0.0)
    # the next try was timed before any catch-up was measured; from then on each try is charged its catch-up
    # (6 plain steps' worth) too, and waits longer
    assert policy.costs.catch_up_extra(1, 4) == pytest.approx(6 * plain_s)
    waits = [wait for wait, _ in tries(picks)]
    later = waits[first + 1:]
    assert len(later) >= 2 and min(later) > max(waits[:first + 1])
    assert all(extra + 6 * plain_s <= 0.05 * wait * plain_s for wait in later)
    with pytest.raises(ValueError, match="explore_cost"):
        AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_cost=0.0)


def test_measured_rates_are_modelled_tokens_over_measured_seconds() -> None:
    """A measured rate is the acceptance model's tokens per request (long memory: acceptance runs in phases, a
    request's first rounds accept little, its later ones loop) over the decayed mean of measured seconds per
    request and pass (short memory: the machine's speed drifts), so a try landing on a request's start does not
    price the width at that phase's acceptance. Passes at batch 2 of 0.5, 0.5 and 2 s: 1 s, 1 s, 4 s a request."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, prior_rounds=0)
    for _ in range(20):
        policy.record_accept(chain(2), 4)  # E[tokens | 4] = 3
    policy.record_pass(2, 0, seconds=1.0)  # the first pass: of the width recorded before it (plain), measured
    policy.record_pass(2, 4, seconds=0.5)  # the first after a switch runs cold: not measured
    for seconds in (0.5, 0.5, 2.0):
        policy.record_pass(2, 4, seconds=seconds)
    d = PASS_DECAY
    mean = (d * d * 0.25 + d * 0.25 + 1.0) / (d * d + d + 1)
    assert policy.realized(2, 4) == pytest.approx(3.0 / mean)
    assert policy.realized(2, 0) is None  # one plain pass: too few
    policy.record_accept(chain(4), 4)  # acceptance moves the measured rate at once
    assert policy.realized(2, 4) == pytest.approx(policy.expected_tokens(4) / mean)


def test_host_cost_is_kept_per_batch_size() -> None:
    """Drafting is batched across requests: 1 s per request alone, 0.05 s per request in a batch of 8. Each
    batch size is charged its own measurement; one never measured speculates once to find out."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, prior_rounds=0)
    for _ in range(20):
        policy.record_accept(chain(1), 4)  # E[tokens | 4] = 2
    policy.record_draft(2.0, batch=1)
    assert policy.choose(1) == 0  # 1 / 1 s beats 2 / (1.01 + 2) s
    assert policy.choose(8) == 4  # batch 8 not measured: speculate to learn (this step catches up)
    assert policy.choose(8) == 4  # and this one is measured
    policy.record_draft(0.05, batch=8)
    assert policy.draft_seconds(4, 8) == 0.05 and policy.draft_seconds(4, 1) == 2.0
    assert policy.choose(8) > 0  # 16 tokens / (2.02 + 0.4) s beats 8 / 2 s
    policy.choose(8)  # (a refresh's second step)
    assert policy.choose(1) == 0


def test_plain_steps_measure_ngram_acceptance_in_shadow(llm: LLM) -> None:
    """A policy that always decodes plainly (drafting priced at 100 s per request) still learns the n-gram
    drafter's acceptance: each plain step drafts one request's tree unverified, and the tokens that follow decide
    it. The output is the plain decoding's."""
    engine = tiny_engine(llm, max_num_seqs=2)
    assert engine.shadow is not None  # n-gram drafting costs nothing
    policy = AdaptivePolicy(steep(), max_width=engine.max_draft, stepwise=False, explore_every=4, explore_max=4096)
    for b in (1, 2):
        policy.record_draft(100.0, batch=b)
    engine.policy = policy
    prompt = [5, 6, 7, 8] * 6  # repetitive: the lookup finds continuations
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt[1:], params)
    out: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert set(policy.choices) == {0}  # never speculated
    assert engine.shadow.decided >= 10
    assert policy.expected_tokens(engine.max_draft) != 1.0 + engine.max_draft  # no longer the prior
    assert policy.rounds(2) > 3  # rounds after rounds that accepted 1-2 drafts (of 2) are kept apart
    w = engine.max_draft
    assert policy.expected_tokens(w, 2) > policy.expected_tokens(w, 1)  # and accept more: streaks
    want = llm.generate_plain([prompt, prompt[1:]], params)
    assert [out["a"], out["b"]] == [r.token_ids for r in want]


@pytest.mark.parametrize("catch_up_s, back", [(50.0, False), (1.0, True)])
def test_leaving_plain_decoding_must_repay_the_catch_up(catch_up_s: float, back: bool) -> None:
    """Speculation (every draft accepted: 5 tokens per 1.01 s) beats plain decoding (1 token per s). After a
    plain step (a refresh), switching back pays the catch-up measured when speculation started: 2 steps of
    speculation (explore_every) save 10 - 2 = 8 s, so a 50 s catch-up keeps plain decoding, a 1 s one does not."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=2, explore_max=1024, prior_rounds=0)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0)
    assert policy.choose(1) == 4  # the first step catches up: its host time is the catch-up's
    policy.record_draft(catch_up_s)
    picks = [policy.choose(1) for _ in range(10)]
    assert picks[:REFRESH_PASSES] == [0] * REFRESH_PASSES  # every second speculating step refreshes plain decoding
    assert (4 in picks) is back, picks


def test_plain_passes_right_after_speculation_are_not_measured() -> None:
    """Speculation makes 750 tok/s; plain decoding 800, but its first pass after a speculating one runs cold
    (500: caches refilled after the drafter and the wide verify). Measuring only such passes (a one-step refresh
    while speculating, the first plain step after a try) kept the losing speculation on; a refresh now takes
    two plain steps and only the second is measured, so plain decoding takes over."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=8)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0, batch=2)
    measure(policy, 2, 4, 750.0, passes=10)
    picks, prev = [], 4
    for _ in range(300):
        w = policy.choose(2)
        picks.append(w)
        policy.record_plain(0.0)
        measure(policy, 2, w, 750.0 if w else (500.0 if prev else 800.0))
        prev = w
    refresh = picks.index(0)
    assert picks[refresh: refresh + 2] == [0, 0], picks  # a refresh: two plain steps
    assert picks[150:].count(0) > 0.9 * 150, picks
    assert policy.realized(2, 0) == pytest.approx(800.0)  # only warm passes measured


def test_speculation_is_compared_with_plain_decoding_measured_as_recently() -> None:
    """Plain decoding was measured in a slow phase of the machine (300 tok/s), then speculation at 700; now plain
    decoding runs at 800. Measured rates decay with the engine's passes, so the plain passes of the refresh steps
    (one in `explore_every` speculating steps) outweigh the slow ones within a few refreshes and plain decoding
    takes over (with rates decaying only on their own updates it took 13 refreshes, 104 steps)."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=8)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0, batch=2)
    measure(policy, 2, 0, 300.0, passes=10)
    measure(policy, 2, 4, 700.0, passes=10)
    picks = []
    for _ in range(200):
        w = policy.choose(2)
        picks.append(w)
        measure(policy, 2, w, 700.0 if w else 800.0)
    switch = next(i for i in range(len(picks)) if picks[i: i + 6] == [0] * 6)
    refreshes = sum(1 for i in range(1, switch) if picks[i] == 0 and picks[i - 1] > 0)
    assert picks[0] == 4 and refreshes >= 1, picks  # speculation (measured faster) outlives the first refresh...
    assert switch < 5 * 8, picks  # ...but not a few: plain decoding measured as recently takes over
    assert picks[40:].count(0) > 0.9 * 160, picks  # ...then plain decoding, speculation tried now and then


def test_stale_rates_are_not_compared() -> None:
    """A width not measured for 4 x explore_every passes is stale: dropped, the model (scaled by the last
    measured ratio) prices it again until MIN_PASSES fresh passes measured it."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=2)
    measure(policy, 2, 4, 10.0, passes=MIN_PASSES + 1)  # (the first after a switch is not measured)
    assert policy.realized(2, 4) == pytest.approx(10.0)
    measure(policy, 2, 0, 5.0, passes=8)
    assert policy.realized(2, 4) == pytest.approx(10.0)  # 8 passes old: still compared
    measure(policy, 2, 0, 5.0)
    assert policy.realized(2, 4) is None and policy.realized(2, 0) == pytest.approx(5.0)
    measure(policy, 2, 4, 40.0)  # after a switch: not measured
    for _ in range(MIN_PASSES - 1):
        measure(policy, 2, 4, 40.0)
        assert policy.realized(2, 4) is None  # one or two fresh passes do not revive the stale sums
    measure(policy, 2, 4, 40.0)
    assert policy.realized(2, 4) == pytest.approx(40.0)  # the fresh passes alone


def test_one_unlucky_pass_after_another_batch_size_does_not_stop_speculation() -> None:
    """Speculation wins at batch 1 (4 tokens a pass where plain decoding makes 1, passes of equal time), then a
    long stretch runs at batch 16 (another concurrency level). Back at batch 1 the first measured speculating pass
    is unlucky (0.5 tokens/s). It must not decide alone (a revived stale rate once sent concurrency 1 to plain
    decoding for 55-77 passes): the model, corrected by the earlier measured ratio, keeps speculating until
    MIN_PASSES fresh passes measure it."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=8, explore_cost=10.0)
    for _ in range(20):
        policy.record_accept(chain(4), 4)
    policy.record_draft(0.0, batch=1)
    policy.record_draft(0.0, batch=16)
    for _ in range(40):
        w = policy.choose(1)
        measure(policy, 1, w, 4.0 if w else 1.0)
    for _ in range(100):
        w = policy.choose(16)
        measure(policy, 16, w, 8.0 if w else 16.0)
    picks = []
    for _ in range(40):
        w = policy.choose(1)
        picks.append(w)
        unlucky = w > 0 and picks.count(w) == 2  # the first speculating pass after the catch-up one
        measure(policy, 1, w, 0.5 if unlucky else (4.0 if w else 1.0))
    assert picks.count(0) <= 12, picks  # refreshes (two plain steps in 10) and re-measuring plain decoding


def test_steps_where_a_drafter_catches_up_are_not_measured() -> None:
    """A request joining a speculating batch: its drafter absorbs its prompt on its first propose (EAGLE-3,
    draft models). The engine flags such steps; their host time and rate are a one-off, not the width's."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False)
    policy.record_draft(0.01, 4, batch=2)
    measure(policy, 2, 4, 10.0, passes=MIN_PASSES + 1)
    policy.record_draft(5.0, 4, batch=2, catch_up=True)
    policy.record_pass(2, 4, seconds=50.0, catch_up=True)
    assert policy.draft_seconds(4, 2) == 0.01 and policy.realized(2, 4) == pytest.approx(10.0)


def test_one_held_up_pass_counts_as_a_few_average_ones() -> None:
    """Plain passes of 1 s, then one held up for 20 s by something else: it counts as 1.5 s (`PASS_OUTLIER` x the
    mean), so plain decoding's measured rate does not fall below speculation's for one hiccup."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False)
    for _ in range(MIN_PASSES):
        policy.record_pass(2, 0, seconds=1.0)
    policy.record_pass(2, 0, seconds=20.0)
    d = PASS_DECAY
    old = sum(d**i for i in range(1, MIN_PASSES + 1))  # seconds per request: 0.5 each, the last at most 0.75
    assert policy.realized(2, 0) == pytest.approx((old + 1) / (0.5 * old + PASS_OUTLIER * 0.5))


def test_host_cost_of_a_first_slow_pass_does_not_stick() -> None:
    """The first passes of a new shape can pay one-time costs (kernel compilation): the estimate is the
    fastest of the first MIN_PASSES passes, then an average where one pass counts at most OUTLIER times it."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False)
    policy.record_draft(0.020, batch=4)  # a first pass that compiled kernels
    policy.record_draft(0.006, batch=4)
    assert policy.draft_seconds(4, batch=4) == 0.006
    for _ in range(MIN_PASSES):
        policy.record_draft(0.006, batch=4)
    policy.record_draft(1.0, batch=4)  # held up by something else
    assert policy.draft_seconds(4, batch=4) == pytest.approx(0.9 * 0.006 + 0.1 * OUTLIER * 0.006)


def test_a_bucket_measured_once_is_bounded_by_a_smaller_well_measured_one() -> None:
    """Drafting is batched, so its cost per request does not grow with the batch: until a bucket has
    MIN_PASSES passes, a larger estimate than a well-measured smaller bucket's is not believed."""
    policy = AdaptivePolicy(flat(), max_width=4, stepwise=False)
    for _ in range(MIN_PASSES):
        policy.record_draft(0.007, batch=1)
        policy.record_draft(0.006, batch=2)
    policy.record_draft(0.030, batch=4)  # one pass, slow
    policy.record_draft(0.001, batch=16)  # one pass, fast: kept
    assert policy.draft_seconds(4, batch=3) == 0.006
    assert policy.draft_seconds(4, batch=16) == 0.001
    assert policy.draft_seconds(2, batch=4) == 0.006  # a width not measured: the full width's
    for _ in range(MIN_PASSES - 1):
        policy.record_draft(0.030, batch=4)
    assert policy.draft_seconds(4, batch=4) == 0.030  # measured often enough: believed


def test_robust_update_keeps_the_fastest_first_samples_then_caps_outliers() -> None:
    est = None
    for sample in (0.030, 0.010, 0.012):  # catch-up steps: the first compiled kernels
        est = robust_update(est, sample, 0.5)
    assert est == (0.010, MIN_PASSES)
    assert robust_update(est, 0.5, 0.5) == (pytest.approx(0.5 * 0.010 + 0.5 * OUTLIER * 0.010), MIN_PASSES + 1)
    assert robust_update(est, 0.004, 0.5) == (pytest.approx(0.007), MIN_PASSES + 1)
    assert robust_update((0.0, MIN_PASSES), 0.02, 0.5) == (pytest.approx(0.01), MIN_PASSES + 1)  # not stuck at 0


def test_acceptance_is_kept_per_request_class() -> None:
    """Acceptance runs in streaks (a request's first rounds under n-gram lookup accept nothing, its loops accept
    everything): it is kept per class of the request's last round (`streak_class`), and a step's expected
    tokens are those of its batch's classes. Looping requests take the full width, fresh ones decode plainly,
    a batch of both weighs them."""
    assert [streak_class(n) for n in (None, 0, 1, 2, 3, 7)] == [0, 1, 2, 2, 3, 3]
    policy = AdaptivePolicy(steep(), max_width=4, stepwise=False, prior_rounds=0)
    for _ in range(20):
        policy.record_accept(chain(0), 4, cls=1)
        policy.record_accept(chain(4), 4, cls=3)
    policy.record_draft(0.0)
    assert policy.expected_tokens(4, cls=1) == 1.0 and policy.expected_tokens(4, cls=3) == pytest.approx(5.0)
    assert policy.choose(1, [3]) == 4  # 5 tokens / 3 s beat 1 / 1 s
    assert policy.expected_tokens(4) == pytest.approx(5.0)  # the batch's mix: one looping request
    for _ in range(3):
        assert policy.choose(1, [1]) == 0  # nothing accepted after a round that accepted nothing
    assert policy.choose(2, [1, 3]) == 4 and policy.expected_tokens(4) == pytest.approx(3.0)  # (1 + 5) / 2
    assert policy.choose(1) == 0  # no classes given: all new (class 0, never measured: the prior was 0 rounds)


def test_a_switch_needs_a_clear_gain_at_small_batches() -> None:
    """The pass after a switch of width runs cold, so a step leaves the settled width only for a gain above
    SWITCH_MARGIN / batch: speculating at batch 1, plain decoding 5% faster is not switched to, 25% is."""
    for host, want in ((2 / 0.95 - 1.01, 4), (2 / 0.8 - 1.01, 0)):  # speculation at 0.95 and 0.8 tokens/s
        policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, prior_rounds=0)
        policy.record_draft(host)
        for _ in range(20):
            policy.record_accept(chain(4), 4)
        assert policy.choose(1) == 4  # 5 tokens / (1.01 + host) s beat 1 / 1 s
        for _ in range(400):
            policy.record_accept(chain(1), 4)  # acceptance falls: E = 2
        assert policy.rate(1, 4) == pytest.approx(0.95 if want else 0.8, rel=0.01)
        assert policy.rate(1, 0) == pytest.approx(1.0)
        assert policy.choose(1) == want, host


def test_a_batch_size_never_measured_borrows_the_nearest_ones_model_correction() -> None:
    """Speculation measured at batch 2 at a quarter of the model's rate: the model's bias there (0.25) also
    corrects its rates at batch 8 (never measured), which then decodes plainly instead of trusting the
    optimistic model; a policy without measurements trusts the model."""
    def policy_measured_at_2(measured: bool) -> AdaptivePolicy:
        policy = AdaptivePolicy(flat(), max_width=4, stepwise=False, explore_every=8, prior_rounds=0)
        for _ in range(20):
            policy.record_accept(chain(2), 4)  # E[tokens | 4] = 3: the model prices width 4 at ~3x plain
        policy.record_draft(0.0, batch=2)
        policy.record_draft(0.0, batch=8)
        if measured:
            measure(policy, 2, 4, policy.rate(2, 4) / 4, passes=MIN_PASSES + 1)
            assert policy.scores(2)[4] == pytest.approx(policy.rate(2, 4) / 4)
        return policy
    assert policy_measured_at_2(False).scores(8)[4] == pytest.approx(policy_measured_at_2(False).rate(8, 4))
    policy = policy_measured_at_2(True)
    assert policy.scores(8)[4] == pytest.approx(policy.rate(8, 4) * 0.25)
    assert policy.choose(8) == 0
