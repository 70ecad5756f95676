"""Drafter-training losses on a tiny target: the training forward is the drafting forward, losses are the ones
the papers define, and a few optimizer steps on a fixed batch lower them. Plus the trainer's small parts."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specserve.config import SpeculativeConfig
from specserve.kv.contiguous import ContiguousKVCache
from specserve.models.llama import CausalLM
from specserve.speculative.dflash.checkpoint import init_random_dflash, load_dflash
from specserve.speculative.dflash.drafter import DFlashDrafter
from specserve.speculative.dflash.model import DFlashDraftModel
from specserve.speculative.eagle3.checkpoint import init_random_eagle3, load_eagle3
from specserve.speculative.eagle3.drafter import Eagle3Drafter
from specserve.speculative.eagle3.model import Eagle3Model
from specserve.train import checkpoint as ckpt
from specserve.train.data import Example, read_prompts
from specserve.train.dflash import (
    DFlashTrainConfig,
    block_batch,
    build_dflash,
    dflash_loss,
    position_weights,
    sample_anchors,
    soft_labels,
)
from specserve.train.distributed import Batcher, DistContext
from specserve.train.eagle3 import (
    Eagle3TrainConfig,
    build_eagle3,
    draft_vocab_from_data,
    ttt_loss,
    ttt_mask,
    ttt_unroll,
)
from specserve.train.trainer import Objective, WarmupCosine, step_generator
from specserve.types import SamplingParams

from tiny import TINY_VOCAB

CPU = torch.device("cpu")
AUX = (1, 2, 3)
BS = 4


@pytest.fixture(scope="module")
def eagle(target: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Eagle3Model:
    path = tmp_path_factory.mktemp("eagle")
    init_random_eagle3(target.config, path, seed=3, draft_token_ids=list(range(0, TINY_VOCAB, 2)), aux_layer_ids=AUX)
    return load_eagle3(path, target.config, CPU, torch.float32)


@pytest.fixture(scope="module")
def dflash(target: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> DFlashDraftModel:
    path = tmp_path_factory.mktemp("dflash")
    init_random_dflash(target.config, path, seed=4, num_hidden_layers=2, block_size=BS, mask_token_id=3)
    return load_dflash(path, target.config, CPU, torch.float32)


def _examples(n: int, length: int, prompt_len: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(4, TINY_VOCAB, length).astype(np.int32), prompt_len) for _ in range(n)]


def _states(target: CausalLM, ids: torch.Tensor, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    out = target(ids, torch.arange(ids.shape[1])[None].expand_as(ids), capture=capture)
    assert out.logits is not None
    return torch.cat(out.captured, dim=-1), out.logits


# ---- EAGLE-3 ------------------------------------------------------------------------------------------------

def test_ttt_mask_layout() -> None:
    m = ttt_mask(4, 2, CPU)[0, 0].int()  # queries s = 0..3; keys: step 0 | step 1 | step 2, 4 slots each
    assert m.shape == (4, 12)
    assert m[3].tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # committed <= 1, step-1 at 2, itself at 3
    assert m[0].tolist() == [0] * 8 + [1, 0, 0, 0]  # no committed token: only itself (never an empty row)
    assert ttt_mask(3, 0, CPU)[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@torch.no_grad()
def test_ttt_unroll_equals_step_by_step_drafting(target: CausalLM, eagle: Eagle3Model) -> None:
    ids = torch.randint(4, TINY_VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    length, steps = 12, 4
    states, _ = _states(target, ids, AUX)
    states, embeds = states[:, :length], target.embed(ids[:, 1 : length + 1])
    outs = list(ttt_unroll(eagle, embeds, states, steps))
    feature = eagle.project(states)
    for c in (0, 3, 7):  # the committed token the drafts start from
        cache = ContiguousKVCache.allocate(eagle.config.layer, 1, length + steps, CPU, torch.float32, num_layers=1)
        feat = eagle(embeds[:, : c + 1], feature[:, : c + 1], torch.arange(c + 1)[None], cache.view(0, c + 1))[:, -1:]
        torch.testing.assert_close(feat, outs[0][:, c : c + 1], rtol=1e-5, atol=1e-5)
        for k in range(1, steps):
            s = c + k  # the k-th draft's own entry, fed its predecessor's output
            feat = eagle(embeds[:, s : s + 1], feat, torch.tensor([[s]]), cache.view(s, 1))
            torch.testing.assert_close(feat, outs[k][:, s : s + 1], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_ttt_greedy_tokens_are_the_drafters_chain(target: CausalLM, eagle: Eagle3Model) -> None:
    prompt = [int(t) for t in torch.randint(4, TINY_VOCAB, (10,), generator=torch.Generator().manual_seed(2))]
    states, logits = _states(target, torch.tensor([prompt]), AUX)
    root = int(logits[0, -1].argmax())
    drafter = Eagle3Drafter(eagle, target, SpeculativeConfig.resolve("EAGLE3", "x", num_steps=5),
                            SamplingParams(), None, 64)
    drafter.prefill(prompt, states[0])
    drafts = drafter.propose(root).tokens[1:].tolist()
    seq = torch.tensor([[*prompt, root, *drafts]])  # the drafts as if the target had accepted them
    length = seq.shape[1] - 2
    states, _ = _states(target, seq, AUX)
    outs = list(ttt_unroll(eagle, target.embed(seq[:, 1 : length + 1]), states[:, :length], 5))
    c = len(prompt) - 1  # slot of the last prompt token, whose pair completes with the root
    got = [int(eagle.target_ids(eagle.draft_logits(outs[i][0, c + i]).argmax())) for i in range(5)]
    assert got == drafts


def test_ttt_loss_is_weighted_soft_cross_entropy(target: CausalLM, eagle: Eagle3Model) -> None:
    gen = torch.Generator().manual_seed(5)
    b, length, vd = 2, 6, eagle.config.draft_vocab_size
    embeds = torch.randn(b, length, 64, generator=gen)
    states = torch.randn(b, length, 3 * 64, generator=gen)
    target_p = torch.softmax(torch.randn(b, length, vd, generator=gen), dim=-1)
    valid = torch.rand(b, length, generator=gen) > 0.3
    outs = list(ttt_unroll(eagle, embeds, states, 3))
    expected = torch.zeros(())
    for i, out in enumerate(outs):
        ce = -(target_p * F.log_softmax(eagle.draft_logits(out), dim=-1)).sum(-1)
        ok = valid & (torch.arange(length) >= i)
        expected = expected + 0.8**i * ce[ok].mean()
    loss, accs = ttt_loss(eagle, embeds, states, target_p[valid], valid, 3, 0.8)
    torch.testing.assert_close(loss, expected)
    assert len(accs) == 3 and all(0 <= a <= 1 for a in accs)


def test_draft_vocab_is_the_most_frequent_response_tokens() -> None:
    ex = [Example(np.array([9, 9, 9, 5, 5, 7, 2], dtype=np.int32), prompt_len=3),  # prompt 9 9 9 is not counted
          Example(np.array([1, 7, 7, 4], dtype=np.int32), prompt_len=1)]
    assert draft_vocab_from_data(ex, 10, 2) == [5, 7]  # 7 x3, 5 x2
    assert draft_vocab_from_data(ex, 10, 3) == [2, 5, 7]  # ties (1 each: 2, 4) broken by the lower id
    assert draft_vocab_from_data(ex, 10, 5) == [2, 4, 5, 7, 9]  # then the prompts' tokens: 9 x3 before 0
    with pytest.raises(ValueError, match="--draft-vocab-size"):
        draft_vocab_from_data(ex, 10, 11)


# ---- DFlash -------------------------------------------------------------------------------------------------

def test_anchor_sampling_and_block_targets() -> None:
    lens, plens = torch.tensor([20, 7]), torch.tensor([5, 4])
    anchors, ok = sample_anchors(lens, plens, 6, torch.Generator().manual_seed(0))
    row0 = anchors[0].tolist()
    assert ok[0].all() and row0 == sorted(set(row0)) and row0[0] >= 5 and row0[-1] <= 18
    assert ok[1].tolist() == [True, True] + [False] * 4 and anchors[1, :2].tolist() == [4, 5]  # only 2 positions
    ids = torch.arange(100, 120)[None].expand(2, 20).clone()
    inputs, labels, weights = block_batch(ids, lens, anchors, ok, BS, mask_token_id=3, gamma=7.0)
    a = int(anchors[0, 0])
    assert inputs[0, :BS].tolist() == [100 + a, 3, 3, 3]
    assert labels[0, 1:BS].tolist() == [100 + a + k for k in range(1, BS)]
    w = position_weights(BS, 7.0, CPU)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, np.exp(-1 / 7), np.exp(-2 / 7)], dtype=torch.float32))
    assert weights[1, BS : 2 * BS].tolist() == [0.0, 1.0, 0.0, 0.0]  # anchor 5 of a 7-token row: only 6 exists
    assert weights[1, 2 * BS :].sum() == 0  # padded anchors


def test_dflash_loss_ignores_the_anchor_position() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2 * BS, 11, generator=gen)
    labels = torch.randint(0, 11, (1, 2 * BS), generator=gen)
    weights = position_weights(BS, 7.0, CPU).repeat(2)[None]
    base = dflash_loss(logits, labels, weights)
    bumped = logits.clone()
    bumped[0, 0] += 5.0  # the anchor's own row
    assert dflash_loss(bumped, labels, weights) == base
    ce = F.cross_entropy(logits[0], labels[0], reduction="none")
    torch.testing.assert_close(base, (ce * weights[0]).sum() / weights.sum())


def test_dflash_soft_labels_are_the_target_distribution_of_each_block_token() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 2 * BS, 11, generator=gen)
    labels = torch.randint(0, 11, (1, 2 * BS), generator=gen)
    weights = position_weights(BS, 7.0, CPU).repeat(2)[None]
    one_hot = F.one_hot(labels, 11).float()
    hard = dflash_loss(logits, labels, weights)
    torch.testing.assert_close(dflash_loss(logits, labels, weights, one_hot, 1.0), hard)
    target = torch.softmax(torch.randn(1, 2 * BS, 11, generator=gen), dim=-1)
    soft = dflash_loss(logits, labels, weights, target, 1.0)
    expected = -(target * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(soft, (expected * weights).sum() / weights.sum())
    torch.testing.assert_close(dflash_loss(logits, labels, weights, target, 0.25), 0.75 * hard + 0.25 * soft)
    # block position k of anchor a takes the target's row a+k-1 (its distribution of token a+k)
    t_logits = torch.randn(2, 12, 11, generator=gen)
    anchors = torch.tensor([[2, 6], [0, 9]])
    got = soft_labels(t_logits, anchors, BS)  # [2, 2*BS, 11]
    probs = torch.softmax(t_logits, dim=-1)
    torch.testing.assert_close(got[0, BS + 2], probs[0, 6 + 2 - 1])
    torch.testing.assert_close(got[1, 1], probs[1, 0])
    torch.testing.assert_close(got[1, BS + 3], probs[1, 11])  # past the sequence: clamped (weight 0 there)
    with pytest.raises(ValueError, match="--soft-label-weight"):
        DFlashTrainConfig(soft_label_weight=1.5)


@torch.no_grad()
def test_training_blocks_equal_drafting(target: CausalLM, dflash: DFlashDraftModel) -> None:
    seq = torch.randint(4, TINY_VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    anchors, ok = torch.tensor([[8, 13]]), torch.tensor([[True, True]])
    inputs, labels, _ = block_batch(seq, torch.tensor([20]), anchors, ok, BS, dflash.config.mask_token_id, 7.0)
    feats, _ = _states(target, seq, dflash.config.capture)
    logits = dflash.train_blocks(feats, target.embed(inputs), anchors, target.logits)  # [1, 2*BS, V]
    spec = SpeculativeConfig.resolve("DFLASH", "x", dflash_block_size=BS, num_draft_tokens=BS, tree="chain")
    for j, a in enumerate((8, 13)):
        drafter = DFlashDrafter(dflash, target, spec, SamplingParams(), None, 64)
        drafter.prefill(seq[0, :a].tolist(), feats[0, :a])
        expected = drafter.block_log_probs(int(seq[0, a]))  # [BS-1, V]
        got = torch.log_softmax(logits[0, j * BS + 1 : (j + 1) * BS], dim=-1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert labels[0, j * BS + 1 : (j + 1) * BS].tolist() == seq[0, a + 1 : a + BS].tolist()


# ---- a few steps on a fixed batch lower the loss ------------------------------------------------------------

def _fit(objective: Objective, batch: list[Example], steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW([p for p in objective.drafter.parameters() if p.requires_grad], lr=lr)
    losses = []
    for i in range(steps):
        out = objective.loss(batch, step_generator(0, 0, 0))  # same anchors every step: a fixed batch
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
        assert i or out.tokens == sum(len(e.tokens) for e in batch)
    return losses


def test_eagle3_steps_lower_the_loss(target: CausalLM) -> None:
    batch = _examples(3, 24, 6)
    obj = build_eagle3(target, batch, Eagle3TrainConfig(ttt_steps=3, draft_vocab_size=200, aux_layer_ids=AUX))
    assert obj.drafter.training and obj.drafter.config.draft_vocab_size == 200
    losses = _fit(obj, batch, 8, 3e-3)
    assert losses[-1] < 0.8 * losses[0], losses


def test_dflash_steps_lower_the_loss(target: CausalLM, tiny_dir: Path) -> None:
    batch = _examples(3, 24, 6)
    obj = build_dflash(target, tiny_dir, DFlashTrainConfig(block_size=BS, anchors_per_seq=6, num_layers=1))
    assert obj.drafter.config.mask_token_id == 3  # the tokenizer's <|mask|>
    losses = _fit(obj, batch, 8, 3e-3)
    assert losses[-1] < 0.8 * losses[0], losses


def test_dflash_distillation_steps_lower_the_loss(target: CausalLM, tiny_dir: Path) -> None:
    batch = _examples(3, 24, 6)
    obj = build_dflash(target, tiny_dir, DFlashTrainConfig(block_size=BS, anchors_per_seq=6, num_layers=1,
                                                           soft_label_weight=1.0))
    first = obj.loss(batch, step_generator(0, 0, 0)).loss.item()
    with torch.no_grad():  # the soft-label objective is another number than the hard one on the same batch
        hard = build_dflash(target, tiny_dir, DFlashTrainConfig(block_size=BS, anchors_per_seq=6, num_layers=1))
        hard.drafter.load_state_dict(obj.drafter.state_dict())
        assert abs(hard.loss(batch, step_generator(0, 0, 0)).loss.item() - first) > 1e-3
    losses = _fit(obj, batch, 8, 3e-3)
    assert losses[-1] < 0.8 * losses[0], losses


# ---- trainer parts ------------------------------------------------------------------------------------------

def test_warmup_cosine() -> None:
    f = WarmupCosine(4, 20, 0.1)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(12) == pytest.approx(0.55) and f(20) == pytest.approx(0.1) and f(99) == pytest.approx(0.1)


def test_batcher_shards_and_resumes() -> None:
    ranks = [Batcher(10, 2, DistContext(r, 2), seed=1) for r in range(2)]
    first = [b.next() for b in ranks]
    assert not set(first[0]) & set(first[1])
    for b in ranks:
        b.next()  # 8 of 10 used; the next global batch starts epoch 1
    again = Batcher(10, 2, DistContext(0, 2), seed=1)
    again.load_state_dict(ranks[0].state_dict())
    assert again.next() == ranks[0].next() and again.epoch == 1
    with pytest.raises(ValueError, match="--batch-size"):
        Batcher(3, 2, DistContext(0, 2), seed=0)


def test_failed_checkpoint_write_keeps_the_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.pt"
    ckpt.atomic_torch_save({"step": 1}, path)

    def disk_full(obj: object, fh: object) -> None:
        fh.write(b"partial")  # type: ignore[attr-defined]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(OSError, match="intact"):
        ckpt.atomic_torch_save({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1 and not (tmp_path / "checkpoint.pt.tmp").exists()

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("old")

    def broken(p: Path) -> None:
        p.mkdir()
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="intact"):
        ckpt.replace_dir(broken, tmp_path / "d")
    assert (tmp_path / "d" / "f").read_text() == "old"


def test_truncate_log_drops_records_after_the_checkpoint(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    ckpt.truncate_log(log, 4)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.parametrize(("line", "needle"), [
    ("{not json", "not valid JSON"),
    ('{"text": "x"}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"messages": [{"role": "user"}]}', "messages"),
])
def test_malformed_prompt_line_is_named(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f():"}\n\n' + line + '\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=f"p.jsonl:3: .*{needle}"):
        read_prompts(path)
    path.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}], "id": 7}\n')
    assert [p.where.endswith(f":{i}") for i, p in enumerate(read_prompts(path), 1)] == [True, True]
