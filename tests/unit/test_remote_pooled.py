"""`bench/remote_acceptance.py`: the summary's accept length pools the tasks as the offline report does."""

from __future__ import annotations

from specserve.bench.by_kind import pooled_accept
from specserve.bench.remote_acceptance import Figures, _pooled


def figures(accept: float, steps: float | None) -> Figures:
    return Figures(new_tokens=0, accept_length=accept, verify_steps=steps, accepted_per_position=[], text="",
                   seconds=1.0, source="response:meta_info")


def test_pooled_is_the_rows_pooled_accept_length() -> None:
    figs = [figures(2.0, 10), figures(5.0, 30), figures(9.0, 0)]  # the last task was never verified
    assert _pooled(figs) == pooled_accept([{"accept_length": f.accept_length, "verify_steps": f.verify_steps}
                                           for f in figs]) == (20 + 150) / 40
    assert _pooled([figures(2.0, None), figures(4.0, None)]) == 3.0  # a gauge's means only: unweighted
