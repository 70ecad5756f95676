"""`BatchEngine`: continuous batching with speculative decoding on the paged KV cache.

One `step()`:
    k      = how many draft tokens each decode verifies this step (adaptive policy, or the fixed width)
    plan   = scheduler.schedule(k)                      # decodes, prefill chunks, preemptions
    prefill chunks  -> one forward; completed prompts sample their first token, start their drafter
    decodes         -> each drafts a tree (or skips), one verify forward for all of them (rows of unequal
                       length packed: `engine/runner.py`), then per request: verify, compact the accepted
                       path's KV, commit, feed the drafter
Short prefill chunks ride in the decode forward instead of one of their own (`_merges`): a request replacing
a finished one mid-level (its prompt mostly prefix-cached) then costs a few more rows of that forward.
Every request keeps its own sampling parameters, generator, stop checker and drafter; the step returns
what each produced. Not thread-safe: the serving wrapper (`server/batch_serving.py`) and the offline loop
(`engine/offline.py`) call it from one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specserve.engine.adaptive import AdaptivePolicy, engine_profile, streak_class
from specserve.engine.adaptive.measure import default_profile_path, profile_key, profile_slots, saved_profile
from specserve.engine.compiled import CompiledSteps
from specserve.engine.drafting import draft_trees
from specserve.engine.engine_config import EngineConfig, EngineCounters, EngineStats, RequestStats, StepOutput
from specserve.engine.grammar import (
    GrammarCompiler,
    GrammarState,
    constrain_tree,
    greedy_picks,
    mask_logits,
    prune_tree,
)
from specserve.engine.pass_log import PassLog
from specserve.engine.runner import ModelRunner, Row, RowOutput
from specserve.engine.scheduler import BatchPlan, DecodeItem, PrefillChunk, Scheduler, SchedulerConfig
from specserve.engine.sequence import Sequence
from specserve.engine.shadow import ShadowRounds
from specserve.engine.stops import StopChecker
from specserve.engine.warmup import BackgroundWarmup, Warm, run_warmups
from specserve.kv.block_pool import BlockPool
from specserve.kv.host_tier import HostBlockStore, HostTier
from specserve.kv.paged import PagedKVCache
from specserve.kv.radix import RadixCache
from specserve.layers.compiled_fn import CompiledFns
from specserve.layers.sampling import make_generator, pick, target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.drafter import Drafter
from specserve.speculative.factory import DrafterBuilder
from specserve.speculative.trees.tree import DraftTree
from specserve.speculative.verify import verify_greedy, verify_greedy_picks, verify_sampled
from specserve.types import SamplingParams

#: prefill chunks up to this long ride in a decode forward (a KV block: what a prefix-cache hit leaves)
MERGE_TOKENS = 16

log = logging.getLogger("specserve.engine")


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator
    checker: StopChecker
    drafter: Drafter | None = None
    grammar: GrammarState | None = None  # constrained decoding: has consumed every committed token
    last_accepted: int | None = None  # drafts its last decided round accepted (verified or shadow)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify round, bonus included
    draft_tokens: list[int] = field(default_factory=list)  # draft nodes verified per round
    forced_drafts: int = 0  # draft tokens its grammar forced

    def stats(self) -> RequestStats:
        g = self.grammar
        return RequestStats(tuple(self.accept_lengths), self.checker.stop_text_at, tuple(self.draft_tokens),
                            g.masks if g is not None else 0, g.mask_s if g is not None else 0.0, self.forced_drafts)


@dataclass(frozen=True)
class DueProfile:
    """A cost profile to measure once the compiled steps are ready: where it goes, the KV blocks held for it."""

    path: Path
    blocks: list[int]


class BatchEngine:
    def __init__(
        self,
        model: CausalLM,
        eos_ids: tuple[int, ...],
        decode: Callable[[list[int]], str],
        config: EngineConfig,
        drafters: DrafterBuilder | None = None,
        policy: AdaptivePolicy | None = None,
        pass_log: PassLog | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """`drafters`: None decodes plainly. `policy`: the adaptive draft width (None: always the widest; `adapt`
        builds one from a measured cost profile). `pass_log`: a JSON line per pass (--speculative-adaptive-trace).
        `grammars`: compiles requests' output grammars (`SamplingParams.grammar`; none: such requests are refused)."""
        self.model = model
        self.eos_ids = eos_ids
        self.decode = decode
        self.config = config
        self.drafters = drafters
        self.policy = policy
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.device = device
        mcfg = model.config
        self.max_context = mcfg.max_position_embeddings
        self.capture = drafters.capture if drafters is not None else ()
        self.max_draft = drafters.max_tree_nodes - 1 if drafters is not None else 0
        # Drafters that read the target's hidden states (EAGLE-3, DFlash) need them for every context token,
        # cached prefixes included: each KV slot keeps its position's captured states as well.
        features = len(self.capture) * mcfg.hidden_size
        block_bytes = PagedKVCache.block_bytes(mcfg, config.kv_block_size, dtype, feature_dim=features)
        num_blocks = config.num_kv_blocks or self.pool_blocks(model, config, drafters)
        self.kv = PagedKVCache(mcfg, num_blocks, config.kv_block_size, device, dtype, feature_dim=features)
        self.pool = BlockPool(num_blocks, config.kv_block_size)
        host_blocks = int(config.hicache_gb * 2**30 // block_bytes)
        if config.hicache_gb > 0 and host_blocks < 1:
            raise ValueError(f"--hicache-size {config.hicache_gb} GB holds no KV block of {block_bytes} bytes")
        use_cache = config.enable_prefix_cache
        self.host: HostTier | None = None
        if host_blocks and use_cache:
            store = HostBlockStore(self.kv)
            self.host = HostTier(host_blocks, store.copy_out, store.copy_in)
        self.cache = RadixCache(self.pool, self.host) if use_cache else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting),
            self.pool, self.cache,
        )
        self.runner = ModelRunner(model, self.kv, batch_invariant=config.batch_invariant)
        # (a RoPE table that changes with the length, dynamic NTK, fits no fixed graph: such models run eager; so
        # do quantized CPU models, whose layers are already the kernel's few fused calls: `models/fused.py`)
        compile_steps = not (config.enforce_eager or config.batch_invariant or not model.rotary.can_reserve
                             or model.runs_fused())
        self.compiled = (CompiledSteps(model, self.kv, config.cuda_graph_max_bs, self.max_draft + 1)
                         if compile_steps else None)
        if compile_steps and drafters is not None:
            drafters.compile_drafting()
        # unverified trees drafted during plain steps, for the adaptive policy (drafters that cost nothing)
        self.shadow = ShadowRounds() if drafters is not None and drafters.free_drafting else None
        self.counters = EngineCounters()
        self.pass_log = pass_log
        self.grammars = grammars
        self._requests: dict[str, _Request] = {}
        self._block_offsets = range(config.kv_block_size)
        self.warmup: BackgroundWarmup | None = None  # compiling the steps while serving (`warm_compiled`)
        self.profile_due: DueProfile | None = None  # the adaptive profile, measured once they are compiled

    @staticmethod
    def pool_blocks(model: CausalLM, config: EngineConfig, drafters: DrafterBuilder | None) -> int:
        """KV blocks in `config.kv_cache_gb` (each block also keeps its positions' captured drafter states)."""
        capture = drafters.capture if drafters is not None else ()
        block_bytes = PagedKVCache.block_bytes(model.config, config.kv_block_size, model.lm_head.weight.dtype,
                                               feature_dim=len(capture) * model.config.hidden_size)
        return max(1, int(config.kv_cache_gb * 2**30 // block_bytes))

    def adapt(self, profile_path: Path | None = None, defer: bool = False) -> Path | None:
        """Speculate adaptively from now on: the cost profile is loaded from `profile_path` (or the per-machine
        default) or measured there first. `defer`: where none is saved, measure it once a background warm-up
        has compiled the steps it times (`measure_due_profile`), decoding plainly until then. Returns the
        profile's path; None where there is nothing to adapt."""
        if self.drafters is None or self.max_draft == 0:
            return None
        key = profile_key(self)
        path = profile_path or default_profile_path(key)
        profile = saved_profile(path, key)
        if profile is None and defer:  # its blocks held until it is measured
            self.profile_due = DueProfile(path, self.pool.allocate(-(-profile_slots(self.max_draft) //
                                                                     self.config.kv_block_size)))
            return path
        if profile is None:
            profile, path = engine_profile(self, path)
        self.policy = AdaptivePolicy(profile, self.max_draft, stepwise=self.drafters.stepwise)
        return path

    @property
    def profile_measurable(self) -> bool:
        """Whether a deferred profile is due and the compiled steps it times are ready."""
        return self.profile_due is not None and (self.warmup is None or not self.warmup.running)

    def measure_due_profile(self) -> None:
        """Measure the deferred cost profile now, between steps (on its own KV blocks), and adapt from now on."""
        due = self.profile_due
        assert due is not None and self.drafters is not None
        bs = self.config.kv_block_size
        try:
            profile, path = engine_profile(self, due.path, slots=[b * bs + o for b in due.blocks for o in range(bs)])
        finally:  # a failure leaves the engine speculating at full width (no policy), its blocks back
            self.pool.free(due.blocks)
            self.profile_due = None
        self.policy = AdaptivePolicy(profile, self.max_draft, stepwise=self.drafters.stepwise)
        log.info("adaptive speculation: cost profile %s", path)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's queues, KV pool, prefix cache, host tier and counters."""
        c = self.counters
        cache = self.cache.stats if self.cache is not None else None
        host = self.host.stats if self.host is not None else None
        return EngineStats(
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running,
            max_queue=self.config.max_waiting, prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens,
            finished=dict(c.finished), speculative=self.drafters is not None, spec_verify_steps=c.verify_rounds,
            spec_accept_length_sum=c.accept_sum, spec_position_accepted=tuple(c.position_accepted),
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            kv_blocks_cached=self.cache.num_device_blocks if self.cache is not None else 0,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_hit_tokens=cache.hit_tokens if cache else 0, prefix_miss_tokens=cache.miss_tokens if cache else 0,
            host_hit_tokens=cache.host_hit_tokens if cache else 0,
            host_blocks_used=self.host.num_used if self.host is not None else 0,
            device_to_host_blocks=host.device_to_host if host else 0,
            host_to_device_blocks=host.host_to_device if host else 0,
            engine_steps=c.steps, spec_steps=c.spec_steps, engine_step_seconds=c.step_s,
            engine_forward_seconds=c.forward_s,
            adaptive_choices=dict(self.policy.choices) if self.policy is not None else {},
            grammars_compiled=self.grammars.compiled if self.grammars is not None else 0,
            grammar_compile_seconds=self.grammars.compile_s if self.grammars is not None else 0.0,
            grammar_masks=c.grammar_masks, grammar_mask_seconds=c.grammar_mask_s, forced_draft_tokens=c.forced_drafts,
        )

    def describe(self) -> dict[str, object]:
        """The engine's configuration as built (for `/server_info`)."""
        return {
            "engine": "continuous-batching",
            "engine_config": dataclasses.asdict(self.config),
            "num_kv_blocks": self.pool.num_blocks,
            "prefix_cache": self.cache is not None,
            "host_tier_blocks": self.host.capacity if self.host is not None else 0,
            "speculative_adaptive": self.policy is not None,
            "compiled_steps": self.compiled is not None,
            "compiled_buckets": self.compiled.buckets if self.compiled is not None else [],
            "compiling": self.warmup is not None and self.warmup.running,
            "adaptive_profile_due": self.profile_due is not None,
            "compiled_drafting": self.drafters.compiled.graphs if self.drafters and self.drafters.compiled else [],
        }

    def warm_compiled(self, progress: bool = True, max_batch: int | None = None, background: bool = False) -> None:
        """Compile, before serving, the shapes a server meets (`CompiledSteps.startup_buckets`): one plain
        decode, batches up to --cuda-graph-max-bs (none where `max_batch` is 1) and one request's trees up to the
        drafter's widest. `background`: on a thread of their own while the engine serves eager (`warmup.py`)."""
        if self.compiled is None:
            return
        steps = self.compiled
        capture = self.capture
        wanted: list[Warm] = [(str(b), partial(steps.warm, b, capture)) for b in steps.startup_buckets()
                              if b.batch == 1 or max_batch is None or max_batch > 1]
        chains = self.drafters.compiled if self.drafters is not None else None
        wanted += self.drafters.drafting_warmups() if self.drafters is not None else []
        if background:
            fns: list[CompiledFns[Any]] = [steps.compiled_fns, *([chains.compiled_fns] if chains else [])]
            self.warmup = BackgroundWarmup(fns, wanted, progress)
        else:
            run_warmups(wanted, "compiling decode steps", progress)

    # -- requests

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises QueueFull when the waiting queue is full, ValueError for bad input."""
        checker = StopChecker(params, self.eos_ids, self.max_context, len(prompt_ids), self.decode)
        grammar = None
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine has no grammar compiler: constrained decoding is off")
            need = self.grammars.compile(params.grammar)
            if need > params.max_new_tokens:
                raise ValueError(f"the grammar needs {need} tokens for a complete output (its shortest found) but "
                                 f"max_new_tokens is {params.max_new_tokens}; raise max_new_tokens")
            grammar = self.grammars.state(params.grammar, self.device, checker.limit)
        seq = self.scheduler.add(request_id, prompt_ids, params)
        self.counters.prompt_tokens += len(prompt_ids)
        self._requests[request_id] = _Request(seq, params, make_generator(params.seed, self.device), checker,
                                              grammar=grammar)

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its KV blocks; False if it is unknown or already done."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.drafter is not None:
            req.drafter.finish(req.checker.tokens)
        self.scheduler.abort(request_id)
        self._count_finish("abort")
        return True

    # -- the step

    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        outs = self._step()
        self.counters.step_s += time.perf_counter() - t0
        return outs

    def target_forward(self, rows: list[Row]) -> list[RowOutput]:
        """The target's forward over `rows`: compiled where a bucket holds the pass (`engine/compiled.py`), else
        eager (`engine/runner.py`)."""
        out = self.compiled.forward(rows, self.capture) if self.compiled is not None else None
        return out if out is not None else self.runner.forward(rows, self.capture)

    def _forward(self, rows: list[Row]) -> list[RowOutput]:
        t0 = time.perf_counter()
        out = self.target_forward(rows)
        if self.capture:  # the captured states go next to their K/V, in one write per forward
            captured = [res.captured for res in out if res.captured is not None]
            assert len(captured) == len(rows)
            self.kv.write_features([s for row in rows for s in row.write_slots], torch.cat(captured))
        self.counters.forward_s += time.perf_counter() - t0
        return out

    def _step(self) -> list[StepOutput]:
        k = self._lookahead()
        plan = self.scheduler.schedule(k)
        outs: list[StepOutput] = []
        for seq in plan.preempted:
            req = self._requests[seq.request_id]
            req.drafter = None  # rebuilt when the recomputed prefill completes
        for seq in plan.finished:
            gone = self._requests.pop(seq.request_id, None)
            if gone is not None and gone.drafter is not None:
                gone.drafter.finish(gone.checker.tokens)
            self._count_finish("length")
            stats = gone.stats() if gone is not None else None
            outs.append(StepOutput(seq.request_id, [], "length", stats))
        merge = self._merges(plan)
        if plan.prefills and not merge:
            outs += self._run_prefills(plan.prefills)
        if plan.decodes:
            outs += self._run_decodes(plan.decodes, k, plan.prefills if merge else ())
        self.counters.steps += 1
        return outs

    def _lookahead(self) -> int:
        if self.drafters is None or self.profile_due is not None:  # no drafts before the profile says they pay
            return 0
        if self.policy is None:
            return self.max_draft
        if self.shadow is None:  # one class for all (see `_class`)
            return self.policy.choose(self.scheduler.num_running)
        classes = [self._class(r) for r in (self._requests.get(s.request_id) for s in self.scheduler.running)
                   if r is not None]
        return self.policy.choose(self.scheduler.num_running, classes)

    def _class(self, req: _Request) -> int:
        """The request's acceptance class for the policy (`streak_class`). Only where shadow rounds keep every
        request's acceptance current: a request decoded plainly would otherwise keep the class of its last
        verified round (often one that accepted nothing, which sent it to plain decoding) until a try."""
        return streak_class(req.last_accepted) if self.shadow is not None else 0

    def _context(self, seq: Sequence, length: int) -> list[int]:
        """Slots of positions [0, length) of `seq` (a list: the runner converts a batch's rows at once)."""
        bs = self.config.kv_block_size
        return [b * bs + o for b in seq.block_table.blocks[: -(-length // bs)] for o in self._block_offsets][:length]

    @staticmethod
    def _merges(plan: BatchPlan) -> bool:
        """Whether the step's prefill chunks go into its decode forward: where none is longer than
        `MERGE_TOKENS` or than the widest row a decode may verify. Each forward has a fixed cost (on the demo on
        CPU a 5-token prefill pass took 10-14 ms, a whole plain decode pass of 16 requests ~14 ms), and
        speculation desynchronises requests: they finish one at a time, and each replacement paid a prefill
        forward of its own (DFLASH served 499 prefill passes where plain decoding, whose requests finish in
        waves, had 256: `runs/serving/s22b_c16_n128_t0.json`). Rows of unequal length run packed
        (`runner.py`): the projections multiply the real tokens only, and a chunk widens only attention's
        per-row grid — padded to the longest row, which a long chunk (an uncached prompt) would make costly."""
        if not plan.prefills or not plan.decodes:
            return False
        return max(c.num_tokens for c in plan.prefills) <= max(MERGE_TOKENS, *(len(d.slots) for d in plan.decodes))

    def _run_prefills(self, chunks: tuple[PrefillChunk, ...]) -> list[StepOutput]:
        t0, f0, d0 = time.perf_counter(), self.counters.forward_s, self.counters.prefill_drafter_s
        rows = [self._prefill_row(c) for c in chunks]
        outs = self._finish_prefills(chunks, self._forward(rows))
        if self.pass_log is not None:
            c = self.counters
            self.pass_log.write_prefill(len(rows), sum(len(r.token_ids) for r in rows), time.perf_counter() - t0,
                                        c.forward_s - f0, c.prefill_drafter_s - d0)
        return outs

    def _finish_prefills(self, chunks: tuple[PrefillChunk, ...], results: list[RowOutput]) -> list[StepOutput]:
        outs: list[StepOutput] = []
        for chunk, res in zip(chunks, results, strict=True):
            outs += self._finish_prefill(chunk, res)
        return outs

    def _prefill_row(self, c: PrefillChunk) -> Row:
        return Row(
            token_ids=list(c.token_ids), positions=list(range(c.start, c.start + c.num_tokens)),
            write_slots=list(c.slots), context=self._context(c.seq, c.start),
            logits="last" if c.completes else "none",
        )

    def _finish_prefill(self, chunk: PrefillChunk, res: RowOutput) -> list[StepOutput]:
        seq = chunk.seq
        req = self._requests[seq.request_id]
        if not chunk.completes:
            self.scheduler.advance(seq, chunk.num_tokens, [])
            return []
        assert res.logits is not None
        logits = res.logits[-1:]
        if req.grammar is not None:
            logits = mask_logits(logits, req.grammar.allowed())
        token = int(pick(logits, req.params, req.generator).item())
        if self.drafters is not None:
            max_len = seq.num_tokens + req.checker.limit + self.drafters.max_tree_nodes + 2
            req.drafter = self.drafters.for_request(req.params, req.generator, max_len)
            # every position's captured states, those of a cached prefix included: [T, n*H]
            t0 = time.perf_counter()
            slots = torch.tensor(self._context(seq, seq.num_tokens), device=self.device)
            hidden = self.kv.features[slots] if self.kv.features is not None else None
            req.drafter.prefill(seq.token_ids[: seq.num_tokens], hidden)
            self.counters.prefill_drafter_s += time.perf_counter() - t0
        return self._commit(req, chunk.num_tokens, [token])

    def _run_decodes(self, items: tuple[DecodeItem, ...], k: int,
                     prefills: tuple[PrefillChunk, ...] = ()) -> list[StepOutput]:
        """The decode pass: draft, one forward (with `prefills`' rows: `_merges`), verify and commit, then
        let the adaptive policy learn from it."""
        t0, f0 = time.perf_counter(), self.counters.forward_s
        drafters = [self._requests[i.seq.request_id].drafter for i in items]
        # some drafter absorbs more than a round's tokens (a new request's prompt, rounds it skipped): a
        # one-off cost, not the steady cost of drafting at this width
        catch_up = any(d is not None and i.num_draft_tokens > 0 and d.backlog > self.max_draft + 2
                       for i, d in zip(items, drafters, strict=True))
        trees = draft_trees(items, drafters, self.config.batch_invariant)  # None: decodes plainly
        trees, allowed = self._constrain(items, trees)
        self.counters.draft_s += time.perf_counter() - t0
        if k > 0:
            self.counters.spec_steps += 1
        rows = [self._decode_row(item, tree) for item, tree in zip(items, trees, strict=True)]
        results = self._forward(rows + [self._prefill_row(c) for c in prefills])
        outs, merged_s = self._finish_merged(prefills, results[len(rows):])
        committed, verified = self._commit_decodes(items, trees, results[: len(rows)], k, allowed)
        outs += committed
        self._shadow_rounds(items, k)
        elapsed = time.perf_counter() - t0 - merged_s  # the shadow rounds' cost counts in the pass's time
        self.counters.decode_s += elapsed
        self._record_pass(len(items), k, verified, elapsed, self.counters.forward_s - f0, catch_up)
        return outs

    def _constrain(self, items: tuple[DecodeItem, ...], trees: list[DraftTree | None]
                   ) -> tuple[list[DraftTree | None], list[torch.Tensor | None]]:
        """Constrained requests' trees without what their grammar forbids, and the mask at each row's nodes
        ([N+1, V], or [1, V] for a plain row); where the grammar forces more tokens than the tree drafts along
        them, the forced chain is the draft (`engine/grammar.py`)."""
        out: list[DraftTree | None] = []
        masks: list[torch.Tensor | None] = []
        for item, tree in zip(items, trees, strict=True):
            req = self._requests[item.seq.request_id]
            g = req.grammar
            if g is None:
                out.append(tree)
                masks.append(None)
                continue
            t0, n0 = g.mask_s, g.masks
            node_masks: torch.Tensor | None = None
            if tree is None:
                node_masks = None if req.params.greedy else g.allowed()[None]
            else:
                tree, node_masks = self._constrain_tree(g, tree, req.params.greedy)
                forced = g.forced(len(item.slots) - 1) if self.config.grammar_forced_drafts else []
                if len(forced) > int(tree.depths.max()):  # deeper than what is left of the drafter's tree
                    chain = DraftTree.chain(int(tree.tokens[0]), forced, device=self.device)
                    tree, node_masks = self._constrain_tree(g, chain, req.params.greedy)
                    self.counters.forced_drafts += len(forced)
                    req.forced_drafts += len(forced)
            masks.append(node_masks)
            out.append(tree)
            self._count_masks(g, t0, n0)
        return out, masks

    @staticmethod
    def _constrain_tree(g: GrammarState, tree: DraftTree, greedy: bool) -> tuple[DraftTree, torch.Tensor | None]:
        """Greedy rows are pruned token by token and take masks after the forward, only where needed
        (`greedy_picks`); sampled rows take the mask at every node now."""
        return (prune_tree(g, tree), None) if greedy else constrain_tree(g, tree)

    def _count_masks(self, g: GrammarState, t0: float, n0: int) -> None:
        self.counters.grammar_mask_s += g.mask_s - t0
        self.counters.grammar_masks += g.masks - n0

    def _decode_row(self, item: DecodeItem, tree: DraftTree | None) -> Row:
        """A decode's row of the forward: its last token alone, or its draft tree (root first)."""
        context = self._context(item.seq, item.start)
        if tree is None:
            return Row([item.seq.token_ids[-1]], [item.start], [item.slots[0]], context)
        n = tree.num_nodes + 1
        return Row(
            token_ids=tree.tokens.tolist(), positions=(tree.depths + item.start).tolist(),
            write_slots=list(item.slots[:n]), context=context,
            tree_mask=None if tree.is_chain else tree.ancestor_mask(), logits="all",
        )

    def _finish_merged(self, prefills: tuple[PrefillChunk, ...],
                       results: list[RowOutput]) -> tuple[list[StepOutput], float]:
        """Finish the prefill chunks that rode in the decode forward; their outputs and the seconds it took
        (kept out of the decode pass's time)."""
        if not prefills:
            return [], 0.0
        t1, d1 = time.perf_counter(), self.counters.prefill_drafter_s
        outs = self._finish_prefills(prefills, results)
        merged_s = time.perf_counter() - t1
        self.counters.merged_prefills += len(prefills)
        if self.pass_log is not None:
            self.pass_log.write_prefill(len(prefills), sum(c.num_tokens for c in prefills), merged_s, 0.0,
                                        self.counters.prefill_drafter_s - d1, merged=True)
        return outs, merged_s

    def _commit_decodes(self, items: tuple[DecodeItem, ...], trees: list[DraftTree | None],
                        results: list[RowOutput], k: int,
                        allowed: list[torch.Tensor | None]) -> tuple[list[StepOutput], int]:
        """Per decode: pick its next token (plain) or verify its tree, commit what it produced. Returns the
        outputs and the tokens the pass produced (before stop conditions cut a request's last ones)."""
        for i, mask in enumerate(allowed):  # what the grammar allows at each row's node(s)
            if mask is not None:
                logits = results[i].logits
                assert logits is not None
                results[i] = dataclasses.replace(results[i], logits=mask_logits(logits, mask))
        picks = iter(self._greedy_picks(items, trees, results))
        outs: list[StepOutput] = []
        verified = 0
        for item, tree, res in zip(items, trees, results, strict=True):
            if tree is None:
                req = self._requests[item.seq.request_id]
                token = next(picks) if req.params.greedy else self._sample_one(req, res)
                g = req.grammar
                if g is not None and req.params.greedy:
                    assert res.logits is not None
                    t0, n0 = g.mask_s, g.masks
                    token = g.greedy_pick(res.logits[0], token)
                    self._count_masks(g, t0, n0)
                out, n = self._advance(req, [item.seq.token_ids[-1]], res.captured, token), 1
            else:
                out, n = self._verify(item, tree, res, speculated=k > 0)
            outs += out
            verified += n
        return outs, verified

    def _shadow_rounds(self, items: tuple[DecodeItem, ...], k: int) -> None:
        """Acceptance measured on unverified trees during plain steps, for the policy (`engine/shadow.py`)."""
        if self.policy is None or self.shadow is None:
            return
        live = [(r.seq.request_id, r.seq.token_ids, r.drafter, self._class(r))
                for r in (self._requests.get(i.seq.request_id) for i in items) if r is not None]
        for rid, path, decided, cls in self.shadow.after_step(live, set(self._requests), k == 0, self.max_draft):
            if decided:  # class: the request's when the round began
                self.policy.record_accept(path, self.max_draft, cls)
            if decided or path:  # a round still open has accepted at least its path so far
                self._requests[rid].last_accepted = len(path)

    def _record_pass(self, batch: int, k: int, verified: int, elapsed: float, forward: float,
                     catch_up: bool) -> None:
        """The pass's line in the trace, and its costs for the adaptive policy."""
        if self.pass_log is not None:
            self.pass_log.write(batch, k, verified, elapsed, forward, catch_up)
        if self.policy is not None:
            host = (elapsed - forward) / batch  # host time per request of this decode pass
            if k > 0:
                self.policy.record_draft(host, k, batch, catch_up)
            else:
                self.policy.record_plain(host)
            self.policy.record_pass(batch, k, elapsed, catch_up)

    def _greedy_picks(self, items: tuple[DecodeItem, ...], trees: list[DraftTree | None],
                      results: list[RowOutput]) -> list[int]:
        """The argmax of every greedy plain decode's logits, in item order: one product over the batch."""
        rows: list[torch.Tensor] = []  # [1, V] each
        for item, tree, res in zip(items, trees, results, strict=True):
            if tree is None and self._requests[item.seq.request_id].params.greedy:
                assert res.logits is not None
                rows.append(res.logits)
        return torch.cat(rows).argmax(dim=-1).tolist() if rows else []

    @staticmethod
    def _sample_one(req: _Request, res: RowOutput) -> int:
        assert res.logits is not None
        return int(pick(res.logits, req.params, req.generator).item())

    def _advance(self, req: _Request, tokens: list[int], hidden: torch.Tensor | None,
                 bonus: int) -> list[StepOutput]:
        """tokens = [root, accepted drafts...] now in the KV, hidden their captured states [len(tokens), n*H]
        (or None), bonus the target's next token: commit them and feed the drafter, if any."""
        out = self._commit(req, len(tokens), [*tokens[1:], bonus])
        if req.drafter is not None and not req.checker.done:
            req.drafter.accept(tokens, hidden, bonus)
        return out

    def _verify(self, item: DecodeItem, tree: DraftTree, res: RowOutput,
                speculated: bool) -> tuple[list[StepOutput], int]:
        """Verify one request's tree, commit what it accepted; its outputs and the tokens verified."""
        req = self._requests[item.seq.request_id]
        assert res.logits is not None
        g = req.grammar
        if req.params.greedy and g is not None:
            t0, n0 = g.mask_s, g.masks
            v = verify_greedy_picks(tree, greedy_picks(g, tree, res.logits))
            self._count_masks(g, t0, n0)
        elif req.params.greedy:
            v = verify_greedy(tree, res.logits)
        else:
            v = verify_sampled(tree, target_probs(res.logits, req.params), req.generator)
        path = [0, *v.accepted]
        if v.accepted and v.accepted[-1] != len(v.accepted):  # a tree path: move its KV into place
            slots = torch.tensor(item.slots, device=self.device)
            self.kv.copy_slots(slots[torch.tensor(path, device=self.device)], slots[: len(path)])
        tokens = tree.tokens[path].tolist()  # [root, accepted drafts...]
        if speculated:
            c = self.counters
            c.verify_rounds += 1
            c.accept_sum += len(path)
            c.position_accepted.extend([0] * (len(v.accepted) - len(c.position_accepted)))
            for i in range(len(v.accepted)):
                c.position_accepted[i] += 1
            req.accept_lengths.append(len(path))
            req.draft_tokens.append(tree.num_nodes)
            if self.policy is not None:
                self.policy.record_accept(v.accepted, item.num_draft_tokens, self._class(req))
                req.last_accepted = len(v.accepted)
        hidden = res.captured[path] if res.captured is not None else None
        return self._advance(req, tokens, hidden, v.bonus), len(path)

    def _commit(self, req: _Request, num_computed: int, new_tokens: list[int]) -> list[StepOutput]:
        """Feed the stop checker, advance the sequence, finish it if it stopped."""
        seq = req.seq
        g = req.grammar
        if g is not None:  # the output ends where its grammar is complete (nothing may follow, EOS included)
            new_tokens = new_tokens[: g.consume_until_stopped(new_tokens)]
        taken = req.checker.feed(new_tokens)
        kept = new_tokens[:taken]
        # (the checker cuts tokens only when it finishes: the state is then not read again)
        # the grammar completed: a natural stop, also when that token used up the budget
        if g is not None and g.stopped and taken == len(new_tokens) and req.checker.finish_reason in (None, "length"):
            req.checker.finish_reason = "stop"
        self.counters.generation_tokens += taken
        self.scheduler.advance(seq, num_computed if taken == len(new_tokens) else min(num_computed, taken), kept)
        if not req.checker.done:
            return [StepOutput(seq.request_id, kept)]
        reason = req.checker.finish_reason or "length"
        if req.drafter is not None:
            req.drafter.finish(req.checker.tokens)
        self.scheduler.finish(seq, reason)
        del self._requests[seq.request_id]
        self._count_finish(reason)
        return [StepOutput(seq.request_id, kept, reason, req.stats())]

    def _count_finish(self, reason: str) -> None:
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
