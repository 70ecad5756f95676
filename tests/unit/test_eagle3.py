"""EAGLE-3 drafter: checkpoint layout and round trip, KV bookkeeping against from-scratch recomputation."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import specserve.speculative.eagle3.drafter as eagle3_mod
from reference_decoding import generate_plain, generate_speculative
from specserve.config import SpeculativeConfig
from specserve.kv.contiguous import ContiguousKVCache
from specserve.layers.sampling import target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.eagle3.checkpoint import check_eagle3, init_random_eagle3, load_eagle3, save_eagle3
from specserve.speculative.eagle3.drafter import Eagle3Drafter
from specserve.speculative.eagle3.model import Eagle3Config, Eagle3Model, default_aux_layer_ids
from specserve.speculative.trees.tree import DraftTree
from specserve.types import SamplingParams

from tiny import TINY_VOCAB

CPU = torch.device("cpu")
AUX = (1, 2, 3)  # the tiny target has 3 layers: HF hidden_states indices 0..3
V = TINY_VOCAB
DRAFT_IDS = sorted(random.Random(7).sample(range(V), 40))  # a scattered draft vocabulary


@pytest.fixture(scope="module", params=["shared-embedding", "own-embedding"])
def draft_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, target: CausalLM) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "shared-embedding":
        init_random_eagle3(target.config, path, seed=1, intermediate_size=80, draft_token_ids=DRAFT_IDS,
                           aux_layer_ids=AUX)
    else:
        init_random_eagle3(target.config, path, seed=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                           num_key_value_heads=2, draft_token_ids=DRAFT_IDS, aux_layer_ids=AUX, own_embedding=True)
    return path


@pytest.fixture(scope="module")
def draft(draft_dir: Path, target: CausalLM) -> Eagle3Model:
    return load_eagle3(draft_dir, target.config, CPU, torch.float32)


def embed(model: Eagle3Model, target: CausalLM, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    return model.embed_tokens(ids) if model.embed_tokens is not None else target.embed(ids)  # [1, n, H]


@torch.no_grad()
def reference_log_probs(model: Eagle3Model, target: CausalLM, hidden: torch.Tensor, pair_tokens: list[int],
                        path: list[int]) -> torch.Tensor:
    """No cache: committed pairs (fc(hidden[j]), pair_tokens[j]), then the drafted `path`, each entry fed the
    previous entry's output; the whole sequence is recomputed for every entry. -> log-probs [V] after path."""
    feats = model.project(hidden)  # [P, H]
    tokens = list(pair_tokens)
    for step in range(len(path) + 1):
        n = len(tokens)
        out = model(embed(model, target, tokens), feats[None], torch.arange(n)[None])[0]  # [n, H]
        if step == len(path):
            break
        feats = torch.cat((feats, out[-1:]))
        tokens.append(path[step])
    lp = torch.log_softmax(model.draft_logits(out[-1]), dim=-1)
    return model.to_target_vocab(lp, float("-inf"))


def assert_log_probs_close(a: torch.Tensor, b: torch.Tensor) -> None:
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    torch.testing.assert_close(a[fin], b[fin], atol=2e-5, rtol=1e-5)


def make_drafter(model: Eagle3Model, target: CausalLM, steps: int, topk: int = 1, nodes: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> Eagle3Drafter:
    spec = SpeculativeConfig.resolve("EAGLE3", "unused", num_steps=steps, eagle_topk=topk, num_draft_tokens=nodes)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    return Eagle3Drafter(model, target, spec, params, torch.Generator().manual_seed(seed), max_len=96)


class History:
    """What the target holds: every committed token with its captured states; random stand-ins for the latter."""

    def __init__(self, prompt_len: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens = [self.rng.randrange(V) for _ in range(prompt_len)]
        self.hidden = self.states(prompt_len)

    def states(self, n: int) -> torch.Tensor:
        return torch.randn(n, 3 * 64, generator=self.gen)  # [n, 3·Ht]

    def pairs(self, root: int) -> list[int]:
        return [*self.tokens[1:], root]

    def commit(self, drafter: Eagle3Drafter, tokens: list[int]) -> int:
        hidden = self.states(len(tokens))
        next_root = self.rng.randrange(V)
        drafter.accept(tokens, hidden, next_root)
        self.tokens += tokens
        self.hidden = torch.cat((self.hidden, hidden))
        return next_root


def test_checkpoint_layout_matches_sglang_vllm(draft_dir: Path, target: CausalLM) -> None:
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["num_hidden_layers"] == 1
    assert (raw["vocab_size"], raw["draft_vocab_size"], raw["target_hidden_size"]) == (V, 40, 64)
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(AUX)  # vLLM: capture the input of layer i
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # SGLang: output of i
    h, inter = raw["hidden_size"], raw["intermediate_size"]
    q, kv = raw["num_attention_heads"] * raw["head_dim"], raw["num_key_value_heads"] * raw["head_dim"]
    expected = {
        "fc.weight": (h, 3 * 64),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (40, h),
        "d2t": (40,),
        "t2d": (V,),
    }
    if h != 64:
        expected["embed_tokens.weight"] = (V, h)
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected  # noqa: SIM118
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(40) + d2t).tolist() == DRAFT_IDS
    assert t2d.nonzero().flatten().tolist() == DRAFT_IDS


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    ang = pos[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)  # [n, D/2]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin


def test_forward_matches_the_definition(draft: Eagle3Model, target: CausalLM) -> None:
    """Written from the EAGLE-3 definition with raw tensor ops on the checkpoint's named weights."""
    w, c = draft.state_dict(), draft.config.layer
    g = torch.Generator().manual_seed(9)
    n, eps, nh, nkv, hd = 6, c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    hidden = torch.randn(n, 3 * 64, generator=g)  # [n, 3·Ht] captured target states
    tokens = torch.randint(0, V, (n,), generator=g)
    emb = w.get("embed_tokens.weight", target.model.embed_tokens.weight)[tokens]
    feat = hidden @ w["fc.weight"].T
    x = torch.cat((_rms(emb, w["midlayer.input_layernorm.weight"], eps),
                   _rms(feat, w["midlayer.hidden_norm.weight"], eps)), -1)  # [n, 2H]
    pos = torch.arange(n)
    q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1), pos, c.rope.theta)
    k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1), pos, c.rope.theta)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = (q @ k.transpose(1, 2)) / hd**0.5 + torch.full((n, n), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, nh * hd) @ w["midlayer.self_attn.o_proj.weight"].T
    h = feat + attn  # the residual is the un-normed feature
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
    out = h + mlp @ w["midlayer.mlp.down_proj.weight"].T
    logits = _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [n, Vd]
    ours = draft(embed(draft, target, tokens.tolist()), draft.project(hidden)[None], pos[None])[0]
    torch.testing.assert_close(ours, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(draft.draft_logits(ours), logits, atol=1e-5, rtol=1e-5)
    mapped = draft.to_target_vocab(logits, float("-inf"))  # [n, V]
    assert torch.equal(mapped[:, DRAFT_IDS], logits) and bool(mapped[:, ~draft.t2d].isinf().all())


def test_save_load_round_trip_is_identical(draft: Eagle3Model, target: CausalLM, tmp_path: Path) -> None:
    save_eagle3(draft, draft.config, tmp_path / "copy")
    again = load_eagle3(tmp_path / "copy", target.config, CPU, torch.float32)
    assert again.config == draft.config
    a, b = draft.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    g = torch.Generator().manual_seed(3)
    feats = draft.project(torch.randn(1, 5, 3 * 64, generator=g))
    emb = embed(draft, target, [3, 9, 27, 81, 4])
    pos = torch.arange(5)[None]
    assert torch.equal(draft.draft_logits(draft(emb, feats, pos)), again.draft_logits(again(emb, feats, pos)))


def test_cached_chunks_equal_full_recomputation(draft: Eagle3Model, target: CausalLM) -> None:
    g = torch.Generator().manual_seed(4)
    n = 9
    feats = torch.randn(1, n, draft.config.hidden_size, generator=g)
    emb = embed(draft, target, torch.randint(0, V, (n,), generator=g).tolist())
    full = draft(emb, feats, torch.arange(n)[None])  # [1, n, H], causal, no cache
    kv = ContiguousKVCache.allocate(draft.config.layer, 1, 16, CPU, torch.float32, num_layers=1)
    outs, start = [], 0
    for q in (4, 1, 3, 1):
        sl = slice(start, start + q)
        outs.append(draft(emb[:, sl], feats[:, sl], torch.arange(start, start + q)[None], kv.view(start, q)))
        start += q
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


def test_greedy_chain_rounds_match_recomputation(draft: Eagle3Model, target: CausalLM) -> None:
    steps = 4
    hist = History(prompt_len=6, seed=5)
    drafter = make_drafter(draft, target, steps)
    assert drafter.capture == AUX
    drafter.prefill(hist.tokens, hist.hidden)
    assert drafter.backlog == 6  # the prompt's pairs wait for the first propose
    root = 11
    for max_drafts in (None, 2, None, 1, steps + 3, 3):  # a cut chain drafts only that many steps
        tree = drafter.propose(root, max_drafts)
        assert drafter.backlog == 0
        n = steps if max_drafts is None else min(steps, max_drafts)
        assert tree.is_chain and tree.num_nodes == n and tree.draft_probs is None
        path: list[int] = []
        for _ in range(n):
            path.append(int(reference_log_probs(draft, target, hist.hidden, hist.pairs(root), path).argmax()))
        assert tree.tokens.tolist() == [root, *path]
        k = hist.rng.randint(0, n)  # accept a random prefix, the whole chain included
        root = hist.commit(drafter, tree.tokens[: k + 1].tolist())
        assert drafter.committed == len(hist.tokens) - k - 1  # the accepted pairs wait for the next propose
        assert drafter.backlog == k + 1


def test_sampled_chain_returns_its_draft_distributions(draft: Eagle3Model, target: CausalLM) -> None:
    steps = 3
    params = SamplingParams(temperature=0.8, top_p=0.9)
    hist = History(prompt_len=4, seed=6)
    drafter = make_drafter(draft, target, steps, temperature=0.8, top_p=0.9)
    drafter.prefill(hist.tokens, hist.hidden)
    root = 5
    for _ in range(3):
        tree = drafter.propose(root)
        probs = tree.draft_probs
        assert probs is not None and probs.shape == (steps + 1, V)
        assert torch.equal(probs[0], torch.zeros(V))
        toks = tree.tokens.tolist()
        for i in range(1, steps + 1):
            ref = target_probs(reference_log_probs(draft, target, hist.hidden, hist.pairs(root), toks[1:i]), params)
            torch.testing.assert_close(probs[i], ref, atol=1e-5, rtol=1e-5)
            assert probs[i][toks[i]] > 0 and toks[i] in DRAFT_IDS
            assert float(probs[i][~draft.t2d].sum()) == 0.0
        root = hist.commit(drafter, toks[: hist.rng.randint(1, steps + 1)])


def check_tree_shape(tree: DraftTree, nodes: int, steps: int) -> None:
    assert tree.num_nodes == nodes and tree.draft_probs is None
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and depths[0] == 0
    for i in range(1, nodes + 1):
        assert 0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1 <= steps
    assert all(t in DRAFT_IDS for t in tree.tokens[1:].tolist())


def test_tree_rounds_match_recomputation(draft: Eagle3Model, target: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    steps, topk, nodes = 3, 3, 9
    real = eagle3_mod.expand_eagle_tree
    calls: list[dict[str, Any]] = []

    def recording(root: int, first: torch.Tensor, step_fn: Any, num_steps: int, k: int, num_nodes: int) -> DraftTree:
        rec: dict[str, Any] = {"first": first.clone(), "fed": []}
        calls.append(rec)

        def wrapped(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            out = step_fn(tokens, parents)
            rec["fed"] += list(zip(tokens.tolist(), parents.tolist(), out.clone(), strict=True))
            return out

        return real(root, first, wrapped, num_steps, k, num_nodes)

    monkeypatch.setattr(eagle3_mod, "expand_eagle_tree", recording)
    hist = History(prompt_len=5, seed=8)
    drafter = make_drafter(draft, target, steps, topk=topk, nodes=nodes + 1)
    drafter.prefill(hist.tokens, hist.hidden)
    root = 17
    for _ in range(3):
        tree = drafter.propose(root)
        check_tree_shape(tree, nodes, steps)
        rec = calls[-1]
        assert len(rec["fed"]) == (steps - 1) * topk
        assert_log_probs_close(rec["first"], reference_log_probs(draft, target, hist.hidden, hist.pairs(root), []))
        fed_paths: list[list[int]] = [[]]  # fed node 0 is the root
        for tok, parent, row in rec["fed"]:
            fed_paths.append([*fed_paths[parent], tok])
            ref = reference_log_probs(draft, target, hist.hidden, hist.pairs(root), fed_paths[-1])
            assert_log_probs_close(row, ref)
        node, path = hist.rng.randrange(nodes + 1), []  # accept a random root-to-node path
        while node >= 0:
            path.append(node)
            node = int(tree.parents[node])
        root = hist.commit(drafter, tree.tokens[path[::-1]].tolist())


@pytest.mark.parametrize("steps, topk, nodes", [(3, 1, 4), (3, 2, 6)])
def test_greedy_decoding_through_the_loop_equals_plain(draft: Eagle3Model, target: CausalLM, steps: int, topk: int,
                                                       nodes: int) -> None:
    spec = SpeculativeConfig.resolve("EAGLE3", "unused", num_steps=steps, eagle_topk=topk, num_draft_tokens=nodes)
    params = SamplingParams(max_new_tokens=12)
    prompt = [5, 17, 42, 8, 99, 3]
    plain = generate_plain(target, [prompt], params, eos_ids=())[0].token_ids
    res = generate_speculative(target, lambda p, g, m: Eagle3Drafter(draft, target, spec, p, g, m), prompt, params,
                               (), nodes)
    assert res.token_ids == plain


def test_mismatches_name_the_flag_and_field(target: CausalLM, tmp_path: Path) -> None:
    cfg = target.config
    cases = {
        "target_hidden_size": lambda p: init_random_eagle3(replace(cfg, hidden_size=32), p, aux_layer_ids=AUX),
        "vocab_size": lambda p: init_random_eagle3(replace(cfg, vocab_size=50), p, aux_layer_ids=AUX),
        "eagle_aux_hidden_state_layer_ids": lambda p: init_random_eagle3(
            replace(cfg, num_hidden_layers=8), p, aux_layer_ids=(2, 4, 7)),
    }
    for field, make in cases.items():
        make(tmp_path / field)
        for check in (check_eagle3, lambda p, c: load_eagle3(p, c, CPU, torch.float32)):
            with pytest.raises(ValueError, match=rf"--speculative-draft-model-path.*{field}"):
                check(tmp_path / field, cfg)
    # a drafter narrower than the target needs its own embedding
    path = tmp_path / "narrow"
    init_random_eagle3(cfg, path, hidden_size=32, aux_layer_ids=AUX, own_embedding=True)
    tensors = load_file(path / "model.safetensors")
    del tensors["embed_tokens.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"--speculative-draft-model-path.*hidden_size 32.*embed_tokens"):
        load_eagle3(path, cfg, CPU, torch.float32)


def test_config_validation_and_default_layer_ids(draft_dir: Path) -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(6) == (1, 3, 5)  # the demo target: (2, 3, 3) would collide
    assert default_aux_layer_ids(3) == (0, 1, 2)
    with pytest.raises(ValueError, match="too shallow"):
        default_aux_layer_ids(2)
    raw = json.loads((draft_dir / "config.json").read_text())
    assert Eagle3Config.from_hf(raw, 3).aux_layer_ids == AUX
    del raw["eagle_aux_hidden_state_layer_ids"]  # an SGLang-only config: eagle_config ids name layer outputs
    assert Eagle3Config.from_hf(raw, 3).aux_layer_ids == AUX
    del raw["eagle_config"]
    assert Eagle3Config.from_hf(raw, 32).aux_layer_ids == (2, 16, 29)
    for rope in ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}):
        cfg = Eagle3Config.from_hf({**raw, "rope_scaling": rope, "norm_before_residual": True}, 3)
        assert Eagle3Config.from_hf(cfg.to_hf(), 3) == cfg and cfg.layer.rope.rope_type == rope["rope_type"]
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_hf({**raw, "eagle_aux_hidden_state_layer_ids": [2, 3, 3]}, 6)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_hf({**raw, "draft_vocab_size": V + 1}, 3)
    with pytest.raises(ValueError, match="architectures"):
        Eagle3Config.from_hf({**raw, "architectures": ["LlamaForCausalLM"]}, 3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_chains_equal_one_by_one(draft: Eagle3Model, target: CausalLM, temperature: float) -> None:
    """`propose_many` (one padded drafter forward per step for all requests) drafts what each request's own
    `propose` drafts: rows of different lengths (one pending past the batched-commit limit), cut widths, a
    row that skipped a round; and every drafter's state stays the same, round after round."""
    steps, lens = 4, [3, 20, 6, 9]
    hists = [History(prompt_len=n, seed=20 + i) for i, n in enumerate(lens)]
    batched = [make_drafter(draft, target, steps, temperature=temperature, seed=i) for i in range(len(lens))]
    alone = [make_drafter(draft, target, steps, temperature=temperature, seed=i) for i in range(len(lens))]
    for h, a, b in zip(hists, batched, alone, strict=True):
        a.prefill(h.tokens, h.hidden)
        b.prefill(h.tokens, h.hidden)
    roots = [h.rng.randrange(V) for h in hists]
    for max_drafts in ([None, None, None, None], [2, None, 1, 4], [None, 3, None, 2]):
        trees = Eagle3Drafter.propose_many(batched, roots, list(max_drafts))
        for i, (tree, b) in enumerate(zip(trees, alone, strict=True)):
            ref = b.propose(roots[i], max_drafts[i])
            assert tree.tokens.tolist() == ref.tokens.tolist(), (i, max_drafts)
            assert tree.parents.tolist() == ref.parents.tolist() and tree.depths.tolist() == ref.depths.tolist()
            assert (tree.draft_probs is None) == (ref.draft_probs is None) == (temperature == 0.0)
            if tree.draft_probs is not None and ref.draft_probs is not None:
                torch.testing.assert_close(tree.draft_probs, ref.draft_probs, atol=1e-5, rtol=1e-5)
            assert batched[i].committed == b.committed
        for i, (h, a, b, tree) in enumerate(zip(hists, batched, alone, trees, strict=True)):
            k = h.rng.randint(0, tree.num_nodes)
            accepted = tree.tokens[: k + 1].tolist()
            hidden, roots[i] = h.states(len(accepted)), h.rng.randrange(V)
            a.accept(accepted, hidden, roots[i])
            b.accept(accepted, hidden, roots[i])
        # row 0 skips a round: its pending pairs grow, and the next batched commit takes them all
        hidden = hists[0].states(1)
        for d in (batched[0], alone[0]):
            d.skip(roots[0])
            d.accept([roots[0]], hidden, roots[0])
