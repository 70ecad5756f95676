"""GGUF files: tiny Llama/Qwen2 ones written like llama.cpp's converter writes them load to transformers' logits;
bad files fail with errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from specserve.engine.llm import LLM
from specserve.models.gguf_header import read_header
from specserve.models.loader import load_model, resolve_model_path
from specserve.types import SamplingParams
from tiny_gguf import reference_logits, write_gguf

from tiny import make_checkpoint

IDS = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 31, 8]


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("quant", ["Q4_1", "Q4_0", "Q8_0", "F16"])
def test_gguf_logits_match_transformers(tmp_path: Path, arch: str, quant: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", arch)
    gguf = write_gguf(ckpt, tmp_path / f"tiny-{quant}.gguf", quant)
    model, cfg, _ = load_model(str(gguf), torch.device("cpu"), torch.float32)
    assert cfg.architecture == arch
    with torch.no_grad():
        ours = model(torch.tensor([IDS]), torch.arange(len(IDS))[None]).logits[0]
    ref = reference_logits(gguf, IDS)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("quant", ["Q4_1", "Q4_0", "Q8_0", "F16"])
def test_header_reads_as_the_gguf_packages_reader(tmp_path: Path, llama_ckpt: Path, quant: str) -> None:
    """`read_header` (one pass over the bytes) against the `gguf` package's reader: every metadata value, every
    tensor's name, type, dimensions and bytes."""
    from gguf import GGUFReader

    gguf = write_gguf(llama_ckpt, tmp_path / "m.gguf", quant)
    ours = read_header(gguf)
    ref = GGUFReader(str(gguf))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == want
    assert any(isinstance(v, list) and v and isinstance(v[0], str) for v in want.values())  # the token list
    assert [(t.name, t.kind, t.dims) for t in ours.tensors] == \
           [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.data.tobytes() == b.data.tobytes(), a.name


def test_gguf_directory_is_cached_and_tokenizes(tmp_path: Path, llama_ckpt: Path) -> None:
    gguf = write_gguf(llama_ckpt, tmp_path / "m.gguf")
    first = resolve_model_path(str(gguf))
    assert resolve_model_path(str(gguf)) == first
    assert (first / "model.gguf").resolve() == gguf.resolve()
    llm = LLM(str(gguf), quantization="none", enforce_eager=True)
    from specserve.tokenizer import Tokenizer
    ref = Tokenizer(llama_ckpt)
    text = "def f(x):\n    return x + 12345  # digits"
    assert llm.tokenizer.encode(text) == ref.encode(text)  # the tiny tokenizer splits like GPT-2 ('gpt2' pre)
    out = llm.generate([IDS], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_tiny_gguf_decodes_close_to_dequantized(tmp_path: Path, llama_ckpt: Path, mode: str) -> None:
    gguf = write_gguf(llama_ckpt, tmp_path / "m.gguf")
    plain = LLM(str(gguf), quantization="none", enforce_eager=True)
    quant = LLM(str(gguf), quantization=mode, enforce_eager=True)
    assert quant.quantization == mode
    with torch.no_grad():
        for width in (1, 5, 11):  # a one-token step, a verify, a prefill
            ids = torch.tensor([IDS[:width]])
            pos = torch.arange(width)[None]
            a = plain.model(ids, pos).logits
            b = quant.model(ids, pos).logits
            scale = a.abs().max()
            assert (a - b).abs().max() < 0.05 * scale, (width, (a - b).abs().max(), scale)


def test_truncated_gguf_is_a_clear_error(tmp_path: Path, llama_ckpt: Path) -> None:
    gguf = write_gguf(llama_ckpt, tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_model(str(cut), torch.device("cpu"), torch.float32)


def test_unknown_tensor_type_is_named(tmp_path: Path, llama_ckpt: Path) -> None:
    gguf = write_gguf(llama_ckpt, tmp_path / "m.gguf", odd_tensor=("blk.0.attn_q.weight", GGMLQuantizationType.Q5_0))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has type Q5_0"):
        resolve_model_path(str(gguf))


def test_missing_metadata_is_named(tmp_path: Path, llama_ckpt: Path) -> None:
    gguf = write_gguf(llama_ckpt, tmp_path / "m.gguf", skip_meta=("block_count",))
    with pytest.raises(ValueError, match=r"lacks llama\.block_count"):
        resolve_model_path(str(gguf))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        resolve_model_path(str(bad))


def test_quantization_flag_is_checked(tmp_path: Path, llama_ckpt: Path) -> None:
    with pytest.raises(ValueError, match=r"--quantization 'int3'"):
        LLM(str(llama_ckpt), quantization="int3")
