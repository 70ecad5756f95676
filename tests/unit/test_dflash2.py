"""DFlash 2: a checkpoint written by z-lab's own `DFlash2DraftModel` drafts the same block and path in specserve,
ours loads back into the reference; the convolutions stay inside a block; the selector's trees; exact greedy
decoding, chain and tree (the sampling law: `integration/test_speculative_exact.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference_decoding import generate_plain, generate_speculative
from specserve.config import SpeculativeConfig
from specserve.models.llama import CausalLM
from specserve.speculative.dflash.checkpoint import init_random_dflash, load_dflash, save_dflash
from specserve.speculative.dflash.conv import grouped_causal_conv
from specserve.speculative.dflash.drafter import DFlashDrafter
from specserve.speculative.dflash.model import DFlashDraftModel
from specserve.speculative.dflash.selector import Transitions, draw_selector_tree, selector_tree
from specserve.speculative.trees.tree import DraftTree
from specserve.speculative.verify import verify_sampled
from specserve.types import SamplingParams

CPU = torch.device("cpu")
BS = 6
V2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, target: CausalLM) -> Path:
    """A random DFlash 2 drafter, every parameter perturbed so that layout mistakes show."""
    path = tmp_path_factory.mktemp("dflash2")
    cfg = init_random_dflash(target.config, path, seed=3, num_hidden_layers=2, block_size=BS, **V2)
    model = load_dflash(path, target.config, CPU, torch.float32)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "codebook" in name or "hidden_projection" in name else 0.1
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    save_dflash(model, cfg, path)
    return path


@pytest.fixture(scope="module")
def draft(draft_dir: Path, target: CausalLM) -> DFlashDraftModel:
    return load_dflash(draft_dir, target.config, CPU, torch.float32)


def _reference_config(target: CausalLM, raw: dict) -> object:
    from transformers import Qwen3Config
    tc = target.config
    return Qwen3Config(
        hidden_size=tc.hidden_size, intermediate_size=raw["intermediate_size"], num_hidden_layers=2,
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"], vocab_size=tc.vocab_size, rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw["rope_theta"], max_position_embeddings=raw["max_position_embeddings"],
        num_target_layers=tc.num_hidden_layers, block_size=BS, architectures=["DFlash2DraftModel"],
        dflash_config={**raw["dflash_config"]}, attn_implementation="sdpa")


def test_reference_checkpoint_drafts_the_same_block_and_path(target: CausalLM, draft_dir: Path,
                                                             tmp_path: Path) -> None:
    """Both directions: a checkpoint the reference class writes (save_pretrained) loads here and drafts the same
    block outputs and greedy path from the same target features; ours loads into the reference."""
    dflash = pytest.importorskip("dflash.model")
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in V2} == V2
    torch.manual_seed(5)
    ref = dflash.DFlash2DraftModel(_reference_config(target, raw)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    ref.save_pretrained(tmp_path / "ref")
    ours = load_dflash(tmp_path / "ref", target.config, CPU, torch.float32)
    assert ours.config.is_v2 and ours.config.selector_top_k == V2["selector_top_k"]

    ctx, n = 7, ours.config.capture
    gen = torch.Generator().manual_seed(6)
    feats = torch.randn(1, ctx, len(n) * target.config.hidden_size, generator=gen)
    block = torch.tensor([[17] + [ours.config.mask_token_id] * (BS - 1)])
    noise = target.embed(block)
    positions = torch.arange(ctx + BS)[None]
    with torch.no_grad():
        want = ref(target_hidden=feats, noise_embedding=noise, position_ids=positions)  # [1, BS, H]
        got = ours(noise, positions[:, ctx:], ours.context_kv(feats, positions[:, :ctx]))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        head = target.lm_head
        want_path, _, _ = ref.propose(want[:, 1:], block[:, 0], head, 0.0)
        assert ours.candidate_selector is not None
        tr = ours.candidate_selector.transitions(got[:, 1:], head(got[:, 1:]), block[:, 0])
        assert tr.tokens(0, tr.greedy_path(0, BS - 1)).tolist() == want_path[0].tolist()

        save_dflash(ours, ours.config, tmp_path / "ours")  # codebooks under the published names
        back = dflash.DFlash2DraftModel.from_pretrained(tmp_path / "ours").eval()
        again = back(target_hidden=feats, noise_embedding=noise, position_ids=positions)
        torch.testing.assert_close(again, want, rtol=1e-4, atol=1e-4)


def test_convolution_is_causal_and_stays_in_its_block() -> None:
    gen = torch.Generator().manual_seed(0)
    x, base = torch.randn(1, 8, 4, generator=gen), torch.randn(3, 4, generator=gen)
    dyn = torch.randn(1, 8, 3, 2, generator=gen)
    whole = grouped_causal_conv(x, dyn, base, 2, segment=4)
    for start in (0, 4):  # each block alone gives the same outputs: nothing crosses the boundary
        part = grouped_causal_conv(x[:, start:start + 4], dyn[:, start:start + 4], base, 2)
        torch.testing.assert_close(whole[:, start:start + 4], part)
    x2 = x.clone()
    x2[:, 2] += 1.0  # a change at position 2 reaches 2..3 (K = 3 taps, block end at 3), nothing else
    moved = (grouped_causal_conv(x2, dyn, base, 2, segment=4) - whole).abs().sum(-1)[0] > 0
    assert moved.tolist() == [False, False, True, True, False, False, False, False]
    by_hand = (base[0] + dyn[0, 5, 0].repeat_interleave(2)) * x[0, 5] + (base[1] + dyn[0, 5, 1].repeat_interleave(2)) \
        * x[0, 4]  # position 5 is the block's second: taps 0 and 1 only
    torch.testing.assert_close(whole[0, 5], by_hand)


def _transitions(k: int = 4, slots: int = 3, seed: int = 0) -> Transitions:
    gen = torch.Generator().manual_seed(seed)
    cands = torch.stack([torch.randperm(20, generator=gen)[:k] for _ in range(slots)])[None]
    return Transitions(cands, torch.randn(1, k, generator=gen) * 2, torch.randn(1, slots - 1, k, k, generator=gen) * 2)


def test_selector_tree_is_the_best_prefixes() -> None:
    """Brute force over every path: the tree of n nodes holds the n most probable prefixes."""
    tr = _transitions()
    first = torch.log_softmax(tr.first[0], -1)
    step = torch.log_softmax(tr.step[0], -1)
    scores = {}
    for a in range(4):
        scores[(a,)] = float(first[a])
        for b in range(4):
            scores[(a, b)] = scores[(a,)] + float(step[0, a, b])
            for c in range(4):
                scores[(a, b, c)] = scores[(a, b)] + float(step[1, b, c])
    for n in (1, 5, 11):
        tree, index = selector_tree(tr, 0, 99, 3, n)
        parents = tree.parents.tolist()
        paths = set()
        for i in range(1, len(parents)):
            path, j = [], i
            while j > 0:
                path.insert(0, index[j])
                j = parents[j]
            paths.add(tuple(path))
            assert int(tree.tokens[i]) == int(tr.cands[0, len(path) - 1, index[i]])
        assert len(paths) == n
        best = sorted(scores.values(), reverse=True)[:n]
        assert sorted((scores[p] for p in paths), reverse=True) == pytest.approx(best)
    chain = selector_tree(tr, 0, 99, 3, 3)
    assert chain[1][1:] == tr.greedy_path(0, 3) and chain[0].is_chain


def test_drawn_selector_tree_follows_its_laws() -> None:
    """A node's law is its parent's drawn token's softmax row, without the candidates earlier siblings drew."""
    tr = _transitions(seed=1)
    shape, _ = selector_tree(tr, 0, 99, 3, 9, temperature=0.8)
    drawn = draw_selector_tree(shape, tr, 0, 0.8, 20, torch.Generator().manual_seed(2))
    assert drawn.draft_probs is not None
    first, step = tr.laws(0, 0.8)
    kids = drawn.children()
    index = {0: -1}
    for node in range(1, drawn.num_nodes + 1):
        s = int(drawn.depths[node]) - 1
        index[node] = tr.cands[0, s].tolist().index(int(drawn.tokens[node]))
    for parent, children in enumerate(kids):
        if not children:
            continue
        s = int(drawn.depths[children[0]]) - 1
        law = (first if parent == 0 else step[s - 1, index[parent]]).clone()
        for c in children:
            want = torch.zeros(20).scatter(0, tr.cands[0, s], law / law.sum())
            torch.testing.assert_close(drawn.draft_probs[c], want)
            law[index[c]] = 0.0


@pytest.mark.parametrize("tree,n", [("chain", 5), ("ddtree", 8)])
def test_dflash2_decodes_exactly(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path, tree: str,
                                 n: int) -> None:
    s = SpeculativeConfig.resolve("DFLASH", str(draft_dir), num_draft_tokens=n, dflash_block_size=BS, tree=tree)
    params, prompt = SamplingParams(max_new_tokens=24), [3, 14, 15, 92, 65, 35]
    plain = generate_plain(target, [prompt], params, eos_ids=())[0].token_ids
    res = generate_speculative(target, lambda p, g, m: DFlashDrafter(draft, target, s, p, g, m), prompt, params,
                               (), n + 1)
    assert res.token_ids == plain


@pytest.mark.parametrize("tree,n", [("chain", 3), ("ddtree", 6)])
def test_sampled_drafts_verify_to_the_target_law(draft: DFlashDraftModel, target: CausalLM, draft_dir: Path,
                                                 tree: str, n: int) -> None:
    """Many rounds from one context, each a fresh draw of the selector's tree, verified against a target law
    that covers the drafted candidates and one token the drafter never offers (row per depth, the same for every
    node: the emitted pair is then p0 x p1; a round emitting one token gets its second from p1, as the next
lossless round would): chi-square on the first two tokens emitted."""
    from scipy.stats import chisquare

    s = SpeculativeConfig.resolve("DFLASH", str(draft_dir), num_draft_tokens=n, dflash_block_size=BS, tree=tree)
    gen = torch.Generator().manual_seed(7)
    d = DFlashDrafter(draft, target, s, SamplingParams(temperature=0.8), gen, 64)
    d.prefill([5, 6, 7, 8], torch.randn(4, 128, generator=torch.Generator().manual_seed(8)))
    root, vocab = 11, target.config.vocab_size
    hidden = d._block_hidden(root, BS - 1)
    assert draft.candidate_selector is not None
    tr = draft.candidate_selector.transitions(hidden[None], d._log_probs(hidden[None]), torch.tensor([root]))
    laws = []
    for slot in range(2):
        law = torch.zeros(vocab)
        law[tr.cands[0, slot]] = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.05])
        outside = next(t for t in range(vocab) if t not in tr.cands[0, slot].tolist())
        law[outside] = 0.1
        laws.append(law)
    counts: dict[tuple[int, int], int] = {}
    trials = 2000
    for _ in range(trials):
        t = d.propose(root)
        p = torch.stack([laws[min(int(depth), 1)] for depth in t.depths])  # [N+1, V] by the node's depth
        res = verify_sampled(t, p, gen)
        emitted = [int(t.tokens[a]) for a in res.accepted] + [res.bonus]
        if len(emitted) == 1:  # the next round's first token: whatever it drafts, lossless means a draw of p1
            emitted.append(int(torch.multinomial(laws[1], 1, generator=gen)))
        first, second = emitted[:2]
        counts[(first, second)] = counts.get((first, second), 0) + 1
    joint = (laws[0][:, None] * laws[1][None, :]).flatten()
    cells = [k for k in range(joint.shape[0]) if joint[k] > 0]
    observed = [counts.get(divmod(k, vocab), 0) for k in cells]
    assert sum(observed) == trials
    assert chisquare(observed, [float(joint[k]) * trials for k in cells]).pvalue > 0.001


def test_dflash2_from_a_dflash_drafter_drafts_its_blocks(target: CausalLM, tmp_path: Path) -> None:
    """`train dflash2 --init-from` a DFlash drafter: the convolutions start as the identity, so the block outputs
    are the DFlash drafter's; the selector's codebooks start small but not at 0 (a zero pair gets no gradient)."""
    from specserve.train.dflash import dflash2_from

    init_random_dflash(target.config, tmp_path, seed=2, block_size=BS)
    v1 = load_dflash(tmp_path, target.config, CPU, torch.float32)
    v2 = dflash2_from(v1, V2, seed=0)
    assert v2.config.is_v2 and not v1.config.is_v2 and v2.candidate_selector is not None
    assert all(float(p.detach().abs().max()) > 0 for p in v2.candidate_selector.parameters())
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 5, len(v1.config.capture) * target.config.hidden_size, generator=gen)
    noise, pos = torch.randn(1, BS, target.config.hidden_size, generator=gen), torch.arange(5 + BS)[None]
    with torch.no_grad():
        got, want = (m(noise, pos[:, 5:], m.context_kv(feats, pos[:, :5])) for m in (v2, v1))
    torch.testing.assert_close(got, want)


def test_a_drawn_tree_leaves_out_nodes_whose_law_ran_dry() -> None:
    """A shape asking for more siblings than their law has candidates of any mass (a drawn parent's law sharper
    than the shape assumed) gets only the nodes that can be drawn, their subtrees with them, each with its law."""
    cands = torch.stack([torch.arange(4) + 10 * s for s in range(3)])[None]
    peaked = torch.tensor([0.0, -200.0, -200.0, -200.0])  # exp(-200) is 0 in float32: one candidate of mass
    step = torch.zeros(1, 2, 4, 4)
    step[0, 0, 0] = peaked
    tr = Transitions(cands, peaked[None].clone(), step)
    # root -> one slot-0 node -> three slot-1 children, the first with a child of its own
    shape = DraftTree(torch.tensor([99, 0, 0, 0, 0, 0]), torch.tensor([-1, 0, 1, 1, 1, 2]),
                      torch.tensor([0, 1, 2, 2, 2, 3]))
    drawn = draw_selector_tree(shape, tr, 0, 1.0, 40, torch.Generator().manual_seed(0))
    assert drawn.draft_probs is not None and torch.isfinite(drawn.draft_probs).all()
    assert drawn.parents.tolist() == [-1, 0, 1, 2] and drawn.depths.tolist() == [0, 1, 2, 3]
    assert drawn.tokens.tolist()[:3] == [99, 0, 10]
    for i in range(1, drawn.num_nodes + 1):
        assert abs(float(drawn.draft_probs[i].sum()) - 1.0) < 1e-5 and drawn.draft_probs[i, drawn.tokens[i]] > 0
