"""DFlash drafter: public checkpoint layout, the architecture against a from-the-definition forward, cached
context == recomputed context, block attention (bidirectional, bounded), propose shapes, load-time checks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reference_decoding import generate_plain, generate_speculative
from specserve.config import ModelConfig, SpeculativeConfig
from specserve.layers.sampling import target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.dflash.checkpoint import check_dflash, init_random_dflash, load_dflash, save_dflash
from specserve.speculative.dflash.drafter import DFlashDrafter
from specserve.speculative.dflash.model import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from specserve.speculative.trees.ddtree import build_ddtree
from specserve.speculative.trees.tree import descendants
from specserve.types import SamplingParams

CPU = torch.device("cpu")
BS = 8  # drafter block size in these tests
LAYER_PARTS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, target: CausalLM) -> Path:
    """A random drafter whose every parameter (norms included) is perturbed, so layout mistakes show."""
    path = tmp_path_factory.mktemp("dflash")
    cfg = init_random_dflash(target.config, path, seed=1, num_hidden_layers=2, block_size=BS)
    model = load_dflash(path, target.config, CPU, torch.float32)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    save_dflash(model, cfg, path)
    return path


@pytest.fixture(scope="module")
def draft(draft_dir: Path, target: CausalLM) -> DFlashDraftModel:
    return load_dflash(draft_dir, target.config, CPU, torch.float32)


def spec(path: Path, tree: str = "chain", n: int = 5, bs: int | None = BS) -> SpeculativeConfig:
    return SpeculativeConfig.resolve("DFLASH", str(path), num_draft_tokens=n, dflash_block_size=bs, tree=tree)


def drafter(draft: DFlashDraftModel, target: CausalLM, path: Path, tree: str = "chain", n: int = 5,
            temperature: float = 0.0) -> DFlashDrafter:
    return DFlashDrafter(draft, target, spec(path, tree, n), SamplingParams(temperature=temperature), None, 64)


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # the published Qwen3-8B drafter's choice
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(3, 2) == (0, 2)  # too shallow for 1..L-3: spread over every layer
    with pytest.raises(ValueError, match="target_layer_ids"):
        default_target_layer_ids(2, 3)


def test_reads_the_published_config_layout() -> None:
    """The shape of z-lab's Qwen3-4B drafter config: block_size only at top level, tied-embedding flag, auto_map."""
    raw = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    }
    cfg = DFlashConfig.from_hf(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (16, 151669, 36)
    assert cfg.capture == (2, 10, 18, 26, 34) and cfg.body.rope.theta == 1e6
    assert cfg.body.qk_norm and not cfg.body.tie_word_embeddings
    del raw["dflash_config"]["target_layer_ids"]  # absent: the reference's default spread
    assert DFlashConfig.from_hf(raw).target_layer_ids == (1, 9, 17, 25, 33)
    yarn = {**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "torch_dtype": "float32"}
    cfg = DFlashConfig.from_hf(yarn)
    assert DFlashConfig.from_hf(cfg.to_hf()) == cfg


def test_checkpoint_layout_and_round_trip(draft_dir: Path, draft: DFlashDraftModel, target: CausalLM,
                                          tmp_path: Path) -> None:
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == BS
    assert raw["num_target_layers"] == 3 and raw["num_hidden_layers"] == 2
    mask = target.config.vocab_size - 1  # default mask token: the last id
    assert raw["dflash_config"] == {"block_size": BS, "mask_token_id": mask, "target_layer_ids": [0, 2]}
    assert draft.config.capture == (1, 3)  # HF hidden_states index = layer id + 1
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{part}" for i in range(2) for part in LAYER_PARTS}
    assert set(shapes) == expected
    assert shapes["fc.weight"] == [64, 2 * 64]
    assert shapes["layers.0.self_attn.q_proj.weight"] == [4 * 16, 64]
    assert shapes["layers.0.self_attn.k_proj.weight"] == [2 * 16, 64]
    assert shapes["layers.1.self_attn.k_norm.weight"] == [16]

    save_dflash(draft, draft.config, tmp_path / "again")
    again = load_dflash(tmp_path / "again", target.config, CPU, torch.float32)
    assert again.config == draft.config
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == raw
    for (name, a), (name_b, b) in zip(draft.state_dict().items(), again.state_dict().items(), strict=True):
        assert name == name_b and torch.equal(a, b), name

    # SGLang also accepts a `model.` prefix on every weight; so do we.
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_text(json.dumps(raw))
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        save_file({f"model.{k}": f.get_tensor(k) for k in f.keys()}, str(prefixed / "model.safetensors"))  # noqa: SIM118
    third = load_dflash(prefixed, target.config, CPU, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), third.state_dict().values(),
                                                 strict=True))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [S, heads, D] at positions pos [S]; HF rotate-half layout."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv  # [S, D/2]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sin


def _reference_block(w: dict[str, torch.Tensor], feats: torch.Tensor, noise: torch.Tensor, ctx_pos: torch.Tensor,
                     blk_pos: torch.Tensor, theta: float, heads: int, kv_heads: int) -> torch.Tensor:
    """The DFlash block forward written from its definition on the HF-named weights (float64, no batch)."""
    c = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])  # [T, H]
    x, q_len, d = noise, noise.shape[0], w["layers.0.self_attn.q_norm.weight"].shape[0]
    for i in range(sum(1 for k in w if k.endswith("input_layernorm.weight"))):
        p = {k.split(".", 2)[2]: t for k, t in w.items() if k.startswith(f"layers.{i}.")}
        h = _rms(x, p["input_layernorm.weight"])
        q = _rms((h @ p["self_attn.q_proj.weight"].T).view(q_len, heads, d), p["self_attn.q_norm.weight"])
        kin = torch.cat((c, h))  # context rows first, then the block
        k = _rms((kin @ p["self_attn.k_proj.weight"].T).view(-1, kv_heads, d), p["self_attn.k_norm.weight"])
        v = (kin @ p["self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        q, k = _rope(q, blk_pos, theta), _rope(k, torch.cat((ctx_pos, blk_pos)), theta)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * d**-0.5, -1)  # no mask at all
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(q_len, -1) @ p["self_attn.o_proj.weight"].T
        h = _rms(x, p["post_attention_layernorm.weight"])
        gate, up = h @ p["mlp.gate_proj.weight"].T, h @ p["mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ p["mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


def test_forward_matches_definition(draft_dir: Path, draft: DFlashDraftModel) -> None:
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        w = {k: f.get_tensor(k).double() for k in f.keys()}  # noqa: SIM118
    gen = torch.Generator().manual_seed(3)
    feats, noise = torch.randn(6, 128, generator=gen), torch.randn(BS, 64, generator=gen)
    ctx_pos, blk_pos = torch.arange(6), torch.arange(6, 6 + BS)
    ours = draft(noise[None], blk_pos[None], draft.context_kv(feats[None], ctx_pos[None]))[0]
    body = draft.config.body
    ref = _reference_block(w, feats.double(), noise.double(), ctx_pos, blk_pos, body.rope.theta,
                           body.num_attention_heads, body.num_key_value_heads)
    torch.testing.assert_close(ours.double(), ref, atol=1e-4, rtol=1e-4)


def test_cached_context_equals_recomputed(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path) -> None:
    d = drafter(draft, target, draft_dir)
    gen = torch.Generator().manual_seed(4)
    feats = torch.randn(5, 128, generator=gen)  # [T, n*H]
    d.prefill([3, 4, 5, 6, 7], feats)
    for _ in range(5):
        root = int(torch.randint(target.config.vocab_size, (1,), generator=gen))
        cached = d.block_log_probs(root)  # [bs-1, V]
        p = feats.shape[0]
        assert d.length == p
        assert not d.cache.k[0][:, :, p:].any(), "the block's own K/V must never enter the cache"
        ids = torch.tensor([[root] + [draft.config.mask_token_id] * (BS - 1)])
        context = draft.context_kv(feats[None], torch.arange(p)[None])  # from scratch
        hidden = draft(target.embed(ids), torch.arange(p, p + BS)[None], context)
        fresh = torch.log_softmax(target.logits(hidden[0, 1:]), -1)
        torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
        trained = draft.train_blocks(feats[None], target.embed(ids), torch.tensor([[p]]), target.logits)
        torch.testing.assert_close(cached, torch.log_softmax(trained[0, 1:], -1), atol=1e-5, rtol=1e-5)
        k = int(torch.randint(BS, (1,), generator=gen))  # accepted drafts this round
        new = torch.randn(k + 1, 128, generator=gen)
        d.accept([root, *range(k)], new, next_root=1)
        feats = torch.cat((feats, new))
    assert d.context_tokens == feats.shape[0]  # queued by accept, cached at the next propose


def test_block_attention_is_bidirectional_and_bounded(draft: DFlashDraftModel, target: CausalLM,
                                                      draft_dir: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    feats, noise = torch.randn(1, 12, 128, generator=gen), torch.randn(1, 2 * BS, 64, generator=gen)
    anchors = torch.tensor([[4, 9]])  # block 0 sees context 0..3, block 1 sees 0..8

    def run(f: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return draft.train_blocks(f, n, anchors, target.logits)[0]  # [2*BS, V]

    base = run(feats, noise)
    later = noise.clone()
    later[0, 6] += 1.0  # a later mask slot of block 0
    out = run(feats, later)
    assert not torch.allclose(out[2], base[2]), "an earlier position must see a later one (non-causal)"
    torch.testing.assert_close(out[BS:], base[BS:])  # block 1 does not see block 0
    ctx = feats.clone()
    ctx[0, 4:9] += 1.0  # context at/after block 0's anchor, before block 1's
    out = run(ctx, noise)
    torch.testing.assert_close(out[:BS], base[:BS])
    assert not torch.allclose(out[BS:], base[BS:])
    ctx = feats.clone()
    ctx[0, 9:] += 1.0  # at/after block 1's anchor
    torch.testing.assert_close(run(ctx, noise), base)

    d = drafter(draft, target, draft_dir)
    d.prefill([1, 2, 3], torch.randn(3, 128, generator=gen))
    assert d.backlog == 3 and d.length == 0  # the prompt is queued at prefill (a request may never speculate)
    before = d.block_log_probs(7)
    assert d.backlog == 0 and d.length == 3  # ... and enters the context cache at the first block
    for k in d.cache.k:
        k[:, :, 3:] = 5.0  # garbage past the committed context must not be read
    torch.testing.assert_close(d.block_log_probs(7), before)


def test_propose_chain_and_ddtree(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path) -> None:
    """Greedy requests: deterministic drafts (argmax chain, the best DDTree)."""
    hidden = torch.randn(4, 128, generator=torch.Generator().manual_seed(6))
    chain = drafter(draft, target, draft_dir, "chain", n=5)
    chain.prefill([5, 6, 7, 8], hidden)
    tree = chain.propose(11)
    best = chain.block_log_probs(11).argmax(-1)  # [bs-1]
    assert tree.is_chain and tree.num_nodes == 4 and tree.draft_probs is None
    assert tree.tokens.tolist() == [11, *best[:4].tolist()]

    dd = drafter(draft, target, draft_dir, "ddtree", n=40)
    dd.prefill([5, 6, 7, 8], hidden)
    tree = dd.propose(11)
    assert tree.num_nodes == 40 and tree.draft_probs is None and int(tree.tokens[0]) == 11
    assert int(tree.depths.max()) <= BS - 1
    assert all(0 <= p < i for i, p in enumerate(tree.parents.tolist()) if i > 0)
    assert int(tree.tokens[1]) == int(best[0]) and int(tree.depths[1]) == 1  # the most probable first node
    assert dd.length == 4  # proposing commits nothing
    small = dd.propose(11, max_drafts=6)  # a smaller budget: the best 6-node tree
    assert small.num_nodes == 6 and small.tokens.tolist() == build_ddtree(11, dd.block_log_probs(11), 6).tokens.tolist()
    # a tree of m nodes is at most m deep: only the first m block positions go through the LM head
    assert dd.rows_needed(3) == 3 and dd.rows_needed(None) == BS - 1 and chain.rows_needed(2) == 2
    assert dd.block_log_probs(11, rows=3).shape == (3, target.config.vocab_size)
    for m in (1, 2, 3, 5, BS + 4):
        full = build_ddtree(11, dd.block_log_probs(11), m)
        cut = dd.propose(11, max_drafts=m)
        assert cut.tokens.tolist() == full.tokens.tolist() and cut.parents.tolist() == full.parents.tolist(), m
    assert chain.propose(11, max_drafts=2).tokens.tolist() == [11, *best[:2].tolist()]


@pytest.mark.parametrize("tree,n", [("chain", 6), ("ddtree", 24)])
def test_random_drafter_decodes_exactly(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path,
                                        tree: str, n: int) -> None:
    """Through the real loop with the real target's captured states: output == plain greedy decoding."""
    s, params, prompt = spec(draft_dir, tree, n), SamplingParams(max_new_tokens=24), [3, 14, 15, 92, 65, 35]
    plain = generate_plain(target, [prompt], params, eos_ids=())[0].token_ids
    res = generate_speculative(target, lambda p, g, m: DFlashDrafter(draft, target, s, p, g, m), prompt, params,
                               (), n + 1)
    assert res.token_ids == plain


def _edit(src: Path, dst: Path, **changes: Any) -> Path:
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if key in raw.get("dflash_config", {}):
            raw["dflash_config"][key] = value
        else:
            raw[key] = value
    raw = {k: v for k, v in raw.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(raw))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


@pytest.mark.parametrize("changes,target_change,match", [
    ({}, {"hidden_size": 32}, "hidden_size"),
    ({}, {"vocab_size": 200}, "vocab_size"),
    ({}, {"num_hidden_layers": 5}, "num_target_layers"),
    ({"num_target_layers": None, "target_layer_ids": [0, 7]}, {}, "target_layer_ids"),
    ({"mask_token_id": 10**6}, {}, "mask_token_id"),
    ({"target_layer_ids": [0, 1, 2]}, {}, "fc.weight"),
    ({"architectures": ["Qwen3ForCausalLM"]}, {}, "DFlashDraftModel"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, {}, "sliding"),
])
def test_mismatches_are_reported(draft_dir: Path, target: CausalLM, tmp_path: Path, changes: dict[str, Any],
                                 target_change: dict[str, Any], match: str) -> None:
    path = _edit(draft_dir, tmp_path / "d", **changes)
    tcfg: ModelConfig = replace(target.config, **target_change)
    for check in (lambda: check_dflash(path, tcfg, spec(path)), lambda: load_dflash(path, tcfg, CPU, torch.float32)):
        with pytest.raises(ValueError, match=match) as err:
            check()
        assert "--speculative-draft-model-path" in str(err.value)


def test_block_size_and_hidden_checks(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path) -> None:
    with pytest.raises(ValueError, match="--speculative-dflash-block-size 16 exceeds"):
        check_dflash(draft_dir, target.config, spec(draft_dir, bs=16))
    short = DFlashDrafter(draft, target, spec(draft_dir, n=3, bs=4), SamplingParams(), None, 32)
    short.prefill([1, 2], torch.zeros(2, 128))
    assert short.block_log_probs(3).shape == (3, target.config.vocab_size)  # a shorter block than trained is allowed
    with pytest.raises(ValueError, match="capture"):
        short.prefill([1, 2], None)


def test_outputs_of_the_first_positions_only_are_exact(draft: DFlashDraftModel) -> None:
    """`outputs=q` cuts the last layer to the first q positions (their queries, projection and MLP); every
    position stays a key, so those q outputs are the full forward's, with and without a padding mask."""
    gen = torch.Generator().manual_seed(4)
    feats, noise = torch.randn(2, 7, 128, generator=gen), torch.randn(2, BS, 64, generator=gen)
    context = draft.context_kv(feats, torch.arange(7).expand(2, 7))
    positions = torch.arange(7, 7 + BS).expand(2, BS)
    keys = torch.arange(7 + BS)[None]
    mask = ((keys < torch.tensor([[5], [7]])) | (keys >= 7))[:, None, None, :]  # the first row's context is 5
    for m in (None, mask):
        full = draft(noise, positions, context, m)  # [2, BS, H]
        for q in (1, 3, BS - 1, BS):
            cut = draft(noise, positions, context, m, q)
            assert cut.shape == (2, q, full.shape[-1])
            torch.testing.assert_close(cut, full[:, :q], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_batched_blocks_equal_one_by_one(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path,
                                         tree: str) -> None:
    """`propose_many` (one padded block forward for all requests) proposes what each `propose` does, for
    contexts of different lengths, pending states, and cut budgets."""
    gen = torch.Generator().manual_seed(9)
    lens = [3, 11, 6]
    batched = [drafter(draft, target, draft_dir, tree, n=6) for _ in lens]
    alone = [drafter(draft, target, draft_dir, tree, n=6) for _ in lens]
    for n, a, b in zip(lens, batched, alone, strict=True):
        hidden = torch.randn(n, 128, generator=gen)
        a.prefill(list(range(n)), hidden)
        b.prefill(list(range(n)), hidden)
    roots = [11, 4, 7]
    for max_drafts in ([None, None, None], [2, None, 4]):
        trees = DFlashDrafter.propose_many(batched, roots, list(max_drafts))
        for i, (t, b) in enumerate(zip(trees, alone, strict=True)):
            ref = b.propose(roots[i], max_drafts[i])
            assert t.tokens.tolist() == ref.tokens.tolist() and t.parents.tolist() == ref.parents.tolist(), i
            torch.testing.assert_close(batched[i].block_log_probs(roots[i]), b.block_log_probs(roots[i]))
        for i, (a, b) in enumerate(zip(batched, alone, strict=True)):  # accept 1..3 tokens: contexts grow unevenly
            hidden = torch.randn(i + 1, 128, generator=gen)
            a.accept([roots[i]] * (i + 1), hidden, roots[i])
            b.accept([roots[i]] * (i + 1), hidden, roots[i])


def test_tree_temperature_is_read_written_and_shapes_the_ddtree(draft_dir: Path, draft: DFlashDraftModel,
                                                                 target: CausalLM, tmp_path: Path) -> None:
    """`dflash_config.tree_temperature` (a calibration, `specserve train calibrate`): absent = 1; written only
    when set; the DDTree is built from the block's log-distributions at that temperature; a chain's argmax does
    not change; <= 0 is refused with the field's name."""
    raw = json.loads((draft_dir / "config.json").read_text())
    assert "tree_temperature" not in raw["dflash_config"] and DFlashConfig.from_hf(raw).tree_temperature == 1.0
    sharp = replace(draft.config, tree_temperature=0.5)
    assert DFlashConfig.from_hf(sharp.to_hf()).tree_temperature == 0.5
    with pytest.raises(ValueError, match="tree_temperature must be > 0"):
        replace(draft.config, tree_temperature=0.0)
    hidden = torch.randn(5, 128, generator=torch.Generator().manual_seed(8))
    sharp_model = DFlashDraftModel(sharp)
    sharp_model.load_state_dict(draft.state_dict())
    plain_dd = drafter(draft, target, draft_dir, "ddtree", n=12)
    sharp_dd = drafter(sharp_model, target, draft_dir, "ddtree", n=12)
    for d in (plain_dd, sharp_dd):
        d.prefill([5, 6, 7, 8, 9], hidden)
    lp = plain_dd.block_log_probs(11)
    assert plain_dd.propose(11).tokens.tolist() == build_ddtree(11, lp, 12).tokens.tolist()
    want = build_ddtree(11, torch.log_softmax(lp / 0.5, dim=-1), 12)
    got = sharp_dd.propose(11)
    assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
    sharp_chain = drafter(sharp_model, target, draft_dir, "chain", n=5)
    sharp_chain.prefill([5, 6, 7, 8, 9], hidden)
    assert sharp_chain.propose(11).tokens.tolist() == [11, *lp[:4].argmax(-1).tolist()]


def test_sampling_requests_draw_their_drafts(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path) -> None:
    """A sampling request's drafts are drawn from the request's processing of the block laws at
    dflash_config.sample_temperature, each node carrying its law: a chain one token per depth, a DDTree the
    shape of the best tree over q with distinct siblings; a seeded generator reproduces them."""
    hidden = torch.randn(4, 128, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=0.8, top_k=20)
    flat_cfg = replace(draft.config, sample_temperature=1.5)
    assert DFlashConfig.from_hf(flat_cfg.to_hf()).sample_temperature == 1.5
    assert "sample_temperature" not in draft.config.to_hf()["dflash_config"]
    with pytest.raises(ValueError, match="sample_temperature must be > 0"):
        replace(draft.config, sample_temperature=-1.0)
    flat = DFlashDraftModel(flat_cfg)
    flat.load_state_dict(draft.state_dict())
    for model, scale in ((draft, 1.0), (flat, 1.5)):
        for tree_kind, n in (("chain", 6), ("ddtree", 24)):
            trees = []
            for _ in range(2):
                gen = torch.Generator().manual_seed(9)
                d = DFlashDrafter(model, target, spec(draft_dir, tree_kind, n), params, gen, 64)
                d.prefill([5, 6, 7, 8], hidden)
                trees.append(d.propose(11))
            tree = trees[0]
            assert tree.tokens.tolist() == trees[1].tokens.tolist()  # seeded: reproducible
            q = target_probs(d.block_log_probs(11) / scale, params)  # [bs-1, V]
            assert tree.draft_probs is not None and int(tree.tokens[0]) == 11
            if tree_kind == "chain":
                assert tree.is_chain and tree.num_nodes == n - 1
            else:
                shape = build_ddtree(11, torch.log(q), n)
                assert tree.parents.tolist() == shape.parents.tolist() and tree.num_nodes == n
            tok, par = tree.tokens.tolist(), tree.parents.tolist()
            for i in range(1, len(tok)):
                earlier = [tok[j] for j in range(1, i) if par[j] == par[i]]
                assert tok[i] not in earlier  # siblings distinct
                want = q[int(tree.depths[i]) - 1].clone()
                want[earlier] = 0.0
                torch.testing.assert_close(tree.draft_probs[i], want / want.sum())
                assert tree.draft_probs[i, tok[i]] > 0  # never a token outside the request's top-k


def test_sampling_requests_reveal_their_first_path(draft: DFlashDraftModel, target: CausalLM,
                                                    draft_dir: Path) -> None:
    """dflash_config.sample_reveal = 2: the drawn tree keeps the shape built from the first block forward;
    the first-child path's first token, then its first two, are shown to the drafter in the block's first masks,
    and every node below the shown token is drawn from the block's laws given them (siblings still distinct),
    the others from the first forward's; batched (`propose_many`) as one at a time; greedy requests unchanged;
    the field is read, written only when set, and refused past block_size - 2."""
    cfg = replace(draft.config, sample_reveal=2)
    assert DFlashConfig.from_hf(cfg.to_hf()).sample_reveal == 2 and "sample_reveal" not in draft.config.to_hf()
    with pytest.raises(ValueError, match="sample_reveal must be in"):
        replace(draft.config, sample_reveal=BS - 1)
    model = DFlashDraftModel(cfg)
    model.load_state_dict(draft.state_dict())
    params = SamplingParams(temperature=0.8, top_k=20)
    gen = torch.Generator().manual_seed(4)
    lens = [4, 9]
    hiddens = [torch.randn(n, 128, generator=gen) for n in lens]
    roots = [11, 5]

    def fresh(m: DFlashDraftModel, p: SamplingParams = params) -> list[DFlashDrafter]:
        out = []
        for n, h in zip(lens, hiddens, strict=True):
            d = DFlashDrafter(m, target, spec(draft_dir, "ddtree", 24), p, torch.Generator().manual_seed(n), 64)
            d.prefill(list(range(n)), h)
            out.append(d)
        return out

    alone = [d.propose(r) for d, r in zip(fresh(model), roots, strict=True)]
    batched = DFlashDrafter.propose_many(fresh(model), roots, [None, None])
    for tree, d, root in zip(alone + batched, fresh(model) * 2, roots * 2, strict=True):
        def law(shown: list[int], d: DFlashDrafter = d, root: int = root) -> torch.Tensor:
            return target_probs(d._log_probs(d._block_hidden(root, BS - 1, shown)), params)  # [bs-1, V]

        tok, par = tree.tokens.tolist(), tree.parents.tolist()
        first = law([])
        shape = build_ddtree(root, torch.log(first), 24)
        assert par == shape.parents.tolist() and tok[0] == root
        kids = tree.children()
        c1 = kids[0][0]
        c2 = kids[c1][0]
        assert kids[c2], "the test needs a path three deep"
        one, two = law([tok[c1]]), law([tok[c1], tok[c2]])
        assert not torch.allclose(one[1], first[1])  # showing a token changes the laws
        below1, below2 = descendants(par, c1), descendants(par, c2)
        assert tree.draft_probs is not None
        for i in range(1, len(tok)):
            earlier = [tok[j] for j in range(1, i) if par[j] == par[i]]
            assert tok[i] not in earlier
            want = (two if below2[i] else one if below1[i] else first)[int(tree.depths[i]) - 1].clone()
            want[earlier] = 0.0
            torch.testing.assert_close(tree.draft_probs[i], want / want.sum(), atol=1e-5, rtol=1e-4)
            assert tree.draft_probs[i, tok[i]] > 0
    greedy = SamplingParams()
    for a, b in zip(fresh(model, greedy), fresh(draft, greedy), strict=True):  # greedy_reveal 0: one forward
        ta, tb = a.propose(roots[0]), b.propose(roots[0])
        assert ta.tokens.tolist() == tb.tokens.tolist() and ta.draft_probs is None


def test_greedy_requests_rebuild_below_their_first_path(draft: DFlashDraftModel, target: CausalLM,
                                                        draft_dir: Path) -> None:
    """dflash_config.greedy_reveal = 1: the DDTree's first node is shown to the drafter and the subtree below it
    rebuilt as the best tree of as many nodes over the block's laws given it; the rest of the tree and its size
    stay; batched as one at a time."""
    from specserve.speculative.trees.ddtree import rebuild_below

    sharp = replace(draft.config, tree_temperature=0.05)  # deep trees: the first node has a subtree
    cfg = replace(sharp, greedy_reveal=1)
    assert DFlashConfig.from_hf(cfg.to_hf()).greedy_reveal == 1 and "greedy_reveal" not in draft.config.to_hf()
    with pytest.raises(ValueError, match="greedy_reveal must be in"):
        replace(draft.config, greedy_reveal=-1)
    model, base_model = DFlashDraftModel(cfg), DFlashDraftModel(sharp)
    model.load_state_dict(draft.state_dict())
    base_model.load_state_dict(draft.state_dict())
    gen = torch.Generator().manual_seed(5)
    lens, roots = [4, 9], [11, 5]
    hiddens = [torch.randn(n, 128, generator=gen) for n in lens]

    def fresh(m: DFlashDraftModel) -> list[DFlashDrafter]:
        out = [drafter(m, target, draft_dir, "ddtree", n=12) for _ in lens]
        for d, n, h in zip(out, lens, hiddens, strict=True):
            d.prefill(list(range(n)), h)
        return out

    plain_trees = [d.propose(r) for d, r in zip(fresh(base_model), roots, strict=True)]
    alone = [d.propose(r) for d, r in zip(fresh(model), roots, strict=True)]
    batched = DFlashDrafter.propose_many(fresh(model), roots, [None, None])
    for base, a, b, d, r in zip(plain_trees, alone, batched, fresh(model), roots, strict=True):
        node = base.children()[0][0]
        assert base.children()[node], "the test needs a subtree below the first node"
        shown = d._log_probs(d._block_hidden(r, BS - 1, [int(base.tokens[node])]))[1:]  # depths 2..
        shown = torch.log_softmax(shown / 0.05, dim=-1)[: int(base.depths.max())]  # one row deeper allowed
        want, _ = rebuild_below(base, node, shown)
        assert a.num_nodes == base.num_nodes == 12
        for got in (a, b):
            assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
        assert a.tokens.tolist() != base.tokens.tolist() or a.parents.tolist() != base.parents.tolist()


@pytest.mark.parametrize("tau", [0.05, 50.0])  # sharp: a deep chain-like tree; flat: a wide shallow one
def test_lm_head_rows_past_the_first_only_for_trees_that_reach_them(draft: DFlashDraftModel, target: CausalLM,
                                                                   draft_dir: Path, tau: float) -> None:
    """The tree built from the first LAZY_ROWS rows is kept only when it stays shallower than them, so every
    DDTree equals the best tree over all the block's rows, alone and batched (also a batch where some requests
    take all rows up front, their last tree having been deep, and others not)."""
    from specserve.speculative.dflash.drafter import LAZY_ROWS

    model = DFlashDraftModel(replace(draft.config, tree_temperature=tau))
    model.load_state_dict(draft.state_dict())
    gen = torch.Generator().manual_seed(12)
    drafters = [drafter(model, target, draft_dir, "ddtree", n=24) for _ in range(3)]
    for i, d in enumerate(drafters):
        d.prefill([5, 6, 7, 8, 9][: 3 + i], torch.randn(3 + i, 128, generator=gen))
    roots = [11, 12, 13]
    heads: list[int] = []
    for d in drafters:
        orig = d._log_probs
        d._log_probs = lambda h, orig=orig: (heads.append(int(h.shape[-2])), orig(h))[1]  # type: ignore[method-assign]
    want = [build_ddtree(r, torch.log_softmax(d.block_log_probs(r) / tau, dim=-1), 24)
            for d, r in zip(drafters, roots, strict=True)]
    heads.clear()
    alone = [d.propose(r) for d, r in zip(drafters, roots, strict=True)]
    alone_heads = list(heads)
    assert all(d._last_deep == (tau < 1) for d in drafters)  # the next round takes all rows up front if deep
    drafters[0]._last_deep = not drafters[0]._last_deep  # a batch mixing both: an LM-head product of its own
    batched = DFlashDrafter.propose_many(drafters, roots, [None] * 3)
    for w, a, b in zip(want, alone, batched, strict=True):
        for got in (a, b):
            assert got.tokens.tolist() == w.tokens.tolist() and got.parents.tolist() == w.parents.tolist()
    deep = [int(w.depths.max()) >= LAZY_ROWS for w in want]
    assert all(deep) if tau < 1 else not any(deep)  # both branches exercised
    if tau > 1:  # shallow trees: the LM head ran over the first rows only
        assert alone_heads == [LAZY_ROWS] * 3
    else:  # deep trees: the remaining rows too, in a second product
        assert alone_heads == [LAZY_ROWS, BS - 1 - LAZY_ROWS] * 3
