"""Prometheus metrics (prometheus_client), one registry per app so tests can run several apps.

Under gunicorn with several workers, set PROMETHEUS_MULTIPROC_DIR: every worker then writes
its values to that directory and ``/metrics`` merges all workers (prometheus_client's
multiprocess mode; gauges sum the live workers). deploy/gunicorn.conf.py sets this up.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("llmx_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("llmx_queue_depth", "Sequences waiting for a batch row", registry=r,
                                 multiprocess_mode="livesum")
        self.running = Gauge("llmx_running_sequences", "Sequences holding a batch row (decoding or prefilling)",
                             registry=r, multiprocess_mode="livesum")
        self.ttft = Histogram("llmx_time_to_first_token_seconds", "From request accepted to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llmx_inter_token_latency_seconds", "Between consecutive tokens of one sequence",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("llmx_request_duration_seconds", "From request accepted to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmx_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("llmx_generation_tokens", "Tokens generated", registry=r)
        self.batch_size = Histogram("llmx_decode_batch_size", "Sequences decoded together per step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.embedding_batch_size = Histogram("llmx_embedding_batch_size", "Inputs embedded together per forward pass",
                                              buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.cancelled = Counter("llmx_cancelled_sequences", "Sequences stopped early because their client went away",
                                 registry=r)
        self.prefix_cache_hit_tokens = Counter("llmx_prefix_cache_hit_tokens", "Prompt tokens whose prefill the prefix cache saved",
                                               registry=r)
        self.prefix_cache_bytes = Gauge("llmx_prefix_cache_bytes", "KV bytes held by the prefix cache", registry=r,
                                        multiprocess_mode="livesum")
        self.draft_tokens = Counter("llmx_speculative_draft_tokens", "Tokens drafted for speculative decoding", registry=r)
        self.accepted_tokens = Counter("llmx_speculative_accepted_tokens", "Drafted tokens the model accepted", registry=r)

    def render(self) -> tuple[bytes, str]:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
