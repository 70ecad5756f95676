"""`bench acceptance --base-url URL`: accept length per task through a running server (specserve, SGLang, vLLM),
the same report as the offline command, without the plain-decoding run (speedup is not measured here).

Each task is one request, sent one at a time (greedy or sampled, `ignore_eos`, max_tokens = --max-new-tokens).
Its figures, first found wins (`--source auto`):
  response  a `meta_info` extension with SGLang's names, on the choice (specserve) or the body (SGLang's native
            /generate): `spec_verify_ct`, `spec_accept_length` (else completion_tokens / spec_verify_ct, SGLang's
            rule), `spec_accept_per_position` (verify rounds that accepted draft i+1), `completion_tokens`;
  metrics   Prometheus counters scraped before and after the request (`server_probe`): specserve's
            specserve_spec_accept_length summary and per-position counters, vLLM's
            spec_decode_num_accepted_tokens_total / num_drafts_total (+ per position), SGLang's
            sglang:spec_accept_length gauge (no verify-step count: the task's mean is the gauge).
A task's accept length pools its verify steps; the summary pools all tasks' steps, as the offline report does.
The loop measure needs token ids: they come from the tokenizer of `--tokenizer` (or of the served model when
it is `demo` or a local directory), else it is null, and so are the non-looping figures and the headline.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from specserve.bench.acceptance import repeated_ngram_fraction
from specserve.bench.by_kind import LOOP_THRESHOLD, kind_summary, pooled_accept
from specserve.bench.server_probe import (
    accept_length_from_metrics,
    accepted_per_position_from_metrics,
    parse_prometheus,
    verify_steps_from_metrics,
)
from specserve.bench.suites import Task
from specserve.tokenizer import Tokenizer

SOURCES = ("auto", "response", "metrics")


@dataclass(frozen=True)
class RemoteConfig:
    base_url: str
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    model: str | None = None  # the served model name (default: the first of /v1/models)
    api_key: str | None = None
    source: str = "auto"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"--source {self.source!r}: use one of {', '.join(SOURCES)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r}: expected http://HOST:PORT")


@dataclass(frozen=True)
class Figures:
    new_tokens: int
    accept_length: float
    verify_steps: float | None  # None: the server gave a mean only (SGLang's gauge)
    accepted_per_position: list[float]  # accepted drafts per position (counts), first position first
    text: str
    seconds: float
    source: str
    prompt_tokens: int | None = None


class RemoteServer:
    """One server, asked one request at a time."""

    def __init__(self, cfg: RemoteConfig) -> None:
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = httpx.Client(timeout=cfg.timeout_s, headers=headers)
        try:
            models = self.client.get(self.url + "/v1/models", timeout=10.0)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {self.url} ({type(e).__name__}): start the server or fix the "
                             "base URL") from None
        if models.status_code != 200:
            raise ValueError(f"{self.url}/v1/models answered {models.status_code}: check the URL and --api-key")
        data = models.json().get("data") or [{}]
        self.model = cfg.model or str(data[0].get("id", ""))
        info = self.client.get(self.url + "/server_info", timeout=10.0)
        self.info: dict[str, Any] = info.json() if info.status_code == 200 else {}

    def close(self) -> None:
        self.client.close()

    def _metrics(self) -> dict[str, float] | None:
        r = self.client.get(self.url + "/metrics", timeout=30.0)
        return parse_prometheus(r.text) if r.status_code == 200 else None

    def _request(self, task: Task) -> tuple[int | None, str, int, dict[str, Any] | None]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.cfg.max_new_tokens, "ignore_eos": True,
                                "temperature": self.cfg.temperature, "seed": self.cfg.seed, "stream": False}
        if task.messages is not None:
            r = self.client.post(self.url + "/v1/chat/completions", json={**body, "messages": task.messages})
        else:
            r = self.client.post(self.url + "/v1/completions", json={**body, "prompt": task.prompt})
        if r.status_code != 200:
            raise ValueError(f"{self.url}: task {task.name!r} answered {r.status_code}: {r.text[:200]}")
        out = r.json()
        choice = (out.get("choices") or [{}])[0]
        text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content") or ""
        usage = out.get("usage") or {}
        tokens = int(usage.get("completion_tokens") or 0)
        meta = choice.get("meta_info") or out.get("meta_info")
        return usage.get("prompt_tokens"), str(text), tokens, meta if isinstance(meta, dict) else None

    def figures(self, task: Task) -> Figures:
        use_metrics = self.cfg.source == "metrics"
        before = self._metrics() if self.cfg.source != "response" else None
        t0 = time.perf_counter()
        prompt, text, tokens, meta = self._request(task)
        seconds = time.perf_counter() - t0
        if meta and meta.get("spec_verify_ct") and not use_metrics:
            steps = float(meta["spec_verify_ct"])
            done = int(meta.get("completion_tokens") or tokens)
            accept = float(meta["spec_accept_length"]) if "spec_accept_length" in meta else done / steps
            per = [float(x) for x in meta.get("spec_accept_per_position") or []]
            return Figures(done, accept, steps, per, text, seconds, "response:meta_info", prompt)
        after = self._metrics() if before is not None else None
        if before is not None and after is not None:
            mean, name = accept_length_from_metrics(before, after)
            if mean is not None:
                counted = verify_steps_from_metrics(before, after)
                per = accepted_per_position_from_metrics(before, after)
                return Figures(tokens, mean, counted, per, text, seconds, f"metrics:{name}", prompt)
        algorithm = ((self.info.get("speculative") or {}).get("algorithm") or "").upper()
        if meta and "spec_verify_ct" in meta and algorithm not in ("", "NONE"):
            why = ("its adaptive policy verified no drafts for it (spec_verify_ct 0: at this batch size the cost "
                   "profile found no draft width that pays)" if self.info.get("speculative_adaptive")
                   else "it verified no drafts for it (spec_verify_ct 0)")
            raise ValueError(f"{self.url} runs {algorithm}, but for task {task.name!r} {why}; to measure acceptance, "
                             "restart the server with --no-speculative-adaptive (every step verifies its drafts)")
        hint = "" if self.cfg.source == "response" else " nor in /metrics"
        raise ValueError(f"{self.url} reports no speculation (no spec_* figures in the response's meta_info{hint}): "
                         "start it with --speculative-algorithm, or point --base-url at a speculative server")


def _tokenizer(name: str | None) -> Tokenizer | None:
    if not name:
        return None
    from specserve.models.loader import resolve_model_path

    try:
        return Tokenizer(resolve_model_path(name))
    except (ValueError, OSError):
        return None


def _task_entry(task: Task, f: Figures, tok: Tokenizer | None, ref: Figures | None) -> dict[str, Any]:
    steps = f.verify_steps
    per = [round(c / steps, 4) for c in f.accepted_per_position] if steps else []
    ref_len = round(ref.accept_length, 4) if ref else None
    return {
        "name": task.name, "prompt_tokens": f.prompt_tokens, "new_tokens": f.new_tokens,
        "accept_length": round(f.accept_length, 4),
        "accept_per_position": per, "verify_steps": None if steps is None else int(steps),
        "plain_tokens_per_s": None, "spec_tokens_per_s": round(f.new_tokens / f.seconds, 2) if f.seconds else None,
        "speedup": None, "loop_4gram": round(repeated_ngram_fraction(tok.encode(f.text)), 4) if tok else None,
        "identical_to_plain": None, "reference_accept_length": ref_len,
        "percent_of_reference": round(100 * f.accept_length / ref.accept_length, 2) if ref and ref.accept_length
        else None, "source": f.source, "kind": task.kind,
    }


def _pooled(figs: list[Figures]) -> float:
    """The tasks' accept length pooled over their verify steps (`by_kind.pooled_accept`)."""
    pooled = pooled_accept([{"accept_length": f.accept_length, "verify_steps": f.verify_steps} for f in figs])
    assert pooled is not None  # a suite holds at least one task (`suites.load_suite`)
    return pooled


def run_remote_acceptance(tasks: list[Task], cfg: RemoteConfig, reference: RemoteConfig | None = None,
                          tokenizer: str | None = None, progress: bool = True,
                          loop_threshold: float = LOOP_THRESHOLD) -> dict[str, Any]:
    """The acceptance report of the server at cfg.base_url (and of a reference server, task by task)."""
    server = RemoteServer(cfg)
    ref_server = RemoteServer(reference) if reference else None
    try:
        tok = _tokenizer(tokenizer or server.model)
        rows, figs, ref_figs = [], [], []
        bar = tqdm(tasks, desc="acceptance", unit="task", disable=None if progress else True, file=sys.stderr)
        for task in bar:  # (no bar where stderr is not a terminal)
            f = server.figures(task)
            r = ref_server.figures(task) if ref_server else None
            figs.append(f)
            ref_figs += [r] if r else []
            rows.append(_task_entry(task, f, tok, r))
    finally:
        server.close()
        if ref_server:
            ref_server.close()
    accept = _pooled(figs)
    loops = [r["loop_4gram"] for r in rows if r["loop_4gram"] is not None]
    seconds = sum(f.seconds for f in figs)
    summary: dict[str, Any] = {"tasks": len(rows), "accept_length": round(accept, 4),
                               "spec_tokens_per_s": round(sum(f.new_tokens for f in figs) / seconds, 2),
                               "loop_4gram": round(sum(loops) / len(loops), 4) if loops else None,
                               "source": sorted({f.source for f in figs})}
    summary.update(kind_summary(rows, loop_threshold))
    if ref_figs:
        ref_accept = _pooled(ref_figs)
        summary["reference_accept_length"] = round(ref_accept, 4)
        summary["percent_of_reference"] = round(100 * accept / ref_accept, 2)
    spec = server.info.get("speculative") if isinstance(server.info.get("speculative"), dict) else None
    return {
        "kind": "acceptance", "schema_version": 1,
        "config": {"base_url": server.url, "model": server.model, "speculative": spec,
                   "reference_base_url": ref_server.url if ref_server else None,
                   "sampling": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                                "seed": cfg.seed, "ignore_eos": True},
                   "source": cfg.source, "server_info": server.info or None},
        "summary": summary,
        "tasks": rows,
    }
