"""What an SGLang or vLLM release can run, by version: the rules `bench tune` applies before launching a
configuration and `deploy freeze --engine` applies before writing one.

Each rule names the releases it was checked in (the wheels' own sources, see RULE_SOURCES). A release at or below
`absent_through` lacks the feature, one at or above `present_from` has it, one between the two was not checked: the
feature is assumed present and a note says so. A configuration a release cannot run is skipped (tune) or refused
(freeze) with the reason, never launched to crash.

    verdict = judge("sglang", "0.5.10", spec, page_size=1, adaptive=False)
    verdict.skip   # "SGLang 0.5.10 has no DFLASH ..." or None
    verdict.rejected  # True: its parser refuses the command; False with a skip: it runs, but not what was asked
    verdict.notes  # what the engine does with the configuration (overlap path, fallbacks)
    verdict.env    # environment the launch needs (e.g. SGLANG_ENABLE_SPEC_V2=True on 0.5.6-0.5.10)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specserve.config import SpeculativeConfig

NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
#: the newest release of each engine the rules were checked against; an unknown version is judged as this one
NEWEST = {"sglang": "0.5.23", "vllm": "0.33.0"}
RULE_SOURCES = {
    "sglang 0.5.10": "PyPI sglang 0.5.10 wheel: srt/server_args.py (--speculative-algorithm choices EAGLE, EAGLE3, "
                     "NEXTN, STANDALONE, NGRAM; no --speculative-adaptive; spec v2 only with SGLANG_ENABLE_SPEC_V2, "
                     "which raises 'Spec v2 currently only supports topk = 1' for topk > 1, else the overlap "
                     "scheduler is disabled for speculative decoding)",
    "sglang 0.5.23": "PyPI sglang 0.5.23 wheel: srt/arg_groups/fields/spec.py (DFLASH, speculative_adaptive), "
                     "arg_groups/speculative_hook.py (spec v2 drives overlap and non-overlap; topk > 1 with page "
                     "size > 1 only on the flashinfer/fa3/triton attention backends), speculative/"
                     "adaptive_spec_params.py (adaptive: EAGLE/EAGLE3 with topk 1 only)",
    "vllm 0.33.0": "PyPI vllm 0.33.0 wheel: config/speculative.py (methods incl. dflash; no speculative_token_tree: "
                   "chains only; older releases took a static speculative_token_tree for EAGLE trees)",
}


def parse_version(text: str) -> tuple[int, ...]:
    """'0.5.23' -> (0, 5, 23); '0.5.10.post1', 'v0.33.0+cu128' and '0.5.23rc1' keep their leading numbers."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", text.strip())
    if not m:
        raise ValueError(f"--engine-version {text!r}: expected a release number such as 0.5.23")
    return tuple(int(x) for x in m.group(1).split("."))


@dataclass(frozen=True)
class Feature:
    engine: str
    what: str
    absent_through: str | None  # newest checked release without it
    present_from: str  # oldest checked release with it

    def status(self, version: str) -> str:
        """'absent', 'present' or 'unchecked' (between the two checked releases)."""
        v = parse_version(version)
        if self.absent_through is not None and v <= parse_version(self.absent_through):
            return "absent"
        return "present" if v >= parse_version(self.present_from) else "unchecked"


SGLANG_DFLASH = Feature("sglang", "--speculative-algorithm DFLASH", "0.5.10", "0.5.23")
SGLANG_ADAPTIVE = Feature("sglang", "--speculative-adaptive", "0.5.10", "0.5.23")
SGLANG_SPEC_V2_TREES = Feature("sglang", "topk > 1 on the overlap (spec v2) path", "0.5.10", "0.5.23")
VLLM_DFLASH = Feature("vllm", 'method "dflash"', None, "0.33.0")
SPEC_V2_ENV_FROM = "0.5.6"  # SGLANG_ENABLE_SPEC_V2 opts in to the overlap path from 0.5.6 through 0.5.10


@dataclass(frozen=True)
class Verdict:
    skip: str | None  # why this release cannot run the configuration as asked; None = it can
    notes: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    rejected: bool = False  # the release's parser refuses the command (else it would run something other than asked)


def _check(feature: Feature, version: str, notes: list[str]) -> str | None:
    """The skip reason when `version` lacks the feature; a note when it was not checked."""
    name = f"{NAMES[feature.engine]} {version}"
    status = feature.status(version)
    if status == "absent":
        return (f"{name} has no {feature.what} (absent through {feature.absent_through}, present from "
                f"{feature.present_from})")
    if status == "unchecked":
        notes.append(f"{name}: {feature.what} is assumed (checked absent in {feature.absent_through}, present in "
                     f"{feature.present_from})")
    return None


def judge(engine: str, version: str | None, spec: SpeculativeConfig, page_size: int = 1,
          adaptive: bool = False) -> Verdict:
    """Whether `engine` at `version` runs `spec` (with `page_size` tokens per KV page and, for SGLang, adaptive
    speculation on or off), and what it does with it. `version` None = NEWEST[engine] (callers say so)."""
    if engine not in NAMES:
        raise ValueError(f"--engine {engine!r}: use one of {', '.join(NAMES)}")
    notes: list[str] = []
    version = version or NEWEST[engine]
    parse_version(version)
    if not spec.enabled:
        return Verdict(None, tuple(notes))
    return _sglang(version, spec, page_size, adaptive, notes) if engine == "sglang" else _vllm(version, spec, notes)


def _sglang(version: str, spec: SpeculativeConfig, page_size: int, adaptive: bool, notes: list[str]) -> Verdict:
    name = f"SGLang {version}"
    if spec.algorithm not in ("EAGLE3", "STANDALONE", "NGRAM", "DFLASH"):
        return Verdict(f"{name} has no {spec.algorithm} speculative algorithm", tuple(notes), rejected=True)
    if spec.algorithm == "DFLASH":
        reason = _check(SGLANG_DFLASH, version, notes)
        if reason:
            return Verdict(reason, tuple(notes), rejected=True)
        if spec.tree == "ddtree":
            return Verdict(f"{name} verifies the DFlash block as a chain: DDTree (tree=ddtree) is specserve's",
                           tuple(notes))
    if adaptive and spec.algorithm == "EAGLE3" and spec.eagle_topk == 1:
        reason = _check(SGLANG_ADAPTIVE, version, notes)
        if reason:
            return Verdict(reason, tuple(notes), rejected=True)
    env: list[tuple[str, str]] = []
    if spec.algorithm in ("EAGLE3", "STANDALONE"):
        trees = SGLANG_SPEC_V2_TREES.status(version)
        tree = spec.eagle_topk > 1
        if trees == "absent":
            if parse_version(version) < parse_version(SPEC_V2_ENV_FROM):
                notes.append(f"{name} runs speculative decoding without the overlap scheduler")
            elif tree:
                notes.append(f"{name}: topk {spec.eagle_topk} runs on the non-overlap path (its spec v2 raises "
                             "ValueError for topk > 1, so SGLANG_ENABLE_SPEC_V2 is left unset)")
            else:
                env.append(("SGLANG_ENABLE_SPEC_V2", "True"))
                notes.append(f"{name}: the overlap (spec v2) path is opt-in: SGLANG_ENABLE_SPEC_V2=True")
        elif tree and page_size > 1:
            notes.append(f"{name}: topk {spec.eagle_topk} with page size {page_size} falls back to the non-overlap "
                         "path and needs the flashinfer, fa3 or triton attention backend (use page size 1 for the "
                         "overlap path)")
        elif tree:
            _check(SGLANG_SPEC_V2_TREES, version, notes)
            notes.append(f"{name}: topk {spec.eagle_topk} with page size 1 runs on the overlap (spec v2) path")
    if spec.algorithm == "NGRAM" and spec.tree == "chain":
        notes.append(f"{name}'s NGRAM verifies a BFS tree of matches (up to --speculative-ngram-max-bfs-breadth), "
                     "not a chain")
    return Verdict(None, tuple(notes), tuple(env))


def _vllm(version: str, spec: SpeculativeConfig, notes: list[str]) -> Verdict:
    name = f"vLLM {version}"
    if spec.algorithm not in ("EAGLE3", "STANDALONE", "NGRAM", "DFLASH", "SUFFIX"):
        return Verdict(f"{name} has no {spec.algorithm} method", tuple(notes), rejected=True)
    if spec.algorithm == "DFLASH":
        reason = _check(VLLM_DFLASH, version, notes)
        if reason:
            return Verdict(reason, tuple(notes), rejected=True)
    if spec.algorithm != "SUFFIX" and (spec.eagle_topk > 1 or spec.tree != "chain"):
        what = f"topk {spec.eagle_topk}" if spec.eagle_topk > 1 else f"tree={spec.tree}"
        return Verdict(f"{name} drafts chains only ({what} asked): EAGLE trees ran only with a static "
                       "speculative_token_tree, which 0.33.0 no longer has and specserve does not generate",
                       tuple(notes))
    return Verdict(None, tuple(notes))
