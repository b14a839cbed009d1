"""Prometheus metrics, prefix ``kvserve:``, every series labelled ``model_name``; beside them,
vLLM's names (prefix ``vllm:``) where the meaning is the same, so existing vLLM boards work.

Two sources:
  * the engine's state, read at scrape time from an :class:`EngineSnapshot` (KV blocks, tokens
    held, fragmentation, queue lengths, prefix-cache and session counters);
  * per-request events from the engine thread (:class:`EngineListener`): latency histograms,
    token counters, KV memory × time.

Each app gets its own registry, so several servers can live in one process (tests do that).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvserve.engine.async_engine import EngineSnapshot, FinishedRequest
from kvserve.kv.tiers.index import LOAD_BUCKETS
from kvserve.pricing import Prices

P = "kvserve:"
V = "vllm:"
# vLLM name → the snapshot attribute it reads (same meaning as vLLM's v1 metrics)
VLLM_GAUGES: list[tuple[str, str, str]] = [
    ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage_ratio"),
    ("num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
]
VLLM_COUNTERS: list[tuple[str, str, str]] = [
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_queries"),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_hits"),
    ("num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
    ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_verifies"),
    ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_accepted_tokens"),
]

# (name, help, value of a snapshot); gauges first, then engine-side cumulative counters
GAUGES: list[tuple[str, str, str]] = [
    ("kv_blocks_total", "KV blocks in the pool.", "blocks_total"),
    ("kv_blocks_used", "KV blocks referenced by running requests or sessions.", "blocks_used"),
    ("kv_blocks_cached_free", "Free KV blocks that still hold a findable prefix (evictable).",
     "blocks_cached_free"),
    ("kv_blocks_pinned", "KV blocks pinned by sessions between turns.", "blocks_pinned"),
    ("kv_cache_usage_ratio", "Used KV blocks / total KV blocks.", "kv_usage_ratio"),
    ("kv_tokens_held", "Tokens whose KV sits in used blocks (a shared block counts once).", "tokens_held"),
    ("kv_slots_in_used_blocks", "Token slots in used blocks (used blocks x block size).",
     "slots_in_used_blocks"),
    ("kv_fragmentation_ratio", "1 - tokens held / slots in used blocks.", "fragmentation_ratio"),
    ("running_seq_len_avg", "Average length (prompt + generated tokens) of running requests.", "seq_len_avg"),
    ("running_seq_len_max", "Longest running request, in tokens.", "seq_len_max"),
    ("num_requests_running", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Requests waiting for admission (preempted ones included).", "num_waiting"),
    ("sessions_active", "Sessions the engine knows (resident or released, not yet closed).",
     "sessions_active"),
    ("kv_bytes_per_token", "Bytes of KV one token costs across all layers.", "kv_bytes_per_token"),
    ("kv_token_capacity", "Tokens the KV pool can hold (blocks x block size).", "token_capacity"),
    ("prompt_cache_pins", "Prefixes pinned by the prompt-caching API (cache_control, prompt_cache_key).",
     "prompt_cache_pins"),
    ("prompt_cache_pinned_blocks", "Block references the prompt-caching pins hold.", "prompt_cache_pinned_blocks"),
    ("spec_decode_acceptance_ratio", "Accepted / proposed speculative draft tokens since start (0 before any).",
     "spec_acceptance_rate"),
]
ENGINE_COUNTERS: list[tuple[str, str, str]] = [
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    ("prefix_cache_hits", "Prompt tokens whose KV was reused (prefix cache or session).", "prefix_hits"),
    ("num_preemptions", "Requests preempted (recomputed later) for lack of KV blocks.", "num_preemptions"),
    ("sessions_expired", "Sessions whose KV was released after the idle timeout.", "sessions_expired"),
    ("sessions_evicted", "Sessions whose KV was released under memory pressure.", "sessions_evicted"),
    ("prompt_cache_pins_created", "Prefixes pinned anew (cache writes).", "prompt_cache_pins_created"),
    ("prompt_cache_pins_refreshed", "Pin deadlines pushed back by a hit or a repeated breakpoint.",
     "prompt_cache_pins_refreshed"),
    ("prompt_cache_pins_expired", "Pins released when their TTL passed.", "prompt_cache_pins_expired"),
    ("prompt_cache_pins_evicted", "Pins released early: memory pressure or the pins' budget.",
     "prompt_cache_pins_evicted"),
    ("spec_decode_verifies", "Speculative verify chunks run (a decode step that carried drafts).", "spec_verifies"),
    ("spec_decode_draft_tokens", "Draft tokens proposed by speculative decoding.", "spec_draft_tokens"),
    ("spec_decode_accepted_tokens", "Draft tokens accepted (equal to what the model produced there).",
     "spec_accepted_tokens"),
]

# (stats key, metric name, help, kind) per KV tier
TIER_SERIES: list[tuple[str, str, str, str]] = [
    ("blocks", "kv_tier_blocks", "Block objects a KV tier holds.", "gauge"),
    ("bytes", "kv_tier_bytes", "Bytes of block objects a KV tier holds.", "gauge"),
    ("up", "kv_tier_up", "1 while a KV tier answers, 0 while it is down (requests are served without it).",
     "gauge"),
    ("saves", "kv_tier_saves", "Block objects written to a KV tier.", "counter"),
    ("removed", "kv_tier_evictions", "Block objects a KV tier evicted or deleted.", "counter"),
    ("hits", "kv_tier_hits", "Prefix blocks a lookup below the pool found in a KV tier (the fastest holding it).",
     "counter"),
    ("misses", "kv_tier_misses", "Prefix blocks a lookup below the pool did not find in a KV tier.", "counter"),
    ("loads", "kv_tier_loads", "Blocks loaded back into the pool from a KV tier.", "counter"),
    ("load_seconds", "kv_tier_load_seconds", "Time spent loading blocks from a KV tier.", "counter"),
    ("checksum_failures", "kv_tier_checksum_failures",
     "Block objects that failed their checksum (deleted and recomputed, never served).", "counter"),
]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0)
KV_GIB_S_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1000.0)


class _EngineCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        yield from kernel_choices(self.model_name)
        snap = self.snapshot
        if snap is None:
            return
        for prefix, gauges, counters in ((P, GAUGES, ENGINE_COUNTERS), (V, VLLM_GAUGES, VLLM_COUNTERS)):
            for name, doc, attr in gauges:
                g = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
                g.add_metric([self.model_name], float(getattr(snap, attr)))
                yield g
            for name, doc, attr in counters:
                c = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
                c.add_metric([self.model_name], float(getattr(snap, attr)))
                yield c
        yield from self._tiers(snap)

    def _tiers(self, snap: EngineSnapshot) -> Iterator[Metric]:
        """Per KV tier (label ``tier``): docs/tiers.md."""
        if not snap.tiers:
            return
        for key, name, doc, kind in TIER_SERIES:
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(P + name, doc, labels=["model_name", "tier"])
            for tier, stats in snap.tiers.items():
                fam.add_metric([self.model_name, tier], float(stats[key]))
            yield fam
        hist = HistogramMetricFamily(P + "kv_tier_load_latency_seconds", "Time to read, verify and write one block "
                                     "back into the pool from a KV tier.", labels=["model_name", "tier"])
        for tier, stats in snap.tiers.items():
            cumulative, buckets = 0, []
            for bound, n in zip((*LOAD_BUCKETS, float("inf")), stats["load_buckets"]):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            hist.add_metric([self.model_name, tier], buckets, float(stats["load_seconds"]))
        yield hist


def kernel_choices(model_name: str) -> Iterator[Metric]:
    """``kvserve:kernel_choice{role,band,choice,source} 1``: what :mod:`kvserve.native.choices`
    recorded in this process (the GEMM path per role and row band, the attention backend...)."""
    from kvserve.native.choices import choices

    got = choices()
    if not got:
        return
    g = GaugeMetricFamily(P + "kernel_choice", "The kernel a role runs in a row band on this machine (always 1); "
                          "source: measured, cached, default or forced.",
                          labels=["model_name", "role", "band", "choice", "source"])
    for c in got:
        g.add_metric([model_name, c.role, c.band, c.choice, c.source], 1.0)
    yield g


SOURCES = ("pool", "host", "disk", "remote", "computed")


def sources_of(req: FinishedRequest) -> dict[str, int]:
    """A finished request's prompt tokens by where their KV came from (sums to its prompt tokens)."""
    out = {s: req.kv_hit_tokens.get(s, 0) for s in SOURCES[:-1]}
    out["computed"] = max(0, req.prompt_tokens - req.cached_tokens)
    return out


class ServerMetrics:
    """The registry behind ``GET /metrics``; also an :class:`EngineListener`."""

    def __init__(self, model_name: str, prices: Prices | None = None) -> None:
        self.prices = prices or Prices()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc.
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)
        label = {"model_name": model_name}

        def hist(name: str, doc: str, buckets: tuple[float, ...], prefix: str = P) -> Histogram:
            return Histogram(prefix + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(**label)

        def counter(name: str, doc: str, prefix: str = P) -> Counter:
            return Counter(prefix + name, doc, ["model_name"], registry=self.registry).labels(**label)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
                        ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the end of the request.", E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self.kv_gib_s = hist("request_kv_gib_seconds",
                             "KV memory a finished request held, integrated over its life (GiB x s).",
                             KV_GIB_S_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (all samples).")
        self._finished = Counter(P + "request_success", "Finished requests by finish reason.",
                                 ["model_name", "finish_reason"], registry=self.registry)
        self._model_name = model_name
        self._source = Counter(P + "prompt_tokens_by_source", "Prompt tokens of finished requests by where their "
                               "KV came from: pool, host, disk, remote (reused) or computed.",
                               ["model_name", "source"], registry=self.registry)
        self._miss = Counter(P + "prefix_cache_miss_tokens", "Prompt tokens of finished requests not found in "
                             "the prefix cache, by reason (never_seen, evicted:<policy>, dropped_window, "
                             "dropped_policy, different_salt, different_codec, partial_block, tier_load_failed).",
                             ["model_name", "reason"], registry=self.registry)
        self._cost = Counter(P + "cost", "What finished requests cost at the configured prices (per kind: input, "
                             "cached_input, output, cache_write; saved_by_cache is what the cache saved).",
                             ["model_name", "kind"], registry=self.registry)
        # vLLM's names for the same events
        self.v_ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           TTFT_BUCKETS, V)
        self.v_itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          ITL_BUCKETS, V)
        self.v_e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                          E2E_BUCKETS, V)
        self.v_queue = hist("request_queue_time_seconds", "Histogram of time spent in WAITING phase.",
                            E2E_BUCKETS, V)
        self.v_prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.", V)
        self.v_generation_tokens = counter("generation_tokens", "Number of generation tokens processed.", V)
        self._v_finished = Counter(V + "request_success", "Count of successfully processed requests.",
                                   ["model_name", "finished_reason"], registry=self.registry)

    def set_snapshot(self, snap: EngineSnapshot) -> None:
        self._engine.snapshot = snap

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- EngineListener (engine thread) ------------------------------------------------------
    def on_first_token(self, ttft_s: float, now: float) -> None:
        self.ttft.observe(ttft_s)
        self.v_ttft.observe(ttft_s)

    def on_token_gaps(self, gaps_s: list[float], now: float) -> None:
        for g in gaps_s:
            self.itl.observe(g)
            self.v_itl.observe(g)

    def on_finished(self, req: FinishedRequest, now: float) -> None:
        self.e2e.observe(req.e2e_s)
        self.v_e2e.observe(req.e2e_s)
        if req.queue_s is not None:
            self.queue.observe(req.queue_s)
            self.v_queue.observe(req.queue_s)
        self.kv_gib_s.observe(req.kv_gib_s)
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(req.generation_tokens)
        self.v_prompt_tokens.inc(req.prompt_tokens)
        self.v_generation_tokens.inc(req.generation_tokens)
        for source, n in sources_of(req).items():
            self._source.labels(model_name=self._model_name, source=source).inc(n)
        for reason, n in req.kv_miss_tokens.items():
            self._miss.labels(model_name=self._model_name, reason=reason).inc(n)
        if self.prices.enabled:
            cost = self.prices.cost(req.prompt_tokens, req.cached_tokens, req.generation_tokens,
                                    req.cache_write_tokens)
            for kind in ("input", "cached_input", "output", "saved_by_cache", "cache_write"):
                if kind in cost:
                    self._cost.labels(model_name=self._model_name, kind=kind).inc(cost[kind])
        reason = str(req.finish_reason)
        self._finished.labels(model_name=self._model_name, finish_reason=reason).inc()
        self._v_finished.labels(model_name=self._model_name, finished_reason=reason).inc()
