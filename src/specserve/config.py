"""Frozen configuration dataclasses, validated at construction.

Only plain data lives here; every layer of the package may import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str, flag: str = "--dtype") -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"{flag} {name!r} is not supported; use one of auto, float32, float16, bfloat16"
        ) from None


def pick_device(name: str | None = None) -> torch.device:
    """`auto`/None picks CUDA when present, else CPU; anything else must exist."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; use auto, cpu or cuda[:N]") from None


@dataclass(frozen=True)
class RopeConfig:
    """RoPE as Hugging Face configs describe it (`rope_scaling` or `rope_parameters`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | dynamic | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "dynamic", "llama3", "yarn"):
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; "
                "supported: default, linear, dynamic, llama3, yarn"
            )
        if self.theta <= 0:
            raise ValueError("rope_theta must be positive")

    def to_hf(self) -> dict[str, Any]:
        """The config.json fields that describe this RoPE (`rope_theta`, `rope_scaling`, ...)."""
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_scaling": None}
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_type == "default":
            return out
        scaling: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.original_max_position_embeddings is not None:
            scaling["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            scaling.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            scaling.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, name) is not None:
                    scaling[name] = getattr(self, name)
        out["rope_scaling"] = scaling
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face Llama/Qwen2/Qwen3 `config.json` that the model code reads."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and Llama's o) projections carry a bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads "
                f"({self.num_attention_heads} vs {self.num_key_value_heads})"
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no `architectures` entry")
        arch = archs[0]
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        bias = bool(raw.get("attention_bias", is_qwen2))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            # Qwen2 puts a bias on q/k/v only; Llama's attention_bias covers o_proj too.
            o_proj_bias=bias and arch == "LlamaForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=_rope_from_hf(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_hf(raw)
        except KeyError as e:
            raise ValueError(f"{path}: missing field {e}") from None


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    orig = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = raw.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if rope_type == "dynamic" and orig is None:
        orig = raw.get("max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        original_max_position_embeddings=orig,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=float(
            params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        ),
    )


ALGORITHMS = ("NONE", "NGRAM", "SUFFIX", "STANDALONE", "EAGLE3", "DFLASH")
#: algorithms that draft without weights (no --speculative-draft-model-path)
MODEL_FREE = ("NGRAM", "SUFFIX")
TREES = ("chain", "eagle", "ddtree")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding flags, named as SGLang names them.

    Construct with `SpeculativeConfig.resolve(...)` to fill the defaults users expect;
    the constructor itself only validates.
    num_draft_tokens is the verify width with the root included, except for DDTree where
    it is the node budget B (root excluded), as the DDTree paper counts it.
    """

    algorithm: str = "NONE"
    draft_model_path: str | None = None
    num_steps: int = 0
    eagle_topk: int = 1
    num_draft_tokens: int = 1
    dflash_block_size: int | None = None
    tree: str = "chain"
    ngram_min_match: int = 1
    ngram_max_match: int = 8
    ngram_max_breadth: int = 4
    # SUFFIX, named after vLLM's suffix_decoding_* settings
    suffix_max_tree_depth: int = 24
    suffix_max_cached_requests: int = 1000
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        a = self.algorithm
        if a not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm {a!r} is not known; use one of {', '.join(ALGORITHMS)}")
        if self.tree not in TREES:
            raise ValueError(f"--speculative-tree {self.tree!r} is not known; use one of {', '.join(TREES)}")
        if a == "NONE":
            return
        if a == "SUFFIX":
            self._check_suffix()  # before the shared checks: its depth flag is the one to name
        if a in ("STANDALONE", "EAGLE3", "DFLASH") and not self.draft_model_path:
            raise ValueError(f"--speculative-algorithm {a} needs --speculative-draft-model-path")
        if self.eagle_topk < 1:
            raise ValueError("--speculative-eagle-topk must be >= 1")
        if self.num_steps < 1:
            raise ValueError("--speculative-num-steps must be >= 1")
        if self.num_draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens must be >= 2 (the root plus at least one draft)")
        if self.tree == "ddtree" and a != "DFLASH":
            raise ValueError(
                "--speculative-tree ddtree needs --speculative-algorithm DFLASH (DDTree is built from a DFlash block)"
            )
        if a == "DFLASH":
            bs = self.dflash_block_size or 16
            if bs < 2:
                raise ValueError("--speculative-dflash-block-size must be >= 2")
            if self.eagle_topk != 1 or self.num_steps != 1:
                raise ValueError(
                    "DFLASH drafts one block per forward: leave --speculative-eagle-topk and "
                    "--speculative-num-steps at 1 (use --speculative-tree ddtree for a tree)"
                )
            if self.tree == "eagle":
                raise ValueError("DFLASH builds trees with --speculative-tree ddtree, not eagle")
            if self.tree == "chain" and self.num_draft_tokens > bs:
                raise ValueError(
                    f"--speculative-num-draft-tokens {self.num_draft_tokens} is larger than the block allows: "
                    f"a DFLASH chain verifies at most --speculative-dflash-block-size ({bs}) tokens"
                )
            return
        if a == "NGRAM":
            if not 1 <= self.ngram_min_match <= self.ngram_max_match:
                raise ValueError("need 1 <= --speculative-ngram-min-match <= --speculative-ngram-max-match")
            if self.ngram_max_breadth < 1:
                raise ValueError("--speculative-ngram-max-breadth must be >= 1")
            return
        if a == "SUFFIX":
            return
        if self.tree == "chain" or self.eagle_topk == 1:
            if self.eagle_topk != 1:
                raise ValueError("--speculative-tree chain needs --speculative-eagle-topk 1")
            if self.num_draft_tokens != self.num_steps + 1:
                raise ValueError(
                    f"with --speculative-eagle-topk 1 (a chain) --speculative-num-draft-tokens must be "
                    f"--speculative-num-steps + 1 = {self.num_steps + 1}, got {self.num_draft_tokens}"
                )
        else:
            cap = self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
            if self.num_draft_tokens - 1 > cap:
                raise ValueError(
                    f"--speculative-num-draft-tokens {self.num_draft_tokens} is too large for a tree of "
                    f"--speculative-num-steps {self.num_steps} and --speculative-eagle-topk {self.eagle_topk}: "
                    f"at most topk + (steps-1)*topk^2 + 1 = {cap + 1}"
                )

    def _check_suffix(self) -> None:
        if self.suffix_max_tree_depth < 1:
            raise ValueError(f"--speculative-suffix-max-tree-depth must be >= 1 (tokens drafted past the match), "
                             f"got {self.suffix_max_tree_depth}")
        if self.num_steps != self.suffix_max_tree_depth:
            raise ValueError(f"SUFFIX takes its draft depth from --speculative-suffix-max-tree-depth "
                             f"({self.suffix_max_tree_depth}); leave --speculative-num-steps unset "
                             f"(got {self.num_steps})")
        if self.eagle_topk != 1:
            raise ValueError("SUFFIX branches where its matches do (--speculative-tree eagle): leave "
                             "--speculative-eagle-topk at 1")
        if self.suffix_max_cached_requests < 0:
            raise ValueError(f"--speculative-suffix-max-cached-requests must be >= 0 (0: no cache across requests), "
                             f"got {self.suffix_max_cached_requests}")
        if not self.suffix_max_spec_factor > 0:
            raise ValueError(f"--speculative-suffix-max-spec-factor must be > 0 (tokens drafted per matched token), "
                             f"got {self.suffix_max_spec_factor}")
        if not 0 <= self.suffix_min_token_prob <= 1:
            raise ValueError(f"--speculative-suffix-min-token-prob must be within [0, 1], "
                             f"got {self.suffix_min_token_prob}")

    @property
    def enabled(self) -> bool:
        return self.algorithm != "NONE"

    @classmethod
    def resolve(
        cls,
        algorithm: str | None = None,
        draft_model_path: str | None = None,
        num_steps: int | None = None,
        eagle_topk: int | None = None,
        num_draft_tokens: int | None = None,
        dflash_block_size: int | None = None,
        tree: str | None = None,
        **ngram: Any,
    ) -> SpeculativeConfig:
        """Fill unset flags with the defaults users expect, then validate. `ngram`: the ngram_* and suffix_*
        fields."""
        a = (algorithm or "NONE").upper()
        if a == "NONE":
            return cls()
        if a == "DFLASH":
            bs = dflash_block_size or 16
            t = tree or "ddtree"
            default_draft = bs
            return cls(a, draft_model_path, num_steps or 1, eagle_topk or 1,
                       num_draft_tokens or default_draft, bs, t, **ngram)
        if a == "NGRAM":
            nd = num_draft_tokens or 12  # SGLang's default
            # NGRAM's "eagle" tree is a trie of up to ngram_max_breadth lookup matches; a depth
            # of half the budget leaves room for the other matches' branches.
            t = tree or "eagle"
            depth = num_steps or (nd - 1 if t == "chain" else max(1, nd // 2))
            return cls(a, draft_model_path, depth, eagle_topk or 1, nd, None, t,
                       **ngram)
        if a == "SUFFIX":
            depth = int(ngram.get("suffix_max_tree_depth", cls.suffix_max_tree_depth))
            # vLLM verifies up to the tree depth; 16 drafts keep a CPU verify forward affordable
            nd = num_draft_tokens or min(depth, 16) + 1
            return cls(a, draft_model_path, num_steps or depth, eagle_topk or 1, nd, None, tree or "eagle", **ngram)
        topk = eagle_topk or 1
        if topk == 1:
            steps = num_steps or (num_draft_tokens - 1 if num_draft_tokens else (5 if a == "EAGLE3" else 4))
            return cls(a, draft_model_path, steps, 1, num_draft_tokens or steps + 1, None, tree or "chain",
                       **ngram)
        steps = num_steps or 5
        return cls(a, draft_model_path, steps, topk, num_draft_tokens or 8, None, tree or "eagle", **ngram)
