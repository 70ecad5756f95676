"""Functions compiled once per key (a shape bucket, a chain length), eager where compiling fails.

Shared by the engine's decode steps (`engine/compiled.py`) and EAGLE-3's chain rounds
(`speculative/eagle3/compiled.py`). The first call of a key compiles: whatever inductor raises there (no C++
compiler, an unsupported op) is logged and the key's calls run eager from then on; a failure after a key has run
once is a real error and is raised. While a background warm-up compiles the keys a server meets, `lazy` is off:
other calls of a key not compiled yet return None (eager) rather than compile it a second time on their thread.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

log = logging.getLogger("specserve.engine")

Compiled = Callable[..., Any]
K = TypeVar("K", bound=Hashable)


def compile_named(fn: Callable[..., Any], name: str, freeze: bool = True) -> Compiled:
    """`torch.compile` of `fn` under a code object of its own named `name`: dynamo keeps (and checks the guards of)
    compiled entries per code object, and keys automatic-dynamic state by name, so two closures of one function
    (two engines, two buckets) must not share them. Static but for the dims marked dynamic. `freeze`: weights
    folded into the graph as constants (inductor's freezing, which lets oneDNN pre-pack dense weights); it also
    keeps AOT autograd's cache from holding the graph, so a second start traces and lowers it again. Quantized
    models, whose products are the kernel's own op, gain nothing from it and start far faster without it
    (docs/real-target.md)."""
    code = fn.__code__.replace(co_name=name)
    fresh = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    return torch.compile(fresh, fullgraph=True, dynamic=False, options={"freezing": freeze})


class CompiledFns(Generic[K]):
    """Compiled functions by key, built on first use; `ran` the keys that ran compiled, `failed` those eager."""

    def __init__(self) -> None:
        self._fns: dict[K, Compiled] = {}
        self.ran: set[K] = set()
        self.failed: set[K] = set()
        self.lazy = True  # whether any call may compile its key (off during a background warm-up)

    def call(self, key: K, build: Callable[[], Compiled], what: str, *args: Any, warming: bool = False) -> Any | None:
        """The compiled function of `key` (built by `build` the first time) on `args`; None where its first call
        failed to compile (`what` names it in the warning) or an earlier one did, or where it has not run and
        only a warm-up (`warming`) may compile it now: the caller runs eager."""
        if key in self.failed or not (self.lazy or warming or key in self.ran):
            return None
        fn = self._fns.get(key) or self._fns.setdefault(key, build())
        try:
            out = fn(*args)
        except Exception as e:  # the first call compiles: whatever inductor raises there leaves the key eager
            if key in self.ran:
                raise
            log.warning("compiling %s failed; it runs eager (%s: %s)", what, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            self.failed.add(key)
            return None
        self.ran.add(key)
        return out
