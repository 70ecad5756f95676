"""production.md: what runs, how it starts, what was measured, what that means, how to operate it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specserve.deploy.evidence import AcceptanceRun, Evidence, ServingRun, known_limits
from specserve.server.serve_config import ServeConfig

FLAG_ROLE = {
    "speculative_algorithm": "drafting method (NONE = plain decoding; NGRAM = continuations of n-grams already in "
                             "the context, no drafter weights; SUFFIX = continuations of the longest match in the "
                             "context and in recent requests' outputs, no drafter weights; STANDALONE = a small "
                             "draft LM; EAGLE3 = a one-layer head on the target's hidden states; DFLASH = a block "
                             "drafter, one forward per block)",
    "speculative_draft_model_path": "drafter checkpoint; its files are hash-checked at every start",
    "speculative_num_steps": "draft depth: drafting steps per round",
    "speculative_eagle_topk": "branching per drafting step (1 = a chain)",
    "speculative_num_draft_tokens": "verify width per round, root included (ddtree: node budget, root excluded)",
    "speculative_dflash_block_size": "tokens one DFlash forward drafts",
    "speculative_tree": "what one verify forward checks: chain, eagle (top-k tree) or ddtree (best-first tree "
                        "over the DFlash block's per-position distributions)",
    "speculative_ngram_min_match": "shortest context suffix NGRAM looks up",
    "speculative_ngram_max_match": "longest context suffix NGRAM looks up",
    "speculative_ngram_max_breadth": "matches NGRAM merges into one draft tree",
    "speculative_suffix_max_tree_depth": "most tokens SUFFIX drafts past its match",
    "speculative_suffix_max_cached_requests": "finished requests' outputs SUFFIX keeps to match against (LRU; 0 = "
                                              "the request's own context only)",
    "speculative_suffix_max_spec_factor": "tokens SUFFIX drafts per matched token (capped by the depth)",
    "speculative_suffix_min_token_prob": "least empirical probability of a continuation SUFFIX drafts",
    "speculative_adaptive": "per step, verify as many drafts as pay at the current batch size (or none), from a "
                            "measured cost profile",
    "speculative_adaptive_profile": "the saved cost profile; measured again and rewritten when missing or stale",
}


@dataclass(frozen=True)
class DeploySummary:
    """Where the frozen deployment lives and how it starts (paths as they will be on the server)."""

    directory: str
    config_file: str
    exec_start: str
    foreground: str
    service: str
    health_url: str
    info_url: str
    user: str
    model_dir: str
    drafter_dir: str | None
    hashes: dict[str, dict[str, str]]  # "model" / "drafter" -> {file: sha256}
    cache_dir: str = "/var/cache/specserve"  # the unit's CacheDirectory (XDG_CACHE_HOME of the service)


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _pair(a: float | None, b: float | None) -> str:
    return f"{_f(a)} / {_f(b)}"


def _run_line(kind: str, run: ServingRun | None) -> str:
    if run is None:
        return f"- {kind}: not given"
    b = run.bench
    return (f"- {kind}: `{run.path.name}` ({run.label}; model `{b.get('model', '-')}`, dataset "
            f"{run.dataset or '-'}, {b.get('num_prompts', '-')} prompts per level, output length "
            f"{b.get('output_len', '-')}, "
            f"temperature {b.get('temperature', '-')}, device {run.device or '-'})")


def _flag_rows(frozen: dict[str, Any], explicit: set[str], ev: Evidence) -> list[str]:
    rows = ["| flag | value | what it does | where the value comes from |", "|---|---|---|---|"]
    algo = str(frozen.get("speculative_algorithm", "NONE"))
    tuned = ev.tune.frozen_config if ev.tune is not None else None
    for dest, value in frozen.items():
        if not dest.startswith("speculative_"):
            continue
        source = "set in the source serve.yaml" if dest in explicit else f"specserve's default for {algo}"
        if tuned is not None:
            source += f"; `bench tune` config `{tuned}`"
        rows.append(f"| `--{dest.replace('_', '-')}` | `{value}` | {FLAG_ROLE.get(dest, '-')} | {source} |")
    return rows


def _why(ev: Evidence, speculative: bool) -> list[str]:
    lines: list[str] = []
    gains = [r for r in ev.rows if r.ratio is not None]
    if speculative and gains:
        parts = [f"{r.ratio:.2f}x at concurrency {r.concurrency}" for r in gains]
        lines.append(f"Measured output throughput against plain decoding: {', '.join(parts)}.")
    if ev.tune is not None:
        for w in ev.tune.winners:
            lines.append(f"`bench tune` winner at concurrency {w.get('concurrency')}: `{w.get('config')}` "
                         f"({_f(w.get('output_tok_s'))} tok/s, {_f(w.get('ratio_to_baseline'), '.2f')}x baseline).")
        if ev.tune.frozen_config is None and speculative:
            lines.append("The frozen flags match none of the tuned configurations.")
    return lines or ["No benchmark evidence was given with this configuration."]


def _acceptance(run: AcceptanceRun) -> list[str]:
    lines = [f"From `{run.path.name}` (model `{run.config.get('model', '-')}`, device "
             f"{run.config.get('device', '-')}):", "",
             "| task | accept length | speedup over plain | speculative tok/s | plain tok/s |", "|---|---|---|---|---|"]
    for t in run.tasks:
        lines.append(f"| {t.get('name')} | {_f(t.get('accept_length'), '.2f')} | {_f(t.get('speedup'), '.2f')}x | "
                     f"{_f(t.get('spec_tokens_per_s'))} | {_f(t.get('plain_tokens_per_s'))} |")
    s = run.summary
    if s:
        lines.append(f"| **all tasks** | {_f(s.get('accept_length'), '.2f')} | {_f(s.get('speedup'), '.2f')}x | "
                     f"{_f(s.get('spec_tokens_per_s'))} | {_f(s.get('plain_tokens_per_s'))} |")
    return [*lines, ""]


def render_production(cfg: ServeConfig, frozen: dict[str, Any], explicit: set[str], ev: Evidence,
                      d: DeploySummary, source_config: str, generated_at: str) -> str:
    spec = cfg.speculative
    svc = d.service
    lines = [f"# Production deployment: `{cfg.model_name}` ({spec.algorithm})", "",
             f"Frozen by `specserve deploy freeze` on {generated_at} from `{source_config}`. Directory on the "
             f"server: `{d.directory}`.", "", "## What runs", "",
             f"- model: `{cfg.model}` -> `{d.model_dir}` ({len(d.hashes['model'])} files, sha256-pinned)",
             "- drafter: " + (f"`{spec.draft_model_path}` -> `{d.drafter_dir}` "
                               f"({len(d.hashes.get('drafter', {}))} files, sha256-pinned)"
                               if d.drafter_dir else "none"),
             f"- served as `{cfg.model_name}` on `{cfg.host}:{cfg.port}`, device `{cfg.device}`, dtype `{cfg.dtype}`, "
             f"queue limit {cfg.max_queue}, tool-call parser `{cfg.tool_call_parser or 'none'}`, API key "
             f"{'required (SPECSERVE_API_KEY in specserve.env)' if cfg.api_key else 'not required'}",
             f"- runs as user `{d.user}`; in-flight requests get {cfg.shutdown_timeout:g} s to finish on stop",
             *_engine_lines(cfg, frozen, d), "",
             "### Speculative flags and why", "", *_flag_rows(frozen, explicit, ev), "", *_why(ev, spec.enabled), "",
             "## Start command", "", f"`{svc}.service` runs exactly:", "", "```", d.exec_start, "```", "",
             "In the foreground (debugging), with the same environment:", "", "```", d.foreground, "```", "",
             "## Measured against plain decoding", ""]
    lines += [_run_line("plain decoding", ev.baseline), _run_line("this configuration", ev.speculative), ""]
    if ev.rows:
        lines += ["| concurrency | plain tok/s | speculative tok/s | ratio | TTFT p50 ms (plain / spec) | "
                  "TPOT p50 ms (plain / spec) | accept length |", "|---|---|---|---|---|---|---|"]
        for r in ev.rows:
            lines.append(f"| {r.concurrency} | {_f(r.plain_tok_s)} | {_f(r.spec_tok_s)} | "
                         f"{_f(r.ratio, '.2f')}{'x' if r.ratio is not None else ''} | "
                         f"{_pair(r.ttft_plain_ms, r.ttft_spec_ms)} | {_pair(r.tpot_plain_ms, r.tpot_spec_ms)} | "
                         f"{_f(r.accept_length, '.2f')} |")
        lines.append("")
    else:
        lines += ["No serving run was given.", ""]
    lines += ["### Acceptance per task", ""]
    for run in ev.acceptance:
        lines += _acceptance(run)
    if not ev.acceptance:
        lines += ["No acceptance run was given.", ""]
    if ev.notes:
        lines += ["Notes on the inputs:", "", *[f"- {n}" for n in ev.notes], ""]
    lines += ["## Known limits", "", *[f"- {x}" for x in known_limits(ev, spec.enabled)], ""]
    lines += _operations(cfg, d)
    return "\n".join(lines).rstrip() + "\n"


def _engine_lines(cfg: ServeConfig, frozen: dict[str, Any], d: DeploySummary) -> list[str]:
    """The engine settings that run, one bullet each, with the serve.yaml keys that set them."""
    e = cfg.engine
    if e.num_kv_blocks:
        pool = f"{e.num_kv_blocks} blocks of {e.kv_block_size} tokens ({e.num_kv_blocks * e.kv_block_size} token slots)"
    else:
        pool = f"{e.kv_cache_gb:g} GiB of device memory in blocks of {e.kv_block_size} tokens"
    host = (f"host tier of {e.hicache_gb:g} GiB keeps prefix blocks evicted from the device pool "
            "(`enable-hierarchical-cache`, `hicache-size`)" if e.hicache_gb > 0 else "no host tier")
    prefix = f"on, {host}" if e.enable_prefix_cache else f"off (`disable-radix-cache`), {host}"
    overlap = ("on: step N's outputs are delivered while step N+1 runs" if cfg.overlap_schedule else
               "off (`disable-overlap-schedule`): each step's outputs are delivered before the next starts")
    deterministic = ("on (`enable-deterministic-inference`): batch-invariant forwards, a request's tokens do not "
                     "depend on the rest of the batch" if e.batch_invariant else "off: tokens may vary with batching")
    pinned = frozen.get("speculative_adaptive_profile")
    profile = (f"`{pinned}` (the service user must be able to write it)" if pinned else
               f"`{d.cache_dir}/specserve/adaptive/<key>.json` (the unit's CacheDirectory)")
    if not cfg.speculative.enabled:
        adaptive = "not used (plain decoding)"
    elif cfg.speculative_adaptive:
        adaptive = (f"on: per step, as many drafts as pay at the current batch size (or none); cost profile {profile}, "
                    "measured at a start that finds it missing or stale, before /health answers")
    else:
        adaptive = "off (`no-speculative-adaptive`): the configured draft width every step"
    return [f"- batching: up to {e.max_num_seqs} requests decoded together (`max-num-seqs`), "
            f"{e.max_num_batched_tokens} tokens per engine step, prefill chunks and decode/verify tokens "
            "(`max-num-batched-tokens`)",
            f"- KV pool (`num-kv-blocks`, `kv-cache-gb`, `kv-block-size`): {pool}",
            f"- prefix cache: {prefix}", f"- output/compute overlap: {overlap}",
            f"- deterministic mode: {deterministic}", f"- adaptive speculation: {adaptive}"]


def _operations(cfg: ServeConfig, d: DeploySummary) -> Sequence[str]:
    svc = d.service
    key = ' -H "Authorization: Bearer $SPECSERVE_API_KEY"' if cfg.api_key else ""
    lines = [
        "## Install, health, logs", "",
        f"- install (copies the unit, reloads systemd, enables and starts it): `sudo specserve deploy install "
        f"{d.directory}` (`--dry-run` prints the actions only)",
        f"- health: `curl -fsS {d.health_url}` answers `{{\"status\": \"ok\"}}` once the model is loaded; the unit's "
        "ExecStartPost waits for it, so `systemctl start` fails if it never comes",
        f"- live state and accept length: `specserve deploy status {d.directory}`, or `curl -fsS{key} {d.info_url}` "
        "(`avg_spec_accept_length`; compare it with the accept length measured above)",
        f"- logs: `journalctl -u {svc} -f` (stdout and stderr go to the journal, identifier `{svc}`); "
        f"`systemctl status {svc}` for the last lines and the restart count",
        "- a changed model or drafter file is refused at start with `refusing to start: the ... checkpoint ... "
        "differs from the frozen one`; the server exits with status 2, which the unit does not restart on, and "
        "the message is in the journal",
        "", "## Rollback", "",
        f"1. Previous deployment: keep its frozen directory and run `sudo specserve deploy install PREVIOUS_DIR` "
        f"(re-copies its unit, reloads systemd, restarts `{svc}`).",
        "2. Plain decoding with the same model: set `speculative-algorithm: NONE` in the source serve.yaml, "
        "`specserve deploy freeze` it into a new directory and install that.",
        f"3. Stop serving: `sudo systemctl disable --now {svc}`.", "",
        "## Pinned files", "",
    ]
    for what, files in d.hashes.items():
        lines += [f"{what}:", ""] + [f"- `{name}` sha256 `{digest}`" for name, digest in files.items()] + [""]
    return lines
