"""Keep the server's main thread free of PyTorch work.

PyTorch's CPU kernels run their parallel regions on an OpenMP team, and libgomp keeps one team per thread that
ever started a parallel region, for as long as that thread lives. The server's main thread runs the event loop
and the engine steps in a worker thread, so a model loaded on the main thread leaves a second, idle team beside
the worker's. With more OpenMP threads than cores, libgomp throttles its spin-wait and every parallel region
then pays a sleep and wake-up of its helpers: on the 2-core machine this project is measured on, a plain bf16
decode step of the demo model took 10.4 ms in the worker thread after loading on the main thread and 5.4 ms
after loading in a thread that had exited (fp32: 9.6-10.1 vs 8.1-8.7 ms). A thread's team goes when the thread
ends, so loading (and measuring the adaptive cost profile) in a short-lived thread leaves the engine's worker
the only team.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def run_in_passing_thread(fn: Callable[[], T], name: str = "specserve-load") -> T:
    """Run `fn` in a new thread that ends with it; return its result or raise its exception here."""
    with ThreadPoolExecutor(1, thread_name_prefix=name) as pool:  # its one thread exits at the `with`'s end
        return pool.submit(fn).result()
