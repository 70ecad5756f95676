"""The server loads its model off the main thread (see `server/threads.py` for why)."""

from __future__ import annotations

import threading

import pytest

from specserve.server.threads import run_in_passing_thread


def test_runs_in_another_thread_that_ends_and_returns_its_result() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert run_in_passing_thread(work) == 42
    assert seen[0] is not threading.main_thread() and seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_its_exception_reaches_the_caller() -> None:
    def fail() -> None:
        raise ValueError("--speculative-num-steps must be >= 1")

    with pytest.raises(ValueError, match="num-steps"):
        run_in_passing_thread(fail)
