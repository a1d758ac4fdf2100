"""The server's Prometheus metrics (text format at ``GET /metrics``).

Counted as requests go: requests by outcome, prompt and generated tokens, image-KV hits and misses,
time to first token and the time between a request's tokens (histograms), decode throughput. Read
at each scrape from the engine's last published state (``EngineState``; the arena is only touched
by the engine's thread): KV bytes in use and in all, sequences, image entries and evictions, the
queue depth and the running requests.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..results import GenerationStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
OUTCOMES = ("completed", "cancelled", "failed", "rejected")


class Metrics:
    """The metrics of one server, in their own registry (``registry``). ``state``: returns the
    engine's ``EngineState`` (read at each scrape)."""

    def __init__(self, state: Callable[[], object]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("conduit_requests", "Chat completion requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("conduit_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("conduit_generated_tokens", "Tokens generated", registry=r)
        self.decode_steps = Counter("conduit_decode_steps", "Batched decode turns (one token per running request)",
                                    registry=r)
        self.image_hits = Counter("conduit_image_kv_hits", "Images whose KV was reused", registry=r)
        self.image_misses = Counter("conduit_image_kv_misses", "Images whose KV was computed", registry=r)
        self.ttft = Histogram("conduit_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.token_latency = Histogram("conduit_time_per_output_token_seconds",
                                       "Time between two tokens of one request", buckets=TOKEN_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("conduit_decode_tokens_per_second",
                                  "Tokens the last batched decode step gave per second (all requests)", registry=r)
        self.batch_size = Gauge("conduit_decode_batch_size", "Sequences in the last batched decode step", registry=r)
        r.register(_StateCollector(state))

    def admitted(self, stats: GenerationStats) -> None:
        """A request's prefill is done: its prompt tokens and image-KV hits and misses."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.image_hits.inc(stats.image_hits)
        self.image_misses.inc(stats.image_misses)

    def step(self, n_tokens: int, seconds: float) -> None:
        """A decode step gave ``n_tokens`` tokens (one per running request) in ``seconds``."""
        self.generated_tokens.inc(n_tokens)
        self.decode_steps.inc()
        self.batch_size.set(n_tokens)
        if seconds > 0:
            self.tokens_per_s.set(n_tokens / seconds)


class _StateCollector(Collector):
    """Gauges and counters read from the engine's published state at each scrape."""

    def __init__(self, state: Callable[[], object]) -> None:
        self._state = state

    def collect(self) -> Iterator:
        state = self._state()
        arena = state.arena
        yield GaugeMetricFamily("conduit_queue_depth", "Requests waiting for admission", value=state.waiting)
        yield GaugeMetricFamily("conduit_running_requests", "Requests decoding", value=state.running)
        if arena is None:
            return
        yield GaugeMetricFamily("conduit_kv_bytes_used", "KV arena bytes in use (sequences and image entries)",
                                value=arena.bytes_used)
        yield GaugeMetricFamily("conduit_kv_bytes_total", "KV arena bytes in all", value=arena.bytes_total)
        yield GaugeMetricFamily("conduit_kv_image_bytes", "KV arena bytes held by image entries",
                                value=arena.image_bytes)
        yield GaugeMetricFamily("conduit_kv_sequences", "Sequences in the KV arena (running and kept prefixes)",
                                value=arena.n_seqs)
        yield GaugeMetricFamily("conduit_image_kv_entries", "Image entries in the image-KV store",
                                value=arena.n_image_entries)
        yield CounterMetricFamily("conduit_image_kv_evictions", "Image entries evicted from the image-KV store",
                                  value=arena.n_image_evictions)
