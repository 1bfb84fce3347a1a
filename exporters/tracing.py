"""One OpenTelemetry span per request: GenAI semantic conventions plus kvlease.* attributes.

Off by default; on with `kvlease serve --otel` or `KVLEASE_OTEL=1`. Spans go
out through the standard OTLP exporter settings (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL` =
`http/protobuf` (default) or `grpc`, headers, timeouts, `OTEL_SERVICE_NAME`).

A span needs two halves that reach the API process separately: vLLM's
`FinishedRequestStats` (stat-logger plugin: tokens, latency) and the
scheduler's events over the engine channel (block-seconds, preemptions, lease
changes). `SpanAssembler` joins them by request id and emits the span once
both have arrived, or after a timeout with what it has. The parent is the
request's incoming `traceparent` header, when it had one. Tokens and keys
never become attributes.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from exporters.metrics import kvlease_id

ENABLE_ENV = "KVLEASE_OTEL"
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/completions": "text_completion",
}
FINISH_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}


@dataclass
class _Pending:
    created: float  # monotonic, for the timeout
    entry: Any = None  # engine.server.InFlight
    stats: Any = None  # vLLM FinishedRequestStats
    done: dict | None = None  # the scheduler's RequestDone event
    events: list[dict] = field(default_factory=list)  # Preemption and LeaseEvent events


class SpanAssembler:
    """Joins per-request halves into spans. Thread-safe: engine events come from the
    channel thread, stats from the event loop. Memory: at most `max_pending` requests."""

    def __init__(self, tracer: Tracer, timeout: float = 30.0, max_pending: int = 10_000) -> None:
        self.tracer = tracer
        self.timeout = timeout
        self.max_pending = max_pending
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def engine_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind not in ("Preemption", "LeaseEvent", "RequestDone"):
            return
        key = kvlease_id(event.get("request_id"))
        if key is None:
            return
        with self._lock:
            pending = self._get(key)
            if kind == "RequestDone":
                pending.done = event
            else:
                pending.events.append(event)
            ready = self._take_if_ready(key)
        if ready:
            self._emit(ready)

    def request_stats(self, stats: Any, entry: Any) -> None:
        key = kvlease_id(stats.request_id)
        if key is None:
            return
        with self._lock:
            pending = self._get(key)
            pending.stats, pending.entry = stats, entry
            ready = self._take_if_ready(key)
            stale = self._take_stale(keep=key)
        for item in ([ready] if ready else []) + stale:
            self._emit(item)

    def flush(self) -> None:
        """Emit everything that has its stats (at shutdown)."""
        with self._lock:
            items = [p for p in self._pending.values() if p.stats is not None]
            self._pending.clear()
        for item in items:
            self._emit(item)

    def _get(self, key: str) -> _Pending:
        pending = self._pending.get(key)
        if pending is None:
            if len(self._pending) >= self.max_pending:
                self._pending.pop(next(iter(self._pending)))  # the oldest
            pending = self._pending[key] = _Pending(time.monotonic())
        return pending

    def _take_if_ready(self, key: str) -> _Pending | None:
        pending = self._pending[key]
        if pending.stats is not None and pending.done is not None:
            return self._pending.pop(key)
        return None

    def _take_stale(self, keep: str) -> list[_Pending]:
        cutoff = time.monotonic() - self.timeout
        stale = [k for k, p in self._pending.items() if p.created < cutoff and k != keep]
        return [p for p in (self._pending.pop(k) for k in stale) if p.stats is not None]

    def _emit(self, p: _Pending) -> None:
        stats, entry, done = p.stats, p.entry, p.done or {}
        end_ns = entry.started_ns + int(stats.e2e_latency * 1e9) if entry else time.time_ns()
        start_ns = entry.started_ns if entry else end_ns - int(stats.e2e_latency * 1e9)
        operation = OPERATIONS.get(entry.path, "generate_content") if entry else "generate_content"
        model = (entry.model if entry else None) or "unknown"
        parent = None
        if entry is not None and entry.traceparent:
            parent = TraceContextTextMapPropagator().extract({"traceparent": entry.traceparent})
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.response.id": stats.request_id,
            "gen_ai.response.finish_reasons": [FINISH_REASONS.get(int(stats.finish_reason), "")],
            "gen_ai.usage.input_tokens": stats.num_prompt_tokens,
            "gen_ai.usage.output_tokens": stats.num_generation_tokens,
            "kvlease.cached_input_tokens": stats.num_cached_tokens,
            "kvlease.preemptions": stats.num_preemptions,
        }
        if entry is not None:
            ctx = entry.ctx
            attributes["kvlease.tenant_id"] = ctx.tenant_id
            attributes["kvlease.tier"] = ctx.tier
            if ctx.session_id:
                attributes["kvlease.session_id"] = ctx.session_id
        if done:
            attributes["kvlease.kv_block_seconds"] = done["block_seconds"]
            attributes["kvlease.recomputed_tokens"] = done["discarded_tokens"]
        attributes["kvlease.lease_active"] = any(
            e["type"] == "LeaseEvent" and e["kind"] in ("start", "renew") for e in p.events
        )
        span = self.tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=start_ns,
        )
        for event in p.events:
            span.add_event(*_span_event(event))
        span.end(end_time=max(end_ns, start_ns))


def _span_event(event: dict) -> tuple[str, dict, int]:
    """(name, attributes, wall-clock ns) for an engine event stamped on the monotonic clock."""
    at_ns = time.time_ns() - int((time.monotonic() - event["at"]) * 1e9)
    if event["type"] == "Preemption":
        attributes = {
            "kvlease.preemption.reason": event["reason"],
            "kvlease.preemption.mode": event["mode"],
            "kvlease.preemption.blocks": event["blocks"],
            "kvlease.preemption.discarded_tokens": event["discarded_tokens"],
        }
        return "kvlease.preemption", attributes, at_ns
    attributes = {"kvlease.lease.kind": event["kind"], "kvlease.tier": event["tier"]}
    return f"kvlease.lease.{event['kind']}", attributes, at_ns


_assembler: SpanAssembler | None = None
_provider: Any = None
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").lower() in ("1", "true", "yes", "on")


def install() -> SpanAssembler | None:
    """The process's assembler, exporting over OTLP, or None when tracing is off."""
    global _assembler, _provider
    with _lock:
        if _assembler is not None or not enabled():
            return _assembler
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from exporters.engine_view import VIEW

        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        )
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvlease")})
        _provider = TracerProvider(resource=resource)  # kvlease's own: vLLM's stays untouched
        _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _assembler = SpanAssembler(_provider.get_tracer("kvlease"))
        VIEW.add_listener(_assembler.engine_event)
        return _assembler


def shutdown() -> None:
    """Emit what is pending and flush the exporter (on SIGTERM)."""
    if _assembler is not None:
        _assembler.flush()
    if _provider is not None:
        _provider.shutdown()
