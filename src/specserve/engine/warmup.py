"""A server's compiled steps built on a thread of their own while the engine already serves, eager.

Compiling the three decode graphs takes minutes on a small CPU (docs/real-target.md), longer than a start may.
`BackgroundWarmup` compiles what `BatchEngine.warm_compiled` would, in order, on its own thread; until a shape has
compiled, passes of that shape run eager (its `CompiledFns` are not lazy meanwhile, so the engine's thread never
compiles one a second time). The adaptive cost profile has to time the compiled steps, so where none is saved it
is measured once they are ready, on the engine's thread between steps (`BatchEngine.measure_due_profile`), on
KV blocks held for it from the start; requests decode plainly until then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

from specserve.layers.compiled_fn import CompiledFns

log = logging.getLogger("specserve.engine")

Warm = tuple[str, Callable[[], None]]  # (shape name, compile it now)


def run_warmups(warmups: list[Warm], desc: str, progress: bool) -> None:
    """Compile each shape in turn under a progress bar naming it."""
    bar = tqdm(warmups, desc=desc, unit="shape", disable=not progress)
    for name, warm in bar:
        bar.set_postfix_str(name)
        warm()


class BackgroundWarmup:
    """Runs `warmups` on a daemon thread; `done` is set when all have run (or one raised: logged, eager)."""

    def __init__(self, fns: list[CompiledFns], warmups: list[Warm], progress: bool = True) -> None:
        self._fns = fns
        self._warmups = warmups
        self._progress = progress
        self.done = threading.Event()
        for f in fns:
            f.lazy = False
        self._thread = threading.Thread(target=self._run, name="specserve-compile", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up; whether it is done."""
        return self.done.wait(timeout)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            run_warmups(self._warmups, "compiling decode steps (serving eager meanwhile)", self._progress)
        except Exception:  # the shapes not compiled run eager; serving goes on
            log.exception("compiling the decode steps in the background failed; they run eager")
        finally:
            for f in self._fns:
                f.lazy = True
            log.info("compiled decode steps ready after %.1f s", time.perf_counter() - t0)
            self.done.set()
