"""Verification is exact: greedy equals plain greedy decoding; sampling is distributed as plain sampling.

The toy target (and drafter) here is a table indexed by the whole token path, so nodes that share a path
(duplicated siblings) share a distribution, as with a real model. Sampled checks extend every emitted
sequence by plain sampling to a fixed length and compare the first-m-token distribution with the exact
one by a chi-square test (p-value from the regularised upper incomplete gamma, df = cells - 1 after
merging cells with expected count < 5). Seeds are fixed, so the outcomes are deterministic.
"""

from __future__ import annotations

import pytest
import torch

from specserve.speculative.trees.sampled_tree import draw_tree
from specserve.speculative.trees.tree import DraftTree
from specserve.speculative.verify import VerifyResult, verify_greedy, verify_sampled

V = 5
ALPHA = 1e-4  # a lossless rule must not be rejected at this level ...
POWER = 1e-6  # ... and a wrong one must be rejected at this one


class PathTable:
    """Next-token distributions [paths, V] for every token path of length 0..max_len (base-V path ids)."""

    def __init__(self, max_len: int, seed: int, zero_prob: float = 0.25, scale: float = 1.5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.offsets = [sum(V**i for i in range(d)) for d in range(max_len + 2)]  # first id of each length
        n = self.offsets[-1]
        logits = torch.randn(n, V, generator=g) * scale
        # Zero some entries (as top-k / top-p leave them), never a row's best token.
        drop = (torch.rand(n, V, generator=g) < zero_prob) & (logits < logits.amax(-1, keepdim=True))
        self.probs = torch.softmax(logits.masked_fill(drop, float("-inf")), -1)  # [n, V]

    def child(self, pid: torch.Tensor, depth: int, tok: torch.Tensor) -> torch.Tensor:
        return self.offsets[depth + 1] + (pid - self.offsets[depth]) * V + tok

    def seq_probs(self, m: int) -> torch.Tensor:
        """[V**m] float64: plain-sampling probability of every m-token sequence (y_1 most significant)."""
        probs = torch.ones(1, dtype=torch.float64)
        for d in range(m):
            probs = (probs[:, None] * self.probs[self.offsets[d]:self.offsets[d + 1]].double()).flatten()
        return probs


def emitted(tree_tokens: list[int], res: VerifyResult) -> list[int]:
    return [tree_tokens[a] for a in res.accepted] + [res.bonus]


def extend(seqs: list[list[int]], p: PathTable, length: int, gen: torch.Generator) -> torch.Tensor:
    """Continue each emitted sequence by plain sampling from p up to `length` tokens -> [T, length]."""
    seq = torch.tensor([(s + [-1] * length)[:length] for s in seqs])
    pid = torch.zeros(len(seqs), dtype=torch.long)
    for k in range(length):
        draw = torch.multinomial(p.probs[pid], 1, generator=gen).squeeze(1)
        seq[:, k] = torch.where(seq[:, k] < 0, draw, seq[:, k])
        pid = p.child(pid, k, seq[:, k])
    return seq


def chi2_pvalue(seq: torch.Tensor, p: PathTable, m: int) -> float:
    code = sum(seq[:, i] * V ** (m - 1 - i) for i in range(m))
    counts = torch.bincount(code, minlength=V**m).double()
    expected = p.seq_probs(m) * seq.shape[0]
    if (counts[expected == 0] > 0).any():
        return 0.0  # emitted a sequence the target can never produce
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def pvalues(seqs: list[list[int]], p: PathTable, length: int, seed: int) -> list[float]:
    """p-values of the first token, the first two tokens and the first `length` tokens."""
    seq = extend(seqs, p, length, torch.Generator().manual_seed(seed))
    return [chi2_pvalue(seq, p, m) for m in sorted({1, 2, length})]


def sample_trees(parents: list[int], q: PathTable, trials: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens drawn from q (siblings i.i.d. from their parent's q) -> tokens, path ids [T, N+1]."""
    g = torch.Generator().manual_seed(seed)
    n = len(parents)
    tok = torch.zeros(trials, n, dtype=torch.long)
    pid = torch.zeros(trials, n, dtype=torch.long)
    depth = [0] * n
    for i in range(1, n):
        par = parents[i]
        depth[i] = depth[par] + 1
        tok[:, i] = torch.multinomial(q.probs[pid[:, par]], 1, generator=g).squeeze(1)
        pid[:, i] = q.child(pid[:, par], depth[par], tok[:, i])
    return tok, pid


def depths_of(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def run_sampled_drafts(parents: list[int], trials: int, seed: int) -> tuple[list[list[int]], PathTable, bool]:
    """verify_sampled on `trials` trees with drafts sampled from q; returns emitted sequences, p, any dup."""
    length = max(depths_of(parents)) + 1
    p, q = PathTable(length - 1, seed), PathTable(length - 1, seed + 1, zero_prob=0.15, scale=1.0)
    tok, pid = sample_trees(parents, q, trials, seed + 2)
    target = p.probs[pid]  # [T, N+1, V]
    draft = q.probs[pid[:, [0, *parents[1:]]]]  # [T, N+1, V] row i = q of node i's parent path
    par_t, dep_t = torch.tensor(parents), torch.tensor(depths_of(parents))
    gen = torch.Generator().manual_seed(seed + 3)
    tok_l = tok.tolist()
    seqs, dup = [], False
    for t in range(trials):
        tree = DraftTree(tokens=tok[t], parents=par_t, depths=dep_t, draft_probs=draft[t])
        seqs.append(emitted(tok_l[t], verify_sampled(tree, target[t], gen)))
        sib = [(parents[i], tok_l[t][i]) for i in range(1, len(parents))]
        dup = dup or len(set(sib)) < len(sib)
    return seqs, p, dup


# ---------------------------------------------------------------- greedy


def random_case(seed: int) -> tuple[DraftTree, torch.Tensor, list[tuple[int, ...]]]:
    """A random tree over a 3-token vocabulary and path-consistent target logits for it."""
    g = torch.Generator().manual_seed(seed)
    vocab, n = 3, int(torch.randint(1, 13, (1,), generator=g))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n + 1)]
    tokens = [7, *torch.randint(0, vocab, (n,), generator=g).tolist()]
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, n + 1):
        paths.append((*paths[parents[i]], tokens[i]))
    logits_of: dict[tuple[int, ...], torch.Tensor] = {}
    for path in paths:  # duplicated paths share their logits, as with a real target
        logits_of.setdefault(path, torch.randn(vocab, generator=g))
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                     depths=torch.tensor([len(x) for x in paths]))
    return tree, torch.stack([logits_of[x] for x in paths]), paths


def test_greedy_equals_plain_greedy_on_random_trees() -> None:
    lengths = []
    for seed in range(300):
        tree, logits, paths = random_case(seed)
        res = verify_greedy(tree, logits)
        tokens = tree.tokens.tolist()
        parents = tree.parents.tolist()
        out = emitted(tokens, res)
        # plain greedy along the emitted prefix: each token is the argmax after the previous ones
        row_of = {x: i for i, x in reversed(list(enumerate(paths)))}  # first node carrying each path
        for k, y in enumerate(out):
            assert y == int(logits[row_of[tuple(out[:k])]].argmax())
        # the accepted nodes form a path from the root, each the first sibling carrying its token
        prev = 0
        for a in res.accepted:
            assert parents[a] == prev
            assert a == min(i for i in range(1, len(tokens)) if parents[i] == prev and tokens[i] == tokens[a])
            prev = a
        # maximal: the target's choice after the last accepted node is no child's token
        assert all(not (parents[i] == prev and tokens[i] == res.bonus) for i in range(1, len(tokens)))
        lengths.append(len(res.accepted))
    assert min(lengths) == 0 and max(lengths) >= 3  # both rejection at once and long accepts were exercised


def test_greedy_chain_all_accepted_and_first_rejected() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g)
    best = logits.argmax(-1).tolist()
    full = verify_greedy(DraftTree.chain(3, best[:4]), logits)
    assert full == VerifyResult([1, 2, 3, 4], best[4])  # bonus from the last node
    wrong = (best[0] + 1) % 11
    first = verify_greedy(DraftTree.chain(3, [wrong, *best[1:4]]), logits)
    assert first == VerifyResult([], best[0])
    assert verify_greedy(DraftTree.chain(3, []), logits[:1]) == VerifyResult([], best[0])


def test_greedy_duplicate_siblings_take_the_first() -> None:
    # root -> 1:[5], 2:[5] -> 3:[6] (child of the second duplicate only)
    tree = DraftTree(tokens=torch.tensor([0, 5, 5, 6]), parents=torch.tensor([-1, 0, 0, 2]),
                     depths=torch.tensor([0, 1, 1, 2]))
    logits = torch.zeros(4, 8)
    logits[:, 6] = 1.0
    logits[0, 5] = 2.0
    assert verify_greedy(tree, logits) == VerifyResult([1], 6)


def test_shape_checks() -> None:
    tree = DraftTree.chain(0, [1, 2])
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(tree, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampled(DraftTree.chain(0, [1, 2], draft_probs=torch.full((3, 5), 0.2)), torch.full((3, 4), 0.25), None)
    with pytest.raises(ValueError, match="bonus"):
        VerifyResult([1], -1)
    with pytest.raises(ValueError, match="accepted"):
        VerifyResult([2, 1], 0)


# ---------------------------------------------------------------- sampling


def test_sampled_chain_is_lossless() -> None:
    seqs, p, _ = run_sampled_drafts([-1, 0, 1], trials=8000, seed=10)
    assert {len(s) for s in seqs} == {1, 2, 3}
    assert min(pvalues(seqs, p, 3, seed=11)) > ALPHA


def test_sampled_tree_specinfer_is_lossless() -> None:
    seqs, p, dup = run_sampled_drafts([-1, 0, 0, 0, 1, 1, 2], trials=6000, seed=20)
    assert dup, "duplicate sibling tokens should occur and be covered"
    assert {len(s) for s in seqs} == {1, 2, 3}
    assert min(pvalues(seqs, p, 3, seed=21)) > ALPHA


def test_deterministic_tree_is_lossless() -> None:
    # root -> tokens 2, 0, 2 (duplicate), 4; node 1 (2) -> 1, 1 (duplicate), 3; node 2 (0) -> 4
    parents = [-1, 0, 0, 0, 0, 1, 1, 1, 2]
    tokens = [0, 2, 0, 2, 4, 1, 1, 3, 4]
    p = PathTable(2, seed=30, zero_prob=0.3)
    rows = [p.offsets[0]]
    for i in range(1, len(tokens)):
        rows.append(int(p.child(torch.tensor(rows[parents[i]]), depths_of(parents)[parents[i]],
                                torch.tensor(tokens[i]))))
    tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                     depths=torch.tensor(depths_of(parents)))
    target = p.probs[rows]  # [N+1, V]
    gen = torch.Generator().manual_seed(31)
    seqs = [emitted(tokens, verify_sampled(tree, target, gen)) for _ in range(12000)]
    assert {len(s) for s in seqs} == {1, 2, 3}
    assert min(pvalues(seqs, p, 3, seed=32)) > ALPHA


def test_wrong_rules_are_detected() -> None:
    """Power of the same harness: two plausible but wrong chain rules must fail it."""
    parents, trials, seed = [-1, 0, 1], 4000, 40
    p, q = PathTable(2, seed), PathTable(2, seed + 1, zero_prob=0.15, scale=1.0)
    tok, pid = sample_trees(parents, q, trials, seed + 2)
    target, draft = p.probs[pid], q.probs[pid[:, [0, 0, 1]]]  # [T, 3, V]
    g = torch.Generator().manual_seed(seed + 3)
    rows = torch.arange(trials)
    px = target[:, :-1].gather(-1, tok[:, 1:, None]).squeeze(-1)  # [T, 2]
    qx = draft[:, 1:].gather(-1, tok[:, 1:, None]).squeeze(-1)
    acc = (torch.rand(trials, 2, generator=g) * qx < px).long().cumprod(1).sum(1)  # [T] accepted drafts

    def seqs_of(n_acc: torch.Tensor, bonus_rows: torch.Tensor) -> list[list[int]]:
        bonus = torch.multinomial(bonus_rows, 1, generator=g).squeeze(1)
        return [[*tok[t, 1:1 + int(n_acc[t])].tolist(), int(bonus[t])] for t in range(trials)]

    always = seqs_of(torch.full((trials,), 2), target[:, 2])  # accept every draft
    from_p = seqs_of(acc, target[rows, acc])  # right acceptance, but resample from p instead of the residual
    for seqs in (always, from_p):
        assert max(pvalues(seqs, p, 3, seed=seed + 4)[:2]) < POWER


def test_empty_residual_falls_back_to_target() -> None:
    # q >= p everywhere (here unnormalised), so a rejection leaves no residual mass: sample from p instead.
    target = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.6, 0.6, 0.0, 0.0]])
    tree = DraftTree.chain(3, [1], draft_probs=draft)
    gen = torch.Generator().manual_seed(50)
    results = [verify_sampled(tree, target, gen) for _ in range(300)]
    rejected = [r.bonus for r in results if not r.accepted]
    assert 0 < len(rejected) < 300
    assert set(rejected) <= {0, 1}


# ---------------------------------------------------------------- sampled trees of a block drafter


def test_drawn_tree_siblings_are_distinct_and_record_their_laws() -> None:
    # root -> 1, 2, 3; 1 -> 4, 5; 4 -> 6
    shape = DraftTree(tokens=torch.zeros(7, dtype=torch.long), parents=torch.tensor([-1, 0, 0, 0, 1, 1, 4]),
                      depths=torch.tensor([0, 1, 1, 1, 2, 2, 3]))
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(1)), -1)  # [D, V]
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        tree = draw_tree(shape, q, gen)
        tok, probs = tree.tokens.tolist(), tree.draft_probs
        assert probs is not None and tok[0] == 0 and not probs[0].any()
        assert len({tok[1], tok[2], tok[3]}) == 3 and tok[4] != tok[5]
        for node, earlier in [(1, []), (2, [1]), (3, [1, 2]), (4, []), (5, [4]), (6, [])]:
            want = q[int(tree.depths[node]) - 1].clone()
            want[[tok[e] for e in earlier]] = 0.0
            torch.testing.assert_close(probs[node], want / want.sum())
            assert probs[node, tok[node]] > 0
    with pytest.raises(ValueError, match="earlier siblings"):
        draw_tree(shape, torch.tensor([[0.5, 0.5, 0, 0, 0], [1.0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0]]), gen)


def test_drawn_tree_without_replacement_is_lossless() -> None:
    """A block drafter's tree (one law per depth, siblings drawn without replacement) verified by recursive
    rejection emits exactly the target's law."""
    parents = [-1, 0, 0, 0, 1, 1, 4]
    p = PathTable(3, seed=50)
    q = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(51)), -1)  # [D, V]
    q[1, 0] = 0.0  # a zero-probability token at depth 2
    q = q / q.sum(-1, keepdim=True)
    shape = DraftTree(tokens=torch.zeros(len(parents), dtype=torch.long), parents=torch.tensor(parents),
                      depths=torch.tensor(depths_of(parents)))
    gen = torch.Generator().manual_seed(52)
    seqs = []
    for _ in range(4000):
        tree = draw_tree(shape, q, gen)
        tok = tree.tokens.tolist()
        pid = [p.offsets[0]]
        for i in range(1, len(tok)):
            pid.append(int(p.child(torch.tensor(pid[parents[i]]), depths_of(parents)[parents[i]],
                                   torch.tensor(tok[i]))))
        seqs.append(emitted(tok, verify_sampled(tree, p.probs[pid], gen)))
    assert {len(s) for s in seqs} == {1, 2, 3, 4}
    assert min(pvalues(seqs, p, 4, seed=53)) > ALPHA


def test_a_tree_drawn_again_below_its_first_path_is_lossless() -> None:
    """A DFlash tree revealed two tokens deep (`dflash_config.sample_reveal`): drawn from one law per depth, then
    the subtree below the first child drawn again from laws that depend on that child's token, and below its
    first child from laws that depend on both (`redraw_below`), verified by recursive rejection: the target's
    law exactly. Recording the first draw's laws for the redrawn nodes instead is caught."""
    from specserve.speculative.trees.sampled_tree import redraw_below

    parents = [-1, 0, 0, 1, 1, 3, 3, 5]
    depths = depths_of(parents)
    p = PathTable(4, seed=60)
    g = torch.Generator().manual_seed(61)
    q = torch.softmax(torch.randn(4, V, generator=g), -1)  # [D, V] the first forward's laws
    given1 = torch.softmax(2 * torch.randn(V, 3, V, generator=g), -1)  # [tok1, depths 2..4, V]
    given2 = torch.softmax(2 * torch.randn(V, V, 2, V, generator=g), -1)  # [tok1, tok3, depths 3..4, V]
    shape = DraftTree(tokens=torch.zeros(len(parents), dtype=torch.long), parents=torch.tensor(parents),
                      depths=torch.tensor(depths))
    gen = torch.Generator().manual_seed(62)
    seqs: dict[bool, list[list[int]]] = {True: [], False: []}
    for _ in range(4000):
        first = draw_tree(shape, q, gen)
        tree = redraw_below(first, 1, given1[int(first.tokens[1])], gen, first_depth=2)
        tree = redraw_below(tree, 3, given2[int(tree.tokens[1]), int(tree.tokens[3])], gen, first_depth=3)
        tok = tree.tokens.tolist()
        pid = [p.offsets[0]]
        for i in range(1, len(tok)):
            pid.append(int(p.child(torch.tensor(pid[parents[i]]), depths[parents[i]], torch.tensor(tok[i]))))
        wrong = DraftTree(tree.tokens, tree.parents, tree.depths, first.draft_probs)  # the first draw's laws
        for right, t in ((True, tree), (False, wrong)):
            seqs[right].append(emitted(tok, verify_sampled(t, p.probs[pid], gen)))
    assert {len(s) for s in seqs[True]} == {1, 2, 3, 4, 5}
    assert min(pvalues(seqs[True], p, 5, seed=63)) > ALPHA
    assert min(pvalues(seqs[False], p, 5, seed=63)) < POWER
