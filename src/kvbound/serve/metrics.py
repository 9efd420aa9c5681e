"""The server's Prometheus metrics, in the `kvbound:` namespace (vLLM's names where vLLM has one).

Each server has a registry of its own, so that several can live in one process (tests)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("kvbound:num_requests_running", "Requests with a sequence running", registry=r)
        self.waiting = Gauge("kvbound:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("kvbound:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0-1)",
                              registry=r)
        self.blocks_used = Gauge("kvbound:kv_blocks_used", "KV pool blocks held by sequences", registry=r)
        self.prefix_queries = Counter("kvbound:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("kvbound:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Counter("kvbound:num_preemptions", "Sequences preempted (swapped out or recomputed "
                                   "later)", registry=r)
        self.swapped_out = Counter("kvbound:swapped_out_blocks", "KV blocks of preempted sequences copied to host "
                                   "memory", registry=r)
        self.swapped_in = Counter("kvbound:swapped_in_blocks", "KV blocks restored from host memory on resume",
                                  registry=r)
        self.recomputed = Counter("kvbound:recomputed_tokens", "Tokens processed again after a preemption",
                                  registry=r)
        self.committed = Gauge("kvbound:kv_committed_bytes", "Device memory under the KV pool (virtual storage: "
                               "the pages mapped and spare)", registry=r)
        self.tokens_evicted = Counter("kvbound:tokens_evicted", "Tokens evicted from finished requests' caches "
                                      "(per layer)", registry=r)
        self.prompt_tokens = Counter("kvbound:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("kvbound:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("kvbound:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("kvbound:time_per_output_token_seconds", "Mean time per output token after the first",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("kvbound:e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.step_time = Histogram("kvbound:engine_step_seconds", "Host time of one engine step (schedule, "
                                   "forward, sample)", registry=r, buckets=(0.001, 0.002, 0.004, 0.006, 0.008,
                                                                           0.01, 0.015, 0.02, 0.03, 0.05, 0.1,
                                                                           0.2, 0.5, 1.0))
        self.requests = Counter("kvbound:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("kvbound:requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self._seen = {"preemptions": 0, "prompt_tokens": 0, "prefix_hit_tokens": 0, "swapped_out_blocks": 0,
                      "swapped_in_blocks": 0, "recomputed_tokens": 0}

    def read_engine(self, engine, running_requests: int, waiting_requests: int):
        """Gauges and the scheduler's counters, read from the engine's thread when /metrics is scraped."""
        pool, stats = engine.pool, engine.scheduler.stats
        usable = pool.num_blocks - pool.reserved
        used = usable - pool.num_free
        self.blocks_used.set(used)
        self.kv_usage.set(used / usable if usable else 0.0)
        self.running.set(running_requests)
        self.waiting.set(waiting_requests)
        self.committed.set(pool.committed_bytes)
        for key, counter in (("preemptions", self.preemptions), ("prompt_tokens", self.prefix_queries),
                             ("prefix_hit_tokens", self.prefix_hits), ("swapped_out_blocks", self.swapped_out),
                             ("swapped_in_blocks", self.swapped_in), ("recomputed_tokens", self.recomputed)):
            counter.inc(stats[key] - self._seen[key])
            self._seen[key] = stats[key]

    def finished(self, out, arrival: float, now: float):
        """A finished request's latencies (from its arrival at the server) and eviction count."""
        times = out.token_times
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - arrival)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        self.e2e.observe(now - arrival)
        for c in out.outputs:
            self.tokens_evicted.inc(c.tokens_evicted)
            self.requests.labels(finished_reason=c.finish_reason or "abort").inc()
