"""Prometheus metrics of the server (rank 0), on their own registry so that two servers in one
process (tests) never share counters. Names follow vLLM/SGLang's where they have one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# From 1 ms: a small model's TPOT on a CPU is a few ms (every one fell in the first bucket)
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                   60.0)


class ServerMetrics:
    def __init__(self, model: str, max_tau: int = 16) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name",)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model)

        self.running = gauge("dspark_num_requests_running", "requests holding a request slot")
        self.waiting = gauge("dspark_num_requests_waiting",
                             "requests waiting for admission (new, or preempted), summed over "
                             "attn_dp groups")
        self.kv_pages_used = gauge("dspark_kv_pages_used",
                                   "KV pages held by requests (reclaimable prefix-cache pages not "
                                   "counted), summed over attn_dp groups")
        # Not *_total: that suffix is the counters' (Prometheus naming; rate() of a gauge)
        self.kv_pages_capacity = gauge("dspark_kv_pages_capacity",
                                       "KV pages, summed over attn_dp groups")
        self.prompt_tokens = counter("dspark_prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("dspark_generation_tokens", "tokens generated")
        self.cached_tokens = counter("dspark_prefix_cached_tokens",
                                     "prompt positions of finished requests served from the "
                                     "prefix cache (hit rate: this / dspark_prompt_tokens)")
        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens: acceptance = ratio
        self.drafts = counter("dspark_spec_decode_draft_tokens",
                              "draft tokens verified, of finished requests")
        self.accepted_drafts = counter("dspark_spec_decode_accepted_tokens",
                                       "draft tokens the verification accepted, of finished "
                                       "requests")
        self.requests = Counter("dspark_requests", "finished requests by finish reason",
                                ("model_name", "finish_reason"), registry=r)
        self.rejected = Counter("dspark_requests_rejected", "requests answered with an error",
                                ("model_name", "status"), registry=r)
        self.ttft = histogram("dspark_time_to_first_token_seconds", "arrival to first token",
                              LATENCY_BUCKETS)
        self.tpot = histogram("dspark_time_per_output_token_seconds",
                              "(finish - first token) / (tokens - 1)", LATENCY_BUCKETS)
        self.tau = histogram("dspark_accept_length", "tokens committed per verify round (tau)",
                             tuple(float(k) for k in range(1, max_tau + 1)))
        self.model = model

    def finished(self, done) -> None:
        """A request's CompletionOutput."""
        self.requests.labels(self.model, done.finish_reason).inc()
        self.prompt_tokens.inc(len(done.prompt_token_ids))
        self.cached_tokens.inc(done.cached_tokens)
        self.drafts.inc(done.drafts)
        self.accepted_drafts.inc(done.accepted_drafts)
        if done.ttft_s is not None:
            self.ttft.observe(done.ttft_s)
        if done.tpot_s is not None:
            self.tpot.observe(done.tpot_s)
        for n in done.accept_lens:
            self.tau.observe(n)

    def refused(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
