"""Adaptive speculation: per step, as many drafts as pay at the current batch size (or none).

`policy.py` makes the choice from `acceptance.py` (the acceptance model), `costs.py` (the cost profile and host
time), `pass_rates.py` (measured passes) and `explore.py` (tries and refreshes); `measure.py` measures the
profile on an engine. Design and measurements: docs/adaptive.md."""

from specserve.engine.adaptive.acceptance import NUM_CLASSES, streak_class
from specserve.engine.adaptive.costs import MIN_PASSES, OUTLIER, CostProfile, monotone
from specserve.engine.adaptive.measure import engine_profile, measure_profile, profile_grid, profile_key
from specserve.engine.adaptive.pass_rates import PASS_DECAY, PASS_OUTLIER
from specserve.engine.adaptive.policy import AdaptivePolicy

__all__ = [
    "MIN_PASSES", "NUM_CLASSES", "OUTLIER", "PASS_DECAY", "PASS_OUTLIER", "AdaptivePolicy", "CostProfile",
    "engine_profile", "measure_profile", "monotone", "profile_grid", "profile_key", "streak_class",
]
