"""Compiled decode steps at a server's start: built on a thread of their own while the engine serves eager
(`engine/warmup.py`), the same tokens before and after; the flags the server takes."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_util import running_server, start_server
from specserve.config import SpeculativeConfig
from specserve.engine.compiled import Bucket, CompiledSteps
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.types import SamplingParams

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:\n", "x = [1, 2, 3]\n", "for i in range(10):"]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.server
def test_sigterm_while_compiling_under_traffic_exits_zero(tiny_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while the decode steps compile on their own thread, requests in flight and streams dropped: the
    server drains and exits 0 (a systemd unit records anything else as a failure)."""
    args = ["--model", str(tiny_dir), "--dtype", "float32", "--no-enforce-eager", "--speculative-algorithm", "NGRAM"]
    srv = start_server(args, tmp_path / "s.log")
    try:
        def ask(i: int) -> None:
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 32, "ignore_eos": True, "stream": i % 2 == 0}
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", srv.url + "/v1/completions", json=body,
                                                                    timeout=30) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if body["stream"] and n == 2:
                        break  # the client leaves mid-stream
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert httpx.get(srv.url + "/server_info").json()["compiling"]
        assert srv.stop(signal.SIGTERM, timeout=60) == 0, srv.log_tail()
        for t in threads:
            t.join(timeout=30)
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.server
def test_server_compiles_its_buckets_while_serving_and_takes_the_flags(tiny_dir: Path, tmp_path: Path) -> None:
    body = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
    want = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True).generate(
        [body["prompt"]], SamplingParams(max_new_tokens=12))[0].text
    base = ["--model", str(tiny_dir), "--dtype", "float32", "--served-model-name", "m"]
    with running_server([*base, "--no-enforce-eager", "--cuda-graph-max-bs", "1"], tmp_path / "c.log") as srv:
        # the default: listening at once, answering eager while the steps compile on their own thread
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
        deadline = time.monotonic() + 300
        while (info := httpx.get(srv.url + "/server_info").json())["compiling"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert info["compiled_steps"] and info["compiled_buckets"] == ["1x1"]  # no batch graph at --cuda-graph-max-bs 1
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
    with running_server([*base, "--disable-cuda-graph"], tmp_path / "e.log") as srv:
        info = httpx.get(srv.url + "/server_info").json()
        assert not info["compiled_steps"] and info["compiled_buckets"] == []


def test_a_background_warm_up_serves_eager_until_compiled_then_measures_the_profile(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve`'s default start (`engine/warmup.py`): while the steps compile on their own thread, passes run eager
    (the engine's thread never compiles one itself) and decode plainly, the missing adaptive profile held on KV
    blocks of its own; once compiled, the profile is measured on the compiled steps, the blocks go back and the
    engine speculates, the tokens those of plain decoding throughout."""
    release = threading.Event()
    real = CompiledSteps._compile

    def held(self: CompiledSteps, bucket: Bucket, capture: tuple[int, ...]):  # type: ignore[no-untyped-def]
        assert release.wait(300)
        return real(self, bucket, capture)

    monkeypatch.setattr(CompiledSteps, "_compile", held)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True,
              speculative=SpeculativeConfig.resolve("NGRAM", num_draft_tokens=3, tree="chain"))
    want = [o.token_ids for o in llm.generate_plain(PROMPTS, PARAMS)]
    cfg = EngineConfig(num_kv_blocks=128, max_num_seqs=2, cuda_graph_max_bs=1, enforce_eager=False)
    engine = llm.make_engine(cfg, adaptive=True, profile_path=tmp_path / "profile.json", warm_compiled=True,
                             background=True)
    assert engine.warmup is not None and engine.warmup.running and engine.profile_due is not None
    assert engine.describe()["compiling"] and not engine.profile_measurable
    held_blocks = len(engine.profile_due.blocks)
    assert engine.pool.num_free == engine.pool.num_blocks - held_blocks

    def decode(prompts: list[str]) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), llm.encode(p), PARAMS)
        got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished:
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
        return [got[str(i)] for i in range(len(prompts))]

    assert decode(PROMPTS[:2]) == want[:2]
    assert engine.compiled is not None and engine.compiled.hits == 0 and engine.counters.verify_rounds == 0
    release.set()
    assert engine.warmup.join(300) and engine.profile_measurable
    assert engine.compiled.buckets == ["1x1", "1xN"]
    engine.measure_due_profile()
    assert engine.policy is not None and engine.profile_due is None and (tmp_path / "profile.json").exists()
    assert engine.compiled.hits > 0  # the profile timed the compiled steps
    assert decode(PROMPTS) == want
    assert not engine.describe()["compiling"]
