"""The router's Prometheus metrics (``prefixcache:router_...``), in a registry of its own.

Prediction accuracy: for every response that reports ``usage.prompt_tokens_details.cached_tokens``,
the tokens the router predicted the backend would have cached and the tokens it did report; for a
``/v1/messages`` response, whose usage reports ``cache_read_input_tokens`` (read from retained blocks), the
retained run of the predicted hit and those.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ERROR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("backend",)) -> Counter:
            return Counter(f"prefixcache:router_{name}", doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("backend",)) -> Gauge:
            return Gauge(f"prefixcache:router_{name}", doc, labels, registry=registry)

        self.requests = counter("requests", "Requests sent to each backend (retried attempts included).")
        self.retries = counter("retries", "Attempts that failed before any byte was sent and were retried.")
        self.broken_responses = counter(
            "broken_responses", "Responses the backend broke off after bytes reached the client (not retried)."
        )
        self.unrouted = counter("unrouted", "Requests answered 503 because no backend could take them.", ())
        self.predicted_cached_tokens = counter(
            "predicted_cached_tokens", "Prompt tokens the router expected the backend to hold (reported requests)."
        )
        self.reported_cached_tokens = counter(
            "reported_cached_tokens", "Prompt tokens the backend reported as cached (usage.cached_tokens)."
        )
        self.reported_prompt_tokens = counter("reported_prompt_tokens", "Prompt tokens of reported requests.")
        self.prediction_error = Histogram(
            "prefixcache:router_prediction_error_tokens",
            "Absolute difference between predicted and reported cached tokens, per request.",
            buckets=ERROR_BUCKETS,
            registry=registry,
        )
        self.events_received = counter("events_received", "KV cache events applied to the index.")
        self.batches_dropped = counter("batches_dropped", "Event batches missed (a sequence gap replay did not fill).")
        self.replays = counter("replays", "Replay requests sent after a sequence gap or on (re)subscribing.")
        self.bad_event_messages = counter(
            "bad_event_messages",
            "KV event messages or events dropped as malformed or implausible, by reason (frames, sequence, payload, "
            "event).",
            ("backend", "reason"),
        )
        self.blocks_unindexed = counter(
            "blocks_unindexed",
            "Stored blocks of a content-keyed backend the router cannot key (extra keys beyond a LoRA, no tokens, "
            "an unknown parent).",
        )
        self.resyncs = counter("resyncs", "Times a backend's index entries were rebuilt (restart, reset, down).")
        self.index_blocks = gauge("index_blocks", "Distinct block hashes in the router's index.", ())
        self.backend_blocks = gauge("backend_blocks", "Block hashes the index holds for each backend.")
        self.backend_up = gauge("backend_up", "1 while the backend is in the rotation.")
        self.tokens_in_flight = gauge("tokens_in_flight", "Uncached prompt plus output tokens in flight.")
        self.requests_in_flight = gauge("requests_in_flight", "Requests in flight.")

    def observe_usage(self, backend: str, predicted: int, prompt_tokens: int, cached_tokens: int) -> None:
        self.predicted_cached_tokens.labels(backend).inc(predicted)
        self.reported_cached_tokens.labels(backend).inc(cached_tokens)
        self.reported_prompt_tokens.labels(backend).inc(prompt_tokens)
        self.prediction_error.observe(abs(predicted - cached_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
