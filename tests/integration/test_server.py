"""The OpenAI-compatible server, as a real subprocess spoken to over HTTP (httpx and the `openai` client).

Three server starts: `server` (plain, configured through a YAML file plus an overriding flag),
`spec_server` (NGRAM speculation) and `guarded` (API key, a queue of 2, SIGTERM at the end).
The first tests need no server: the tool-call parsers, the detokenizer and the config merging.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_util import ServerProcess, free_port, running_server
from specserve.engine.llm import LLM
from specserve.server.cli import add_serve_parser
from specserve.server.completions import stream_chat
from specserve.server.detokenizer import IncrementalDetokenizer
from specserve.server.engine_api import EngineOutput, RequestGroup
from specserve.server.schemas import StreamOptions
from specserve.server.serve_config import serve_config_from_args
from specserve.server.tool_parsers import HermesParser, KimiK2Parser, Parsed, SmolLM2Parser, ToolParser
from specserve.server.tool_prompt import calls_text, renders_tools, with_tools
from specserve.speculative.dflash.checkpoint import init_random_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams

KEY = "sekret"
PROMPTS = ["def fizzbuzz(n):", "import os\n", "class Stack:", "for i in range("]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]

# ------------------------------------------------------------------------------------- no server needed


def feed_in_pieces(parser: ToolParser, text: str, size: int) -> Parsed:
    parts = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    return Parsed("".join(p.content for p in parts), tuple(c for p in parts for c in p.tool_calls))


def calls(p: Parsed) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in p.tool_calls]


def test_hermes_parser_whole_and_streamed() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')
    whole = HermesParser().parse(text)
    assert whole.content == "Let me check.\n"
    assert calls(whole) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in whole.tool_calls}) == 2 and all(c.id.startswith("call_") for c in whole.tool_calls)
    for size in (1, 3, 7):
        streamed = feed_in_pieces(HermesParser(), text, size)
        assert (streamed.content, calls(streamed)) == (whole.content, calls(whole))
    # not a call: malformed JSON, a marker prefix that never completes, plain text around a call
    bad = 'a <tool_call>{"name": oops}</tool_call> b <tool'
    assert HermesParser().parse(bad) == Parsed(bad)
    assert feed_in_pieces(HermesParser(), bad, 2) == Parsed(bad)
    cut = HermesParser().parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')  # ended before </tool_call>
    assert calls(cut) == [("f", {"x": 1})] and cut.content == ""


def test_smollm2_parser_reads_a_list_of_calls_and_the_prompt_writes_them_back() -> None:
    text = ('<tool_call>[{"name": "read_file", "arguments": {"path": "a.py"}}, '
            '{"name": "run_tests", "arguments": {}}]</tool_call>')
    whole = SmolLM2Parser().parse(text)
    assert whole.content == "" and calls(whole) == [("read_file", {"path": "a.py"}), ("run_tests", {})]
    for size in (1, 4, 9):
        streamed = feed_in_pieces(SmolLM2Parser(), text, size)
        assert (streamed.content, calls(streamed)) == (whole.content, calls(whole))
    assert calls(SmolLM2Parser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')) == [("f", {})]
    for bad in ('<tool_call>[{"name": "f"}, 3]</tool_call>', "<tool_call>[]</tool_call>"):
        assert SmolLM2Parser().parse(bad) == Parsed(bad)
    assert HermesParser().parse(text) == Parsed(text)  # Hermes reads one call per region, not a list
    # the template has no tools: they go into the system message, earlier calls back into the text, verbatim
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
    msgs = with_tools([{"role": "user", "content": "open a.py"},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "content": "print(1)", "tool_call_id": "c1"}], tools, SmolLM2Parser)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert '<tools>[{"name": "read_file"' in msgs[0]["content"] and "tool_calls" not in msgs[2]
    assert calls(SmolLM2Parser().parse(msgs[2]["content"])) == [("read_file", {"path": "a.py"})]
    assert msgs[2]["content"] == calls_text([{"name": "read_file", "arguments": {"path": "a.py"}}], SmolLM2Parser)
    own = with_tools([{"role": "system", "content": "Be brief."}], tools, SmolLM2Parser)
    assert len(own) == 1 and own[0]["content"].startswith("Be brief.\n\n")
    assert renders_tools("{% if tools %}{{ tools }}{% endif %}") and not renders_tools("{{ messages }}")


def test_kimi_k2_parser() -> None:
    text = ("Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.search.web:1'
            '<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>')
    whole = KimiK2Parser().parse(text)
    assert whole.content == "Sure."
    assert calls(whole) == [("get_weather", {"city": "Paris"}), ("search.web", {"q": "x"})]
    assert [c.id for c in whole.tool_calls] == ["functions.get_weather:0", "functions.search.web:1"]
    for size in (1, 5):
        streamed = feed_in_pieces(KimiK2Parser(), text, size)
        assert (streamed.content, calls(streamed), [c.id for c in streamed.tool_calls]) == (
            whole.content, calls(whole), [c.id for c in whole.tool_calls])
    bad = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{x<|tool_call_end|>"
    assert KimiK2Parser().parse(bad) == Parsed(bad)


def test_streamed_tool_call_chunks_are_valid_openai_chunks() -> None:
    from openai.types.chat import ChatCompletionChunk

    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]

    async def run() -> list[str]:
        group = RequestGroup(["r0"], lambda _rid: None)
        for k, p in enumerate(pieces):
            last = k == len(pieces) - 1
            group.put(EngineOutput(0, p, 3, k + 1, last, "stop" if last else None))
        return [e async for e in stream_chat(group, "id", 0, "m", 1, 3, StreamOptions(include_usage=True),
                                             HermesParser)]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate_json(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi "
    tool_calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.type, t.function.name) for t in tool_calls] == [(0, "function", "get_weather")]
    assert tool_calls[0].id and json.loads(tool_calls[0].function.arguments or "") == {"city": "Paris"}
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(pieces)


def test_detokenizer_holds_back_stop_strings_and_partial_utf8(tiny_dir: Path) -> None:
    tok = Tokenizer(tiny_dir)
    eos = tok.eos_token_id
    assert eos is not None
    text = "naïve 日本 code() STOP after"
    ids = [*tok.encode(text), eos]
    for stops, expected in (((), text), (("STOP",), "naïve 日本 code() "), (("e() S", "zz"), "naïve 日本 cod")):
        d = IncrementalDetokenizer(tok, True, {eos}, stops)
        deltas = [d.push([t]) for t in ids]
        assert not any("\ufffd" in x for x in deltas)
        assert "".join(deltas) + d.finish() == expected
        assert all(expected.startswith("".join(deltas[: i + 1])) for i in range(len(deltas)))


def test_serve_config_file_and_flag_precedence(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text("port: 31000\nmax_queue: 7\ntool-call-parser: kimi_k2\nspeculative_algorithm: ngram\n")
    cfg = serve_config_from_args(parser.parse_args(["serve", "--config", str(cfg_file), "--port", "30000"]))
    assert (cfg.port, cfg.max_queue, cfg.tool_call_parser) == (30000, 7, "kimi_k2")  # the flag wins, even = default
    assert cfg.speculative.algorithm == "NGRAM" and cfg.host == "127.0.0.1"
    for body, needle in (("max-queue: 3\nmax_qeue: 4\n", "max_qeue"), ("max-queue: many\n", "max-queue"),
                         ("tool-call-parser: nope\n", "tool-call-parser"), ("- port\n", "mapping"),
                         ("max-queue: 0\n", "--max-queue")):
        cfg_file.write_text(body)
        with pytest.raises(ValueError, match=needle):
            serve_config_from_args(parser.parse_args(["serve", "--config", str(cfg_file)]))


# ------------------------------------------------------------------------------------------- the servers


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("serve")
    (d / "serve.yaml").write_text(f"model: {tiny_dir}\nserved-model-name: from-file\nmax_queue: 32\n"
                                  "tool_call_parser: hermes\ndevice: cpu\n")
    with running_server(["--config", str(d / "serve.yaml"), "--served-model-name", "tiny"], d / "log") as srv:
        yield srv


def fixed_speculation(tiny_dir: Path, *flags: str) -> list[str]:
    """Serve flags for the tiny model with speculation at a fixed width (every step verifies)."""
    return ["--model", str(tiny_dir), "--device", "cpu", "--served-model-name", "tiny", *flags,
            "--no-speculative-adaptive"]


@pytest.fixture(scope="module")
def spec_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("spec")
    with running_server(fixed_speculation(tiny_dir, "--speculative-algorithm", "NGRAM"), d / "log") as srv:
        yield srv


@pytest.fixture(scope="module")
def chain_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> Iterator[ServerProcess]:
    """EAGLE-3 chain speculation with a random drafter (accepts little; exactness is the point)."""
    d = tmp_path_factory.mktemp("chain")
    init_random_eagle3(llm.config, d / "eagle3", seed=4)
    args = fixed_speculation(tiny_dir, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                             str(d / "eagle3"), "--speculative-num-steps", "3")
    with running_server(args, d / "log") as srv:
        yield srv


@pytest.fixture(scope="module")
def ddtree_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> Iterator[ServerProcess]:
    """DFlash block drafts verified as a DDTree, random drafter."""
    d = tmp_path_factory.mktemp("ddtree")
    init_random_dflash(llm.config, d / "dflash", seed=3, block_size=8)
    args = fixed_speculation(tiny_dir, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                             str(d / "dflash"), "--speculative-tree", "ddtree", "--speculative-num-draft-tokens", "8")
    with running_server(args, d / "log") as srv:
        yield srv


@pytest.fixture(scope="module")
def guarded(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("guarded")
    args = ["--model", str(tiny_dir), "--device", "cpu", "--served-model-name", "tiny", "--api-key", KEY,
            "--max-queue", "2", "--max-num-seqs", "1", "--shutdown-timeout", "10"]
    with running_server(args, d / "log") as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, device="cpu")


def offline(llm: LLM, prompt: str, **kw: Any) -> tuple[str, int, str]:
    [res] = llm.generate([prompt], SamplingParams(**kw))
    return res.text, res.num_tokens, res.finish_reason


def sse(lines: Iterator[str]) -> list[Any]:
    """The data payloads of an event stream; the last one must be [DONE]."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def metrics(url: str) -> dict[str, float]:
    """Parse the exposition strictly: every sample line well-formed and of a declared family."""
    text = httpx.get(url + "/metrics").text
    declared = set(re.findall(r"^# TYPE (\S+) (?:counter|gauge|summary)$", text, re.M))
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-z_]+)((?:\{[a-z_]+="[^"]*"(?:,[a-z_]+="[^"]*")*\})?) (\S+)', line)
        assert m, line
        assert m[1] in declared or re.sub(r"_(sum|count)$", "", m[1]) in declared, line
        out[m[1] + m[2]] = float(m[3])
    return out


async def complete_many(url: str, prompts: list[str], **body: Any) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": p, **body}) for p in prompts))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json() for r in rs]


# 16 different prompts, sent at once: the engine decodes them in one batch
PROMPTS16 = [p + tail for p in PROMPTS for tail in ("", " x", "\n    ", "  # note\n")]


@pytest.mark.parametrize("which", ["server", "spec_server", "chain_server", "ddtree_server"])
def test_greedy_matches_offline_concurrently(which: str, request: pytest.FixtureRequest, llm: LLM) -> None:
    """Concurrency 16, greedy: every response equals offline plain decoding (default, batched mode)."""
    srv: ServerProcess = request.getfixturevalue(which)
    outs = asyncio.run(complete_many(srv.url, PROMPTS16, max_tokens=40, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS16, outs, strict=True):
        text, n, reason = offline(llm, prompt, max_new_tokens=40, ignore_eos=True)
        assert (out["choices"][0]["text"], out["usage"]["completion_tokens"]) == (text, n), prompt
        assert out["choices"][0]["finish_reason"] == reason == "length"
    m = metrics(srv.url)
    assert m["specserve_num_running_reqs"] == 0
    assert m["specserve_kv_blocks_free"] + m["specserve_kv_blocks_cached"] == m["specserve_kv_blocks_total"]
    if which != "server":
        info = httpx.get(srv.url + "/server_info").json()
        assert info["avg_spec_accept_length"] >= 1.0
        # every token after a request's first comes out of a verify step
        assert m["specserve_spec_accept_length_sum"] >= 16 * 39 and m["specserve_generation_tokens_total"] >= 16 * 40
        steps = m["specserve_spec_accept_length_count"]
        assert info["avg_spec_accept_length"] == pytest.approx(m["specserve_spec_accept_length_sum"] / steps)
        assert m['specserve_spec_position_accept_rate{position="1"}'] <= 1.0


def test_per_request_speculative_figures_in_meta_info(spec_server: ServerProcess, tiny_dir: Path) -> None:
    """Each finished choice carries `meta_info` with SGLang's names, as the offline engine counts them, summing to
    what `/metrics` counted over the same requests; the streamed last chunk carries it too."""
    from specserve.config import SpeculativeConfig

    offline_spec = LLM(tiny_dir, device="cpu", speculative=SpeculativeConfig.resolve("NGRAM"))
    prompts = ["a = 1\nb = 2\n" * 3, PROMPTS[0]]
    before = metrics(spec_server.url)
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none")
    metas = []
    for prompt in prompts:  # one at a time: each request's rounds are its own
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
        meta = out.choices[0].model_extra["meta_info"]
        [want] = offline_spec.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert meta["completion_tokens"] == 24 and meta["spec_verify_ct"] == want.num_verify_steps
        assert meta["spec_accept_length"] == pytest.approx(want.accept_length, abs=1e-4)
        assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
        assert meta["spec_accept_token_num"] == sum(i * n for i, n in enumerate(meta["spec_accept_histogram"]))
        assert 0 <= meta["spec_accept_rate"] <= 1 and meta["spec_draft_token_num"] >= meta["spec_accept_token_num"]
        metas.append(meta)
    after = metrics(spec_server.url)
    steps = after["specserve_spec_accept_length_count"] - before["specserve_spec_accept_length_count"]
    total = after["specserve_spec_accept_length_sum"] - before["specserve_spec_accept_length_sum"]
    assert steps == sum(m["spec_verify_ct"] for m in metas)
    assert total == sum(m["spec_accept_token_num"] + m["spec_verify_ct"] for m in metas)
    with httpx.stream("POST", spec_server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 12, "stream": True}) as r:
        chunks = sse(r.iter_lines())
    last = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(last) == 1 and last[0]["choices"][0]["meta_info"]["completion_tokens"] <= 12
    assert all("meta_info" not in c["choices"][0] for c in chunks if c["choices"] and c not in last)


def test_stream_equals_non_stream_with_stop_string(server: ServerProcess, llm: LLM) -> None:
    full, _, _ = offline(llm, PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    stop = full[12:15]
    assert stop and stop in full
    text, n, reason = offline(llm, PROMPTS[0], max_new_tokens=40, ignore_eos=True, stop=(stop,))
    assert text == full[: full.find(stop)] and reason == "stop"
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": stop}
    plain = httpx.post(server.url + "/v1/completions", json=body).json()
    assert plain["choices"][0]["text"] == text and plain["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == n


def test_openai_client_completion_chat_stream_and_sampling(server: ServerProcess, llm: LLM) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Write a sort function."}]
    expected, _, _ = offline(llm, llm.tokenizer.apply_chat_template(messages), max_new_tokens=24)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # sampling parameters reach the sampler: seeded sampling equals offline sampling with the same seed
    kw = dict(temperature=0.8, top_p=0.9, seed=7)
    comp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, n=2,
                                     extra_body={"top_k": 20, "min_p": 0.05, "ignore_eos": True}, **kw)
    want, _, _ = offline(llm, PROMPTS[1], max_new_tokens=16, ignore_eos=True, top_k=20, min_p=0.05, **kw)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == want
    assert comp.usage is not None and comp.usage.completion_tokens == 32


def test_chat_with_tools_renders_them_and_answers_in_shape(server: ServerProcess, llm: LLM) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    for stream in (False, True):
        kw: dict[str, Any] = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            resp = client.chat.completions.create(**kw)
            usage, finish = resp.usage, [resp.choices[0].finish_reason]
            msg = resp.choices[0].message
            assert msg.content is not None or msg.tool_calls
        assert finish and finish[0] in ("stop", "length", "tool_calls")
        rendered = llm.tokenizer.apply_chat_template(messages, tools=TOOLS)
        assert "get_weather" in rendered and usage is not None
        assert usage.prompt_tokens == len(llm.tokenizer.encode(rendered))  # the tools are in the prompt
    # a reply that called a tool goes back into the template as a mapping
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=4).choices


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: ServerProcess) -> None:
    url = server.url
    chat = url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, Any, int, str | None]] = [
        (chat, b'{"messages": [', 400, None),
        (chat, {"messages": msgs, "max_tokens": "5"}, 400, "max_tokens"),
        (chat, {"messages": "hi"}, 400, "messages"),
        (chat, {"messages": msgs, "max_tokens": 0}, 400, "max_tokens"),
        (url + "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        (url + "/v1/completions", {"prompt": "x " * 700}, 400, "prompt"),
        (url + "/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        (url + "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
        (url + "/v1/completions", {"prompt": "x", "logprobs": 1}, 400, "logprobs"),
        (url + "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        (url + "/v1/nothing", {}, 404, None),
    ]
    for target, body, status, param in cases:
        r = httpx.post(target, **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3).choices[0].finish_reason
    m = metrics(url)
    assert m['specserve_http_errors_total{status="400"}'] >= 9 and m['specserve_http_errors_total{status="404"}'] >= 2


def test_disconnect_aborts_requests_and_frees_the_worker(server: ServerProcess) -> None:
    url = server.url

    def finished() -> tuple[float, float]:
        m = metrics(url)
        key = 'specserve_requests_finished_total{{finish_reason="{}"}}'
        return m.get(key.format("abort"), 0.0), m.get(key.format("length"), 0.0)

    aborts0, lengths0 = finished()
    long = {"prompt": PROMPTS[2], "max_tokens": 480, "ignore_eos": True, "temperature": 0, "n": 4}
    with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}) as r:  # 4 x 480 tokens
        next(line for line in r.iter_lines() if line.startswith("data: "))
    with pytest.raises(httpx.TimeoutException):  # a non-streaming client that gives up
        httpx.post(url + "/v1/completions", json=long, timeout=0.3)
    # FIFO: once this one is done, the 8 choices before it have finished or been aborted
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code == 200
    aborts, lengths = finished()
    # the stream's 4 choices, and at least one of the plain request's (4 x 480 tokens take far more than 0.3 s)
    assert aborts - aborts0 >= 5 and (aborts - aborts0) + (lengths - lengths0) == 8 + 1
    m = metrics(url)
    assert m["specserve_num_queue_reqs"] == 0 and m["specserve_num_running_reqs"] == 0


def test_api_key_required(guarded: ServerProcess) -> None:
    url = guarded.url
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_full_queue_answers_503_with_retry_after(guarded: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"prompt": PROMPTS[3], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded.url, headers=auth, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**long, "n": 2}) as a:  # one runs, one waits
            a_lines = a.iter_lines()  # (dropping a half-read iterator would close the connection)
            next(line for line in a_lines if line.startswith("data: "))
            with c.stream("POST", "/v1/completions", json=long) as b:  # the queue is full (2)
                assert b.status_code == 200
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                assert metrics(guarded.url)["specserve_num_queue_reqs"] == 2
        # the streams' clients left: their requests are aborted as the server notices, and the queue frees up
        deadline = time.monotonic() + 10
        while (code := c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code) == 503:
            assert time.monotonic() < deadline, "the queue did not free up after the clients disconnected"
            time.sleep(0.1)
        assert code == 200


def test_sigterm_finishes_in_flight_and_exits_zero(guarded: ServerProcess) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", guarded.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        guarded.proc.send_signal(15)
        rest = list(lines)  # the stream still ends properly: finished within --shutdown-timeout
    assert "data: [DONE]" in rest
    assert guarded.proc.wait(timeout=30) == 0, guarded.log_tail()
    with pytest.raises(httpx.ConnectError):
        httpx.get(guarded.url + "/health")


def test_start_up_says_ready_and_fails_early_with_clear_exit_codes(server: ServerProcess, tiny_dir: Path,
                                                                   tmp_path: Path) -> None:
    """A running server logged its `ready` line; a second one on its port fails before loading (exit 1), one with
    a model that is not there fails with one `error:` line (exit 2); neither leaves a traceback."""
    assert "specserve serve: ready on http://127.0.0.1:" in server.log_tail(100_000)
    port = server.url.rsplit(":", 1)[1]
    base = [sys.executable, "-m", "specserve.server.cli", "--host", "127.0.0.1", "--device", "cpu"]
    taken = subprocess.run([*base, "--model", str(tiny_dir), "--port", port], capture_output=True, text=True,
                           timeout=120)
    assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr
    assert "--port" in taken.stderr and "Traceback" not in taken.stderr and "loading" not in taken.stderr
    missing = subprocess.run([*base, "--model", str(tmp_path / "nowhere"), "--port", str(free_port())],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "error:" in missing.stderr and "Traceback" not in missing.stderr
