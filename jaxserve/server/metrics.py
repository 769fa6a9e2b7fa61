"""Prometheus metrics, one private CollectorRegistry per app; every name starts with `jaxserve:`.

Latencies are observed where they happen: per-request histograms on the asyncio side as events are
consumed (`RequestMetrics`), queue time on the engine thread (`on_step`), and engine state (running,
waiting, KV pages, prefix cache, preemptions, compilations) read from the EngineCore at scrape time,
so gauges are never stale.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger("jaxserve.server")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        """vllm_names: the engine gauges also under vLLM's names (see _EngineCollector)."""
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"jaxserve:{name}", doc, labels, registry=reg, buckets=buckets).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"jaxserve:{name}", doc, labels, registry=reg).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per sample: (last token - first token) / (tokens - 1).", _TOKEN_GAP_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive tokens of a sample.",
                        _TOKEN_GAP_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last sample's finish.", _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Arrival to the start of the engine step that produced the first token "
                               "(includes earlier chunks of a chunked prefill).", _REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached prefill.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens delivered to clients.")
        success = Counter("jaxserve:request_success", "Finished samples by finish reason.",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._http = Counter("jaxserve:http_requests", "HTTP requests answered, by endpoint and status code.",
                             ["model_name", "endpoint", "status"], registry=reg)
        self._model_name = model_name
        self._engine = _EngineCollector(model_name, vllm_names)
        reg.register(self._engine)
        self._awaiting_first: dict[str, float] = {}  # request id -> arrival (monotonic); engine thread pops
        self._timings_seen = 0.0
        self._core: Any = None

    def attach(self, core: Any) -> None:
        """Starts reporting the engine state of `core` (an EngineCore)."""
        self._engine.core = core
        self._core = core
        t = core.timings
        self._timings_seen = t.schedule + t.build + t.device + t.update

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def http_request(self, endpoint: str, status: int) -> None:
        self._http.labels(self._model_name, endpoint, str(status)).inc()

    def request_started(self, request_id: str, arrival: float) -> None:
        self._awaiting_first[request_id] = arrival

    def request_ended(self, request_id: str) -> None:
        self._awaiting_first.pop(request_id, None)

    def on_step(self, events: list) -> None:
        """Engine-thread hook: queue time of requests whose first token this step produced. Never
        raises (an exception here would stop the engine loop)."""
        try:
            t = self._core.timings
            total = t.schedule + t.build + t.device + t.update
            step_start = time.monotonic() - (total - self._timings_seen)
            self._timings_seen = total
            for ev in events:
                arrival = self._awaiting_first.pop(ev.request_id, None)
                if arrival is not None and ev.token_id is not None:
                    self.queue_time.observe(max(0.0, step_start - arrival))
        except Exception:
            logger.exception("metrics on_step hook failed")


class RequestMetrics:
    """Latency bookkeeping for one engine request with n samples (asyncio side)."""

    def __init__(self, metrics: ServerMetrics | None, request_id: str, arrival: float, n: int) -> None:
        self.m = metrics
        self.request_id = request_id
        self.arrival = arrival
        self.first_token: float | None = None
        self.sample_first: list[float | None] = [None] * n
        self.sample_last: list[float | None] = [None] * n
        self.sample_tokens = [0] * n
        if metrics is not None:
            metrics.request_started(request_id, arrival)

    def token(self, sample: int, num_prompt_tokens: int) -> None:
        now = time.monotonic()
        m = self.m
        if self.first_token is None:
            self.first_token = now
            if m is not None:
                m.ttft.observe(now - self.arrival)
                m.prompt_tokens.inc(num_prompt_tokens)
        last = self.sample_last[sample]
        if last is None:
            self.sample_first[sample] = now
        elif m is not None:
            m.itl.observe(now - last)
        self.sample_last[sample] = now
        self.sample_tokens[sample] += 1
        if m is not None:
            m.generation_tokens.inc()

    def finished(self, sample: int, reason: str) -> None:
        if self.m is not None:
            self.m.success.get(reason, self.m.success["abort"]).inc()
        first, last, k = self.sample_first[sample], self.sample_last[sample], self.sample_tokens[sample]
        if self.m is not None and first is not None and last is not None and k > 1:
            self.m.tpot.observe((last - first) / (k - 1))

    def ended(self) -> None:
        if self.m is not None:
            self.m.e2e.observe(time.monotonic() - self.arrival)
            self.m.request_ended(self.request_id)


class _EngineCollector(Collector):
    """Engine state at scrape time: scheduler stats, KV pages, compile count. With `vllm_names` the
    gauges a gateway's endpoint picker reads (the Gateway API Inference Extension's model-server
    protocol) are repeated under vLLM's names: vllm:num_requests_waiting / _running,
    vllm:kv_cache_usage_perc, vllm:cache_config_info (block_size, num_gpu_blocks) and
    vllm:lora_requests_info (valued with the scrape time, as vLLM does)."""

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.core: Any = None

    def collect(self) -> Iterable[Metric]:
        core = self.core
        if core is None:
            return []
        s = core.stats()
        used = s.num_total_pages - s.num_free_pages
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        usage = used / max(1, s.num_total_pages)
        return [
            gauge("num_requests_running", "Sequences (samples) in the running batch.", s.num_running),
            gauge("num_requests_waiting", "Sequences (samples) waiting for admission.", s.num_waiting),
            gauge("kv_cache_usage_perc", "Fraction (0..1) of KV pages held by sequences; evictable "
                  "prefix-cache pages count as free.", usage),
            gauge("num_kv_pages_used", "KV pages held by sequences.", used),
            gauge("num_kv_pages_total", "KV pages in the pool.", s.num_total_pages),
            counter("num_preemptions", "Sequences preempted (recomputed, or swapped with a host KV tier).",
                    s.num_preemptions),
            counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits),
            counter("compilations_after_warmup", "XLA compilations on the serving thread after warm-up "
                    "(should stay 0).", core.runner.compilations_after_warmup),
            gauge("programs_compiled", "Serving programs compiled (a background warm-up compiles the rest while "
                  "serving; steps take only compiled shapes).", core.runner.programs_compiled),
            gauge("programs_declared", "Serving programs declared (every step shape and sampler).",
                  core.runner.programs_declared),
            self._cache_config(core),
            *self._decode_steps(core),
            *self._host_tier(s, gauge, counter),
            *([counter("kv_exported_pages", "KV pages sent to decode instances (--kv-role prefill).",
                       core.num_exported_pages),
               counter("kv_imported_pages", "KV pages received from prefill instances (--kv-role decode).",
                       core.num_imported_pages)] if core.engine_cfg.kv_role else []),
            *self._spec_decode(core),
            *self._lora(core, s),
            *(self._vllm(core, s, usage) if self.vllm_names else ()),
        ]

    def _decode_steps(self, core: Any) -> list[Metric]:
        """Decode-only steps by sequence bucket (engine/step_clock.StepTimings.decode): sum / count of
        decode_step_seconds is the decode step time at that batch size; the two counters, divided by
        the count, give the sequences and the KV tokens those steps read on average."""
        labels = ["model_name", "rows"]
        summary = SummaryMetricFamily("jaxserve:decode_step_seconds", "Seconds per step of steps that only "
                                      "decode (one token per sequence), by the step's sequence bucket.", labels=labels)
        rows = CounterMetricFamily("jaxserve:decode_step_sequences", "Sequences in the decode-only steps, summed "
                                   "over the steps, by sequence bucket.", labels=labels)
        context = CounterMetricFamily("jaxserve:decode_step_context_tokens", "Tokens of context (KV read) of the "
                                      "decode-only steps' sequences, summed over the steps, by sequence bucket.",
                                      labels=labels)
        for bucket, d in sorted(dict(core.timings.decode).items()):
            key = [self.model_name, str(bucket)]
            summary.add_metric(key, d.steps, d.seconds)
            rows.add_metric(key, d.rows)
            context.add_metric(key, d.context_tokens)
        return [summary, rows, context]

    @staticmethod
    def _host_tier(s: Any, gauge: Any, counter: Any) -> list[Metric]:
        """The host KV tier's figures (--kv-offload-gib), when there is one."""
        if not s.num_host_pages:
            return []
        return [
            gauge("kv_host_pages_total", "Pages in the host KV tier.", s.num_host_pages),
            gauge("kv_host_pages_used", "Host KV tier pages holding an evicted or swapped page.", s.num_host_pages_used),
            counter("kv_host_hit_tokens", "Prompt tokens whose KV came back from the host tier instead of being "
                    "computed (prefix hits and swap-ins).", s.host_hit_tokens),
            counter("kv_demoted_pages", "Pages moved from the device to the host tier.", s.num_demotions),
            counter("kv_promoted_pages", "Pages moved from the host tier back to the device.", s.num_promotions),
            counter("num_swap_preemptions", "Preemptions that kept the sequence's pages (swap) rather than "
                    "recomputing them.", s.num_swap_preemptions),
            counter("kv_swapped_in_pages", "Pages a resumed preempted sequence got back from the host tier.",
                    s.num_swapped_in_pages),
        ]

    def _vllm(self, core: Any, s: Any, usage: float) -> list[Metric]:
        labels = ["model_name"]
        out = []
        for name, doc, value in (("num_requests_waiting", "Requests waiting (jaxserve:num_requests_waiting).",
                                  s.num_waiting),
                                 ("num_requests_running", "Requests running (jaxserve:num_requests_running).",
                                  s.num_running),
                                 ("kv_cache_usage_perc", "KV cache usage, 0..1 (jaxserve:kv_cache_usage_perc).",
                                  usage)):
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
            g.add_metric([self.model_name], value)
            out.append(g)
        cfg = core.runner.engine_cfg
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache settings (labels); the value is 1.",
                                 labels=["model_name", "block_size", "num_gpu_blocks", "cache_dtype"])
        info.add_metric([self.model_name, str(cfg.page_size), str(cfg.num_kv_pages), cfg.kv_cache_dtype], 1.0)
        out.append(info)
        if core.lora_names:
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Adapters with running / waiting sequences "
                                     "(labels); the value is the time of this report.",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            lora.add_metric([str(cfg.max_loras), ",".join(sorted(s.lora_running)), ",".join(sorted(s.lora_waiting))],
                            time.time())
            out.append(lora)
        return out

    def _lora(self, core: Any, s: Any) -> list[Metric]:
        """Per adapter running / waiting sequences, vLLM's lora_requests_info, and slot loads."""
        names = core.lora_names
        if not names:
            return []
        out = []
        for name, doc, counts in (("lora_num_requests_running", "Sequences running per LoRA adapter.", s.lora_running),
                                  ("lora_num_requests_waiting", "Sequences waiting per LoRA adapter.", s.lora_waiting)):
            g = GaugeMetricFamily(f"jaxserve:{name}", doc, labels=["model_name", "lora_name"])
            for adapter in names:
                g.add_metric([self.model_name, adapter], counts.get(adapter, 0))
            out.append(g)
        info = GaugeMetricFamily("jaxserve:lora_requests_info", "Adapters with running / waiting sequences "
                                 "(labels, vLLM's shape); the value is 1.",
                                 labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([self.model_name, ",".join(sorted(s.lora_running)), ",".join(sorted(s.lora_waiting)),
                         str(core.engine_cfg.max_loras)], 1.0)
        loads = CounterMetricFamily("jaxserve:lora_slot_loads", "LoRA adapters loaded into a device slot.",
                                    labels=["model_name"])
        loads.add_metric([self.model_name], s.lora_slot_loads)
        return [*out, info, loads]

    def _spec_decode(self, core: Any) -> list[Metric]:
        """vLLM's spec_decode counters, when speculative decoding is configured."""
        stats = core.scheduler.spec_stats
        if stats is None:
            return []
        labels = [self.model_name]
        out = []
        for name, doc, value in (
                ("spec_decode_num_drafts", "Verified proposals (one per speculating sequence and step).", stats.num_drafts),
                ("spec_decode_num_draft_tokens", "Proposed draft tokens.", stats.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted by verification.", stats.num_accepted_tokens)):
            c = CounterMetricFamily(f"jaxserve:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            out.append(c)
        per_pos = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0 = the first draft).",
                                      labels=["model_name", "position"])
        for i, accepted in enumerate(stats.accepted_per_position):
            per_pos.add_metric([self.model_name, str(i)], accepted)
        return [*out, per_pos]

    def _cache_config(self, core: Any) -> Metric:
        """vLLM's cache_config_info shape: the pool's settings as labels of a constant 1."""
        cfg, pool_bytes = core.runner.engine_cfg, core.runner.capacity.kv_pool_bytes
        tokens = cfg.num_kv_pages * cfg.page_size
        info = dict(cache_dtype=cfg.kv_cache_dtype, page_size=str(cfg.page_size), num_pages=str(cfg.num_kv_pages),
                    pool_tokens=str(tokens), pool_bytes=str(pool_bytes), bytes_per_token=str(pool_bytes // tokens))
        g = GaugeMetricFamily("jaxserve:cache_config_info", "KV cache settings (labels); the value is 1. "
                              "bytes_per_token is per device, K and V of every layer, scales included.",
                              labels=["model_name", *info])
        g.add_metric([self.model_name, *info.values()], 1.0)
        return g
