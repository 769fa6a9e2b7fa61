"""The engine: scheduler -> step inputs -> model runner -> scheduler, one step at a time.

`EngineCore` is the step loop (used directly by the offline `LLM` API and tests). With
`EngineConfig.async_scheduling` one `step()` plans and dispatches step n+1 while step n still runs
on the device, and only then waits for step n's sampled ids and applies them: the device never
waits for the host's scheduling. Decodes whose previous token is still on the device read it there
(see scheduler.py). A row with repetition/presence/frequency penalties counts its in-flight token
on the device (the sampler reads its id where the forward does), so penalties stay asynchronous too.
A grammar-constrained row (structured output) needs its previous token for its token mask, but not
for its forward: step n+1's forward is dispatched first, step n is applied while it runs, and
n+1's sampler is dispatched with the masks once they are filled.
Speculative decoding: while speculation is active (configured, batch within disable_by_batch_size,
some sequence not backing off after fruitless proposals: scheduler.py) steps run synchronously: a
proposal needs the sequence's last token on the host, and a step with drafts emits an accepted run
whose length the next step's positions depend on. With a draft model, `_schedule` runs its
proposals between planning and building the step. Counts of drafted and accepted tokens are logged
every SPEC_LOG_INTERVAL seconds.
Without async scheduling a step is schedule -> build -> dispatch -> wait -> update.
The async front that runs this loop on a thread for the server is async_engine.py.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.core.buckets import choose_bucket
from jaxserve.core.config import EngineConfig, ModelConfig
from jaxserve.core.capacity import state_slot_counts
from jaxserve.core.kv_groups import kept_windows
from jaxserve.core.request import Request, TokenEvent
from jaxserve.core.step_plan import SampledRows, StepPlan
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_stats import SchedulerStats
from jaxserve.engine.step_clock import StepTimings
from jaxserve.model.weights import Weights
from jaxserve.parallel.layouts import layout_rules
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.sampler import SamplerOutput
from jaxserve.runner.step_inputs import StepInputs, constraint_bitmask, has_constrained_rows

logger = logging.getLogger("jaxserve.engine.engine_core")

SPEC_LOG_INTERVAL = 5.0  # seconds between speculative decoding summary lines


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose sampled ids have not been applied yet."""

    plan: StepPlan
    out: SamplerOutput   # device arrays; their copy to the host is already started
    dispatched: float    # perf_counter() when its forward was launched


class EngineCore:
    def __init__(self, model_cfg: ModelConfig, weights: Weights, engine_cfg: EngineConfig, mesh: Mesh,
                 dtype: Any = jnp.float32, draft: tuple[ModelConfig, Weights] | None = None) -> None:
        """draft: the proposer's (config, weights) for speculative method draft_model (a model),
        eagle3 (an EAGLE-3 head) or mtp (the checkpoint's MTP layer); loaded from the config's
        model directory when not given."""
        self.model_cfg = model_cfg
        spec = engine_cfg.speculative_config
        rules = layout_rules(engine_cfg.layout, model_cfg)  # the proposer is placed as the target is
        if spec is not None and spec.model_proposer and draft is None:
            from checkpoints import load_proposer

            draft = load_proposer(spec, model_cfg, mesh, dtype, engine_cfg.quantization, rules)
        self.runner = ModelRunner(model_cfg, weights, engine_cfg, mesh, dtype, draft)
        self.engine_cfg = engine_cfg = self.runner.engine_cfg  # every size resolved
        self.allocator = PageAllocator(self.runner.num_pages, engine_cfg.page_size,
                                       engine_cfg.enable_prefix_caching, self.runner.num_host_pages,
                                       windows=kept_windows(model_cfg.kv_groups.windows, engine_cfg.speculative_config),
                                       **dict(zip(("num_state_slots", "num_state_snapshots"), state_slot_counts(
                                           model_cfg, engine_cfg.max_num_seqs, engine_cfg.enable_prefix_caching))))
        self.scheduler = Scheduler(engine_cfg, self.allocator)
        self.scheduler.swap_costs = self.runner.swap_costs
        if self.runner.lora is not None:
            self.scheduler.lora_resident = self.runner.lora.resident
        self._rng = random.Random(engine_cfg.seed)
        self.timings = StepTimings()
        self._dispatched = self._completed = 0.0  # perf_counter() of the last forward launch / step completion
        self.num_prefill_tokens = 0   # prompt tokens computed (prefix-cache hits excluded)
        self.num_generated_tokens = 0  # tokens emitted (a token sampled after its sequence stopped is not)
        self.num_sync_steps = 0        # async scheduling: steps finished before planning the next
                                       # (speculation)
        self._inflight: _InFlight | None = None
        # the last step planned nothing and nothing is in flight, though work waits (an adapter
        # being read from disk): the caller may pause briefly instead of spinning
        self.stalled = False
        self._last_plan: StepPlan | None = None  # the last step dispatched (an EAGLE-3 head proposes from it)
        self._lora_lock = threading.Lock()  # adapter name checks vs run-time unloads
        self._kv_jobs: list[Callable[[], None]] = []  # PD page exports/imports, run on the engine thread
        self._kv_lock = threading.Lock()
        self.num_exported_pages = 0
        self.num_imported_pages = 0
        self._lora_unloads: list[tuple[str, Future[None]]] = []
        spec = self.scheduler.spec_stats
        self._spec_logged = (time.monotonic(), spec.copy()) if spec is not None else None
        if (sc := engine_cfg.speculative_config) is not None:
            source = {"ngram": f"n-gram {sc.prompt_lookup_min}..{sc.prompt_lookup_max}",
                      "draft_model": f"draft model {sc.model}", "eagle3": f"EAGLE-3 head {sc.model}",
                      "mtp": f"the MTP layer of {sc.model}"}[sc.method]
            limit = "" if sc.disable_by_batch_size is None else f", off above {sc.disable_by_batch_size} running"
            logger.info("speculative decoding: up to %d draft tokens per decode (%s)%s; steps run synchronously "
                        "while it is on", sc.num_speculative_tokens, source, limit)

    @property
    def num_kv_pages(self) -> int:
        return self.runner.num_pages

    @property
    def lora_modules(self) -> dict[str, str]:
        """name -> path of the LoRA adapters requests may name (--lora-modules, and those loaded at
        run time)."""
        return dict(self.runner.lora.paths) if self.runner.lora is not None else {}

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(self.lora_modules)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Adds a PEFT adapter at run time (any thread); ValueError names the problem."""
        if self.runner.lora is None:
            raise ValueError("LoRA is not enabled: start the server with --enable-lora")
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name must be a non-empty string")
        if name in self.lora_names:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        self.runner.lora.register(name, path)  # reads and checks it (not under the lock: slow)
        logger.info("LoRA adapter %r loaded from %s", name, path)

    def unload_lora_adapter(self, name: str) -> "Future[None]":
        """Asks to remove an adapter (any thread). The engine thread decides at its next step, where
        no admission is half done: the future then raises ValueError when sequences of it are
        running or waiting (unload it once they finish), else the adapter is gone. LookupError at
        once for an adapter that is not loaded."""
        fut: Future[None] = Future()
        with self._lora_lock:
            if name not in self.lora_names:
                fut.set_exception(LookupError(f"LoRA adapter {name!r} is not loaded"))
            else:
                self._lora_unloads.append((name, fut))
        return fut

    def _apply_lora_unloads(self) -> None:
        """Engine thread, before planning: the queued unloads, under the lock add_request checks
        names with (so no request of an adapter can slip in as it goes)."""
        with self._lora_lock:
            pending, self._lora_unloads = self._lora_unloads, []
            for name, fut in pending:
                busy = self.scheduler.num_sequences_of_lora(name)
                if busy:
                    fut.set_exception(ValueError(f"LoRA adapter {name!r} has {busy} sequence(s) running or waiting; "
                                                 "unload it when they have finished"))
                    continue
                self.runner.lora.unregister(name)
                self.scheduler.unload_lora(name)
                fut.set_result(None)
                logger.info("LoRA adapter %r unloaded", name)

    # ---- PD disaggregation (kv_transfer.py): any thread queues, the engine thread runs ----------------

    def _queue(self, job: Callable[[], Any]) -> "Future[Any]":
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(job())
            except Exception as e:  # the caller's error (a misfit payload), not the engine's
                fut.set_exception(e)
        with self._kv_lock:
            self._kv_jobs.append(run)
        return fut

    def export_prefix(self, token_ids: list[int], cache_salt: str | None = None,
                      offer_on: str | None = None) -> "Future[Any]":
        """The K/V of the full pages of `token_ids` this engine's prefix cache holds on the device,
        from the first: host arrays (ModelRunner.export_pages' layout), or with `offer_on` (a bind
        host) an offer on this process's jax.experimental.transfer server (kv_pull.py)."""
        def job() -> Any:
            pages = self.allocator.device_prefix(token_ids, self.scheduler.namespace(None, cache_salt))
            self.num_exported_pages += len(pages)
            return self.runner.export_pages(pages) if offer_on is None else self.runner.offer_pages(pages, offer_on)
        return self._queue(job)

    def import_prefix(self, token_ids: list[int], cache_salt: str | None, num_pages: int,
                      leaves: list[Any]) -> "Future[int]":
        """Enters the full pages of `token_ids` whose K/V is `leaves` (host arrays of `num_pages`
        rows, as export_prefix lays them out: every layer group's) into the prefix cache (pages
        already cached are kept); the future gives the pages written."""
        def check() -> None:
            self.runner.check_pages([(tuple(leaf.shape[1:]), leaf.dtype.name) for leaf in leaves])

        def write(_: None, pairs: list[tuple[int, int]]) -> None:
            if pairs:
                rows = [i for i, _ in pairs]
                self.runner.import_pages([p for _, p in pairs], [leaf[rows] for leaf in leaves])
        return self._import(token_ids, cache_salt, num_pages, check, write)

    def pull_offer(self, host: str, offer: dict, bind_host: str) -> list[Any]:
        """The pages a prefill instance offered over jax.experimental.transfer (kv_pull.py), pulled
        from `host` onto this pool's devices; blocks the calling thread (not the engine's) until
        they land. ValueError when they do not fit or the pull fails."""
        return self.runner.pull_pages(host, offer, bind_host)

    def import_pulled(self, token_ids: list[int], cache_salt: str | None, offer: dict,
                      runs: list[Any]) -> "Future[int]":
        """import_prefix for pages pull_offer brought onto the devices."""
        def write(_: None, pairs: list[tuple[int, int]]) -> None:
            dst = [self.runner.num_pages] * offer["pages"]  # out of bounds: a row already cached is dropped
            for row, page in pairs:
                dst[row] = page
            self.runner.write_pulled(runs, dst)
        return self._import(token_ids, cache_salt, int(offer["pages"]), lambda: None, write)

    def _import(self, token_ids: list[int], cache_salt: str | None, num_pages: int, fetch: Callable[[], Any],
                write: Callable[[Any, list[tuple[int, int]]], None]) -> "Future[int]":
        """Keys the full pages of `token_ids` shipped as `num_pages` rows in the prefix cache once fetch() has
        their K/V (it raises ValueError when they cannot be used: nothing is keyed), then
        write(fetched, [(row, page)]) fills the pages it took."""
        rows, num_pages = num_pages, self.allocator.prefix_of_rows(num_pages)  # every layer group's pages
        if num_pages * self.engine_cfg.page_size > len(token_ids):
            raise ValueError(f"{rows} pages of K/V for {len(token_ids)} tokens")

        def job() -> int:
            if num_pages == 0:  # a prompt shorter than a page: nothing was cached to ship
                return 0
            fetched = fetch()
            pairs = self.allocator.import_pages(token_ids, self.scheduler.namespace(None, cache_salt), num_pages)
            moves = self.allocator.drain_transfers()  # pages the import took were demoted: read them first
            if moves.demotions or moves.promotions:
                self.runner.move_pages(moves.demotions, moves.promotions)
            write(fetched, pairs)
            self.num_imported_pages += len(pairs)
            return len(pairs)
        return self._queue(job)

    def add_request(self, request: Request) -> Request:
        """Validates and queues a request; raises ValueError naming the problem. Every request gets
        a seed (a random one when it has none), so every sample row is reproducible."""
        params = request.params
        params.validate(self.model_cfg.vocab_size)
        if params.structured_outputs is not None and request.grammar is None:
            raise ValueError("structured_outputs needs the request's compiled grammar (Request.grammar); "
                             "submit through the server or the LLM API, which compile it")
        if any(t >= self.model_cfg.vocab_size for t in request.prompt_token_ids):
            raise ValueError(f"prompt_token_ids contain ids outside the vocabulary (size {self.model_cfg.vocab_size})")
        if params.seed is None:
            request = dataclasses.replace(request, params=dataclasses.replace(params, seed=self._rng.getrandbits(62)))
        if params.ignore_eos:
            request = dataclasses.replace(request, eos_token_ids=frozenset())
        if request.lora_name is not None:
            with self._lora_lock:  # against a concurrent unload of the same adapter
                names = self.lora_names
                if request.lora_name not in names:
                    raise ValueError(f"unknown LoRA adapter {request.lora_name!r}; served: {', '.join(names) or 'none'}")
                self.scheduler.add(request)
            return request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def finish(self, request_id: str, sample_index: int | None = None) -> None:
        self.scheduler.finish(request_id, sample_index)

    def has_work(self) -> bool:
        return (self._inflight is not None or bool(self._lora_unloads) or bool(self._kv_jobs)
                or self.scheduler.has_work())

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[TokenEvent]:
        """One engine iteration; returns the TokenEvents it produced. Synchronous: runs one step
        to completion. Async: dispatches the next step, then completes the one before it (so the
        first call returns no tokens, and a call with nothing new to plan only completes)."""
        if not self.engine_cfg.async_scheduling:
            plan = self._schedule()
            events = list(plan.finished)
            self.stalled = not plan.num_seqs
            if plan.num_seqs:
                events += self._complete(self._dispatch(plan, None))
            return events
        prev, self._inflight = self._inflight, None
        events: list[TokenEvent] = []
        if prev is not None and (self.scheduler.speculation_active() or prev.plan.has_drafts):
            events += self._complete(prev)  # drafts read the ids: no placeholder for them
            prev = None
            self.num_sync_steps += 1
        plan = self._schedule()
        events += plan.finished
        if plan.num_seqs and prev is not None and has_constrained_rows(plan):
            # A grammar's mask needs the token the previous step sampled: run this step's forward
            # now, apply the previous step while it runs, then sample with the masks.
            inputs, logits = self._dispatch_forward(plan, prev.plan)
            events += self._complete(prev)
            prev = None
            self._inflight = self._dispatch_sample(plan, inputs, logits)
        elif plan.num_seqs:
            self._inflight = self._dispatch(plan, prev.plan if prev is not None else None)
        if prev is not None:
            events += self._complete(prev)
        self.stalled = not plan.num_seqs and self._inflight is None
        return events

    def _schedule(self) -> StepPlan:
        """The next plan; draft slots are filled here (a proposal runs the draft model or the EAGLE-3
        head on the device)."""
        t0 = time.perf_counter()
        if self._lora_unloads:
            self._apply_lora_unloads()
        if self._kv_jobs:
            with self._kv_lock:
                jobs, self._kv_jobs = self._kv_jobs, []
            for job in jobs:
                job()
        self.scheduler.step_limit = self.runner.step_limit  # compiled buckets only (a background warm-up)
        plan = self.scheduler.schedule()
        if self.runner.background is not None:  # what to compile next: what held this step back
            self.runner.background.pressure = self.scheduler.limited or self.runner.background.pressure
        if plan.demotions or plan.promotions:  # host KV tier: before anything reads the pages
            self.runner.move_pages(plan.demotions, plan.promotions)
        if self.runner.proposer is not None and plan.has_drafts:
            self.scheduler.set_drafts(plan, self.runner.propose(plan, self._last_plan))
        self.timings.schedule += time.perf_counter() - t0
        return plan

    def _dispatch(self, plan: StepPlan, prev_plan: StepPlan | None) -> _InFlight:
        """Builds the step's inputs and launches it on the device; returns without waiting."""
        return self._dispatch_sample(plan, *self._dispatch_forward(plan, prev_plan))

    def _dispatch_forward(self, plan: StepPlan, prev_plan: StepPlan | None) -> tuple[StepInputs, Any]:
        t0 = self._dispatched = time.perf_counter()
        for slot, name in plan.lora_loads:  # an adapter's first step: into its slot first (device order)
            self.runner.load_lora(slot, name)
        inputs = self.runner.builder.build(plan, prev_plan)
        self._last_plan = plan
        t1 = time.perf_counter()
        logits = self.runner.forward(inputs)
        self.timings.build += t1 - t0
        self.timings.device += time.perf_counter() - t1
        self.num_prefill_tokens += sum(max(0, min(len(c.token_ids), len(c.request.prompt_token_ids) - c.start_pos))
                                       for c in plan.listed)  # DecodeRows rows decode outputs
        return inputs, logits

    def _dispatch_sample(self, plan: StepPlan, inputs: StepInputs, logits: Any) -> _InFlight:
        """Launches the sampler; constrained rows get their grammar masks, computed from every token
        applied so far (so the step that sampled their previous token must be complete)."""
        t0 = time.perf_counter()
        bitmask = constraint_bitmask(plan, inputs.sampling.num_rows, self.model_cfg.vocab_size)
        t1 = time.perf_counter()
        out = self.runner.sample(logits, inputs, bitmask)
        self.timings.mask += t1 - t0
        self.timings.device += time.perf_counter() - t1
        return _InFlight(plan, out, self._dispatched)

    def _complete(self, step: _InFlight) -> list[TokenEvent]:
        """Waits for the step's sampled ids and applies them to the scheduler."""
        t0 = time.perf_counter()
        out = self.runner.fetch(step.out)
        t1 = time.perf_counter()
        events = self.scheduler.update(step.plan, SampledRows.from_output(step.plan, out))
        tm = self.timings
        tm.device += t1 - t0
        tm.update += time.perf_counter() - t1
        tm.steps += 1
        plan = step.plan
        if plan.num_seqs and plan.num_tokens == plan.num_seqs and not plan.has_drafts:
            bucket = choose_bucket(self.runner.builder.buckets, plan.num_tokens, plan.num_seqs)[1]
            tm.record_decode(bucket, t1 - max(step.dispatched, self._completed), plan.num_seqs,
                             sum(plan.decodes.positions) + len(plan.decodes)
                             + sum(c.start_pos + 1 for c in plan.listed))
        self._completed = t1
        self.num_generated_tokens += len(events)  # update() emits a token with every event
        if self._spec_logged is not None and time.monotonic() - self._spec_logged[0] >= SPEC_LOG_INTERVAL:
            self._log_spec()
        return events

    def _log_spec(self) -> None:
        stats = self.scheduler.spec_stats
        since = stats.since(self._spec_logged[1])
        if since.num_drafts:
            logger.info("%s", since.summary())
        self._spec_logged = (time.monotonic(), stats.copy())
