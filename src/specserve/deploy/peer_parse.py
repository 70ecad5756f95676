"""Parse launch commands with an engine's own argument parser: run as a script, standard library only, with the
engine's extracted wheel and its few dependencies on PYTHONPATH (`peers.py` sets that up).

    python peer_parse.py sglang|vllm < commands.json   # [[arg, ...], ...] without the launcher words
    -> one JSON line per command: {"ok": true} or {"ok": false, "error": "..."}

Heavy imports the parsers' modules make at import time are stubbed (PEER_STUBS, comma-separated top-level
names): a stub module hands out stub attributes; calling one with a function returns the function (decorators
such as `triton.jit`), with other arguments another stub (`triton.autotune(...)`), with none raises (a runtime
query such as `triton.runtime.driver.active.get_current_target()`: no GPU here). Nothing is launched: the
parser's `parse_args` is the whole check (argparse exits on an unknown flag or a bad choice; that is caught).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import sys
import types
from typing import Any

#: stubbed packages whose objects are built at import time (a call with no arguments gives another stub); the
#: others raise there, so that device probes (SGLang's) fall back to the CPU
LENIENT = ("xgrammar",)


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name, cls.__dict__.get("_lenient", False))

    def __call__(cls, *a: Any, **k: Any) -> Any:
        if not cls.__dict__.get("_stub"):  # a class deriving from a stub
            return super().__call__(*a, **k)
        if not a and not k:
            if cls.__dict__.get("_lenient"):
                return _stub(cls.__name__, True)
            raise RuntimeError("stub: no such runtime")
        if len(a) == 1 and callable(a[0]) and not k:  # a decorator
            return a[0]
        return _stub(cls.__name__, cls.__dict__.get("_lenient", False))

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __iter__(cls) -> Any:
        return iter(())

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


def _stub(name: str, lenient: bool = False) -> Any:
    return _Meta(name, (), {"_stub": True, "_lenient": lenient})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name, self.__name__.split(".")[0] in LENIENT)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__dict__["__version__"] = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def build_parser(engine: str) -> argparse.ArgumentParser:
    if engine == "sglang":
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        return parser
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def check(parser: argparse.ArgumentParser, args: list[str]) -> dict[str, Any]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return {"ok": False, "error": lines[-1] if lines else "the parser exited"}
    except (argparse.ArgumentError, ValueError, TypeError) as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True}


def main() -> int:
    engine = sys.argv[1]
    stubs = tuple(n for n in os.environ.get("PEER_STUBS", "").split(",") if n)
    sys.meta_path.insert(0, _StubFinder(stubs))
    commands = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):  # import-time prints stay off the result stream
        parser = build_parser(engine)
    for args in commands:
        print(json.dumps(check(parser, list(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
