"""Plain data shared by every layer: sampling parameters (with an optional output grammar) and generation results."""

from __future__ import annotations

from dataclasses import dataclass, field

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output. kind: `json_schema` (spec: the schema as JSON text), `json_object` (any JSON
    object; spec unused), `regex`, or `lark` (a Lark grammar in llguidance's dialect, which also embeds JSON
    schemas as `%json{...}`). Compiled and checked by the engine (`engine/grammar.py`)."""

    kind: str
    spec: str = ""
    compact: bool = False  # JSON kinds: separators fixed to ", " and ": ", no other whitespace (strict schemas)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind {self.kind!r} is not known; use one of {', '.join(GRAMMAR_KINDS)}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} grammar needs its text")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy (argmax)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None  # constrained decoding: every token must keep the output inside it

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"--min-p must be in [0, 1), got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("--stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    prompt_tokens: int
    elapsed_s: float
    # speculative statistics (plain decoding: one verify step per token, accept length 1)
    num_verify_steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    accept_per_position: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0
