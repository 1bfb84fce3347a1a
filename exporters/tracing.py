"""One OpenTelemetry span per request: GenAI semantic conventions plus kvlease.* attributes.

Off by default; on with `kvlease serve --otel` or `KVLEASE_OTEL=1`. Spans go
out through the standard OTLP exporter settings (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL` =
`http/protobuf` (default) or `grpc`, headers, timeouts, `OTEL_SERVICE_NAME`).

Spans are built from `kvlease.exporters.join.FinishedRequest`s: vLLM's stats
joined with the scheduler's events by request id. The parent is the
request's incoming `traceparent` header, when it had one. Tokens and keys
never become attributes.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvlease.engine.events import LeaseEvent, Preemption
from kvlease.exporters.join import FINISH_REASONS, FinishedRequest, RequestJoin

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

ENABLE_ENV = "KVLEASE_OTEL"
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/completions": "text_completion",
}


class SpanBuilder:
    """A RequestJoin consumer: one span per finished request."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def __call__(self, p: FinishedRequest) -> None:
        if not p.stats:
            return  # no vLLM stats (a request that never produced output): no span
        entry, latency = p.entry, p.e2e_latency or 0.0
        end_ns = entry.started_ns + int(latency * 1e9) if entry else time.time_ns()
        start_ns = entry.started_ns if entry else end_ns - int(latency * 1e9)
        operation = OPERATIONS.get(entry.path, "generate_content") if entry else "generate_content"
        model = (entry.model if entry else None) or "unknown"
        parent = None
        if entry is not None and entry.traceparent:
            parent = TraceContextTextMapPropagator().extract({"traceparent": entry.traceparent})
        reasons = [FINISH_REASONS.get(int(s.finish_reason), "") for s in p.stats]
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.response.id": p.stats[0].request_id,
            "gen_ai.response.finish_reasons": reasons,
            "gen_ai.usage.input_tokens": p.prompt_tokens,
            "gen_ai.usage.output_tokens": p.output_tokens,
            "kvlease.cached_input_tokens": p.cached_tokens,
            "kvlease.preemptions": p.preemptions,
        }
        if entry is not None:
            ctx = entry.ctx
            attributes["kvlease.tenant_id"] = ctx.tenant_id
            attributes["kvlease.tier"] = ctx.tier
            if ctx.session_id:
                attributes["kvlease.session_id"] = ctx.session_id
        if p.done:
            attributes["kvlease.kv_block_seconds"] = p.block_seconds
            attributes["kvlease.recomputed_tokens"] = p.recomputed_tokens
        attributes["kvlease.lease_active"] = any(
            isinstance(e, LeaseEvent) and e.kind in ("start", "renew") for e in p.events
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


def _span_event(event: Preemption | LeaseEvent) -> tuple[str, dict[str, Any], int]:
    """(name, attributes, wall-clock ns) for an engine event stamped on the monotonic clock."""
    at_ns = time.time_ns() - int((time.monotonic() - event.at) * 1e9)
    if isinstance(event, Preemption):
        attributes = {
            "kvlease.preemption.reason": event.reason,
            "kvlease.preemption.mode": event.mode,
            "kvlease.preemption.blocks": event.blocks,
            "kvlease.preemption.recomputed_tokens": event.recomputed_tokens,
        }
        return "kvlease.preemption", attributes, at_ns
    attributes = {"kvlease.lease.kind": event.kind, "kvlease.tier": event.tier}
    return f"kvlease.lease.{event.kind}", attributes, at_ns


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").lower() in ("1", "true", "yes", "on")


def install(join: RequestJoin) -> TracerProvider | None:
    """Add span building to `join`, exporting over OTLP, when tracing is on.

    Returns kvlease's own TracerProvider (vLLM's stays untouched), to shut down at the
    end; None when tracing is off."""
    if not enabled():
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as grpc

        exporter = grpc.OTLPSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http import trace_exporter as http

        exporter = http.OTLPSpanExporter()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvlease")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    join.consumers.append(SpanBuilder(provider.get_tracer("kvlease")))
    return provider
