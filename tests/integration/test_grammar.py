"""Constrained decoding, lossless under speculation: greedy constrained output equals an independent constrained
plain decoder token for token for every drafter and tree mode; sampling under a mask follows the masked target
distribution through the speculative path (chi-square); forced tokens drafted; bad grammars refused."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from reference_decoding import counts_p_value
from server_util import ServerProcess, running_server
from specserve.config import SpeculativeConfig
from specserve.engine.engine_config import EngineConfig
from specserve.engine.grammar import greedy_picks, mask_logits, prune_tree
from specserve.engine.llm import LLM
from specserve.speculative.dflash.checkpoint import init_random_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.speculative.trees.tree import DraftTree
from specserve.types import Grammar, SamplingParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
                "required": ["zip"], "additionalProperties": False},
}, "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
GRAMMARS = [
    Grammar("json_schema", json.dumps(PERSON), compact=True),
    Grammar("json_schema", json.dumps(PERSON)),
    Grammar("regex", r"(def|class) [a-z_]{1,8}\((x|y)?\):"),
    Grammar("lark", 'start: "x = " NUM ("," NUM){0,3}\nNUM: /[0-9]{1,3}/'),
]
PROMPTS = ["def add(a, b):", "import os\n", "class Foo:\n", "x = [1, 2, 3]\n", "# a person\n", "{"]


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory, llm: LLM, tiny_draft_dir: Path) -> list[SpeculativeConfig]:
    d = tmp_path_factory.mktemp("drafters")
    init_random_eagle3(llm.config, d / "eagle3", seed=4)
    init_random_dflash(llm.config, d / "dflash", seed=3, block_size=8)
    r = SpeculativeConfig.resolve
    e, f = str(d / "eagle3"), str(d / "dflash")
    return [
        r("NGRAM"), r("NGRAM", num_draft_tokens=5, tree="chain"), r("SUFFIX"),
        r("STANDALONE", str(tiny_draft_dir), num_steps=3),
        r("EAGLE3", e, num_steps=3), r("EAGLE3", e, num_steps=2, eagle_topk=3, num_draft_tokens=7),
        r("DFLASH", f, dflash_block_size=8, tree="chain", num_draft_tokens=8),
        r("DFLASH", f, dflash_block_size=8, tree="ddtree", num_draft_tokens=10),
    ]


@torch.inference_mode()
def reference(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Constrained greedy decoding written apart from the engine: a full forward per token, the grammar's mask,
    the argmax; the output ends at EOS or where the grammar is complete, which the budget brings about in time."""
    assert params.grammar is not None
    state = llm.grammars.state(params.grammar, llm.device, params.max_new_tokens)
    out: list[int] = []
    while len(out) < params.max_new_tokens and not state.stopped:
        ids = torch.tensor([prompt + out])
        logits = llm.model(ids, torch.arange(ids.shape[1])[None], last_only=True).logits[0, -1]
        token = int(mask_logits(logits, state.allowed()).argmax())
        out.append(token)
        state.consume([token])
        if token in llm.eos_ids:
            break
    return out


def test_greedy_constrained_speculation_equals_constrained_plain(llm: LLM, drafters: list[SpeculativeConfig]) -> None:
    prompts = [llm.encode(p) for p in PROMPTS]
    for grammar in GRAMMARS:  # the schema's budget leaves room for a few free tokens beyond its closing path
        params = SamplingParams(max_new_tokens=llm.grammars.compile(grammar) + 16 if grammar.kind == "json_schema"
                                else 40, grammar=grammar)
        want = [reference(llm, p, params) for p in prompts]
        assert [r.token_ids for r in llm.generate_plain(prompts, params)] == want, grammar
        for spec in drafters:
            builder = DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)
            got = llm.generate_with(builder, prompts, params)
            assert [r.token_ids for r in got] == want, (grammar.kind, spec)
        if grammar.kind == "json_schema":  # closed within the budget: every output whole and valid
            for tokens in want:
                jsonschema.validate(json.loads(llm.tokenizer.decode(tokens)), PERSON)


def test_pruned_trees_and_path_picks_match_a_node_by_node_walk(llm: LLM) -> None:
    """`prune_tree` keeps a node iff the grammar takes every token from the root to it (checked here one token at
    a time from a fresh state); `greedy_picks` gives the masked argmax at every node of the path its picks accept,
    and leaves the state where it was."""
    grammar = Grammar("regex", r"(ab|ac|b)[a-c]{0,3}")
    ids = {ch: llm.encode(ch)[0] for ch in "abcd"}
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(2, 12, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        tokens = [ids["a"]] + [ids["abcd"[int(torch.randint(0, 4, (1,), generator=gen))]] for _ in range(n - 1)]
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), None)
        state = llm.grammars.state(grammar, llm.device)

        def legal(i: int, tokens: list[int], parents: list[int]) -> bool:
            path = []
            while i > 0:
                path.append(tokens[i])
                i = parents[i]
            fresh = llm.grammars.state(grammar, llm.device)
            for t in reversed(path):
                if not fresh.allows(t):
                    return False
                fresh.consume([t])
            return True

        pruned = prune_tree(state, tree)
        kept = [i for i in range(n) if i == 0 or legal(i, tokens, parents)]
        assert pruned.tokens.tolist() == [tokens[i] for i in kept], trial
        logits = torch.randn(pruned.num_nodes + 1, llm.config.vocab_size, generator=gen)
        for k in (ids["a"], ids["b"], ids["c"]):  # make the drafted letters likely picks
            logits[:, k] += 6 * torch.rand(pruned.num_nodes + 1, generator=gen)
        picks = greedy_picks(state, pruned, logits)
        p_tokens, p_parents = pruned.tokens.tolist(), pruned.parents.tolist()
        node, walker = 0, llm.grammars.state(grammar, llm.device)
        while True:
            assert picks[node] == int(mask_logits(logits[node], walker.allowed()).argmax()), trial
            nxt = [c for c in range(1, len(p_tokens)) if p_parents[c] == node and p_tokens[c] == picks[node]]
            if not nxt:
                break
            node = nxt[0]
            walker.consume([p_tokens[node]])
        assert state.valid_prefix([ids["a"], ids["b"]]) == 2  # the state is back at the start


def test_forced_tokens_are_drafted_and_change_nothing(tiny_dir: Path, llm: LLM) -> None:
    """Compact strict JSON forces every key and separator: those become the draft where the drafter's is shorter;
    the output is the same with and without them."""
    grammar = Grammar("json_schema", json.dumps(PERSON), compact=True)
    params = SamplingParams(max_new_tokens=100, grammar=grammar)
    prompts = [llm.encode(p) for p in PROMPTS]
    want = [reference(llm, p, params) for p in prompts]
    outs = {}
    for forced in (True, False):
        spec = LLM(tiny_dir, device="cpu", dtype="float32", speculative=SpeculativeConfig.resolve("NGRAM"),
                   engine_config=EngineConfig(num_kv_blocks=256, grammar_forced_drafts=forced))
        res = spec.generate(prompts, params)
        assert [r.token_ids for r in res] == want
        outs[forced] = (spec._engines["spec"].counters, sum(len(r.accept_lengths) for r in res))
    (with_forced, rounds_with), (without, rounds_without) = outs[True], outs[False]
    assert with_forced.forced_drafts > 0 and without.forced_drafts == 0
    assert rounds_with < rounds_without  # forced keys accepted in runs: fewer verify rounds for the same tokens
    assert with_forced.grammar_masks > 0


@pytest.mark.parametrize("which", ["ngram", "eagle3-tree", "dflash-ddtree"])
def test_sampling_under_a_mask_follows_the_masked_distribution(llm: LLM, drafters: list[SpeculativeConfig],
                                                               which: str) -> None:
    """Chi-square: whole constrained outputs (a few tokens, a small language) sampled speculatively vs plainly."""
    spec = {"ngram": drafters[0], "eagle3-tree": drafters[5], "dflash-ddtree": drafters[7]}[which]
    grammar = Grammar("regex", r"(ab|ba|a|b)(ab|ba|a|b)")
    n = 600
    prompt = llm.encode("a = 1\nb = 2\na = 1\nb")

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=6, temperature=1.3, seed=seed, grammar=grammar)

    builder = DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)
    sp = Counter(r.text for r in llm.generate_with(builder, [prompt] * n, [params(s) for s in range(n)]))
    pl = Counter(r.text for r in llm.generate_plain([prompt] * n, [params(10_000 + s) for s in range(n)]))
    assert all(k.replace("a", "").replace("b", "") == "" for k in sp)  # every output in the language
    assert counts_p_value(sp, pl, n) > 0.001, (which, sp, pl)


def test_bad_grammars_are_refused_before_decoding(llm: LLM) -> None:
    bad = [Grammar("json_schema", "{not json"), Grammar("json_schema", "[1, 2]"), Grammar("regex", "(unclosed"),
           Grammar("lark", "start: undefined_rule")]
    for grammar in bad:
        with pytest.raises(ValueError, match=r"grammar|schema|JSON"):
            llm.generate(["x"], SamplingParams(max_new_tokens=4, grammar=grammar))
    with pytest.raises(ValueError, match="grammar kind"):
        Grammar("xml", "<a/>")
    [ok] = llm.generate(["x"], SamplingParams(max_new_tokens=8, grammar=Grammar("regex", "[0-9]{3}")))
    assert len(ok.text) == 3 and ok.text.isdigit() and ok.finish_reason == "stop"


def test_a_grammar_that_cannot_fit_in_max_tokens_is_refused(llm: LLM) -> None:
    literal = "def main(argv): return sorted(argv)"
    need = llm.grammars.compile(Grammar("regex", re.escape(literal)))  # all of it is forced
    assert need == len(llm.tokenizer.encode(literal))
    assert 1 <= llm.grammars.compile(Grammar("regex", "[0-9]{3}")) <= 3  # a short output: three digits at most
    with pytest.raises(ValueError, match="max_new_tokens"):
        llm.generate(["x"], SamplingParams(max_new_tokens=need - 1, grammar=Grammar("regex", re.escape(literal))))
    [ok] = llm.generate(["x"], SamplingParams(max_new_tokens=need, grammar=Grammar("regex", re.escape(literal))))
    assert ok.text == literal and ok.finish_reason == "stop"


# ------------------------------------------------------------------------- through the real server


@pytest.fixture(scope="module")
def grammar_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("grammar-serve")
    args = ["--model", str(tiny_dir), "--device", "cpu", "--served-model-name", "tiny", "--tool-call-parser",
            "hermes", "--speculative-algorithm", "NGRAM", "--no-speculative-adaptive"]
    with running_server(args, d / "log") as srv:
        yield srv


@pytest.mark.server
@pytest.mark.parametrize("spec", ["none", "eagle3-tree", "dflash-ddtree"])
def test_json_schema_outputs_through_every_drafter_server(tiny_dir: Path, llm: LLM, spec: str,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """Speculation off and the tree drafters through the real server: valid outputs, equal to constrained plain."""
    d = tmp_path_factory.mktemp("grammar-" + spec)
    args = ["--model", str(tiny_dir), "--device", "cpu", "--served-model-name", "tiny", "--no-speculative-adaptive"]
    if spec == "eagle3-tree":
        init_random_eagle3(llm.config, d / "draft", seed=4)
        args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(d / "draft"),
                 "--speculative-num-steps", "2", "--speculative-eagle-topk", "3", "--speculative-num-draft-tokens", "7"]
    elif spec == "dflash-ddtree":
        init_random_dflash(llm.config, d / "draft", seed=3, block_size=8)
        args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(d / "draft"),
                 "--speculative-dflash-block-size", "8", "--speculative-tree", "ddtree",
                 "--speculative-num-draft-tokens", "10"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    grammar = Grammar("json_schema", json.dumps(PERSON), compact=True)
    with running_server(args, d / "log") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        for prompt in PROMPTS[:3]:
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=120, temperature=0,
                                            extra_body={"response_format": fmt})
            [want] = llm.generate_plain([prompt], SamplingParams(max_new_tokens=120, grammar=grammar))
            assert out.choices[0].text == want.text, (spec, prompt)
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].text), PERSON)


# small: the tiny model's context (512 tokens) holds the tools' JSON in the system prompt
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.mark.server
def test_response_formats_through_the_openai_client(grammar_server: ServerProcess, llm: LLM) -> None:
    client = openai.OpenAI(base_url=grammar_server.url + "/v1", api_key="none")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    msgs = [{"role": "user", "content": "A person, please."}]
    out = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=200, temperature=0, n=2,
                                         response_format=fmt)  # type: ignore[arg-type]
    texts = [c.message.content or "" for c in out.choices]
    assert texts[0] == texts[1]  # greedy, n = 2
    jsonschema.validate(json.loads(texts[0]), PERSON)
    # the same as the offline engine under the same grammar (the server speculates, offline is plain)
    prompt = llm.tokenizer.apply_chat_template(msgs)
    grammar = Grammar("json_schema", json.dumps(PERSON), compact=True)
    [want] = llm.generate_plain([prompt], SamplingParams(max_new_tokens=200, grammar=grammar))
    assert texts[0] == want.text
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=200, temperature=0, response_format=fmt, stream=True)  # type: ignore[arg-type]
        if chunk.choices)
    assert streamed == texts[0]
    for seed in range(6):  # sampled and short: closed before max_tokens runs out, every time
        obj = client.completions.create(model="tiny", prompt="x", max_tokens=24, temperature=1.0, seed=seed,
                                        extra_body={"response_format": {"type": "json_object"}})
        assert isinstance(json.loads(obj.choices[0].text), dict) and obj.choices[0].finish_reason == "stop"
    rx = client.completions.create(model="tiny", prompt="n =", max_tokens=10, extra_body={"regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", rx.choices[0].text)
    pick = client.completions.create(model="tiny", prompt="ok?", max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert pick.choices[0].text in ("yes", "no")
    meta = pick.choices[0].model_extra["meta_info"]  # per request: masks, their time, forced drafts
    assert meta["grammar_masks"] >= 1 and meta["grammar_mask_ms"] >= 0 and meta["grammar_forced_draft_tokens"] >= 0
    metrics = httpx.get(grammar_server.url + "/metrics").text
    for name in ("grammar_compiled_total", "grammar_masks_total", "grammar_mask_seconds_total",
                 "grammar_forced_draft_tokens_total"):
        value = float(re.search(rf"^specserve_{name} (\S+)$", metrics, re.M)[1])  # type: ignore[index]
        assert value > 0 or name == "grammar_forced_draft_tokens_total", name


@pytest.mark.server
def test_forced_tool_calls_parse_and_name_the_function(grammar_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=grammar_server.url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Paris?"}]
    named = client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, max_tokens=60, temperature=0,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "time"}})
    [call] = named.choices[0].message.tool_calls or []
    assert call.function.name == "time" and named.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    required = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=60,
                                              temperature=0.7, seed=1, tool_choice="required")  # type: ignore[arg-type]
    calls = required.choices[0].message.tool_calls or []
    assert calls and all(c.function.name in ("weather", "time") for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER if c.function.name == "weather"
                            else TOOLS[1]["function"]["parameters"])  # type: ignore[index]


@pytest.mark.server
@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"regex": "(unclosed"}, "response_format"),
    ({"regex": "[a-z]+", "response_format": {"type": "json_object"}}, "regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    # what the call forces (its marker, name and keys) cannot fit in max_tokens = 8
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "time"}}}, "max_tokens"),
])
def test_bad_constraints_are_400s_naming_the_field(grammar_server: ServerProcess, body: dict[str, Any],
                                                   param: str) -> None:
    r = httpx.post(grammar_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in (param, "body") or param in r.json()["error"]["message"], r.json()
    ok = httpx.post(grammar_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200  # still serving
