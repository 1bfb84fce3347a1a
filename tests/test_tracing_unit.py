"""Spans from the two halves of a request, through an in-memory exporter."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvlease.engine.events import LeaseEvent, Preemption, RequestDone
from kvlease.engine.tenancy import TenantContext
from kvlease.exporters.join import InFlight, RequestJoin
from kvlease.exporters.tracing import SpanBuilder

KVL = "kvl-" + "ab" * 16
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _join():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    join = RequestJoin()
    join.consumers.append(SpanBuilder(provider.get_tracer("test")))
    return join, exporter


@pytest.fixture
def spans():
    return _join()


def _entry():
    ctx = TenantContext("acme", "premium", frozenset(), "chat-1")
    return InFlight(
        ctx,
        "/v1/chat/completions",
        time.time_ns() - 2_000_000_000,
        f"00-{TRACE_ID}-{PARENT_ID}-01",
        "kvlease-demo",
    )


def _stats():
    return SimpleNamespace(
        request_id=f"chatcmpl-{KVL}",
        e2e_latency=1.5,
        num_prompt_tokens=12,
        num_generation_tokens=8,
        num_cached_tokens=4,
        num_preemptions=1,
        finish_reason=1,
    )


ENGINE_EVENTS = [
    LeaseEvent(
        at=time.monotonic(),
        tenant_id="acme",
        session_id="chat-1",
        tier="premium",
        kind="start",
        expires_at=None,
        request_id=f"chatcmpl-{KVL}",
    ),
    Preemption(
        at=time.monotonic(),
        request_id=f"chatcmpl-{KVL}",
        tenant_id="acme",
        tier="premium",
        session_id="chat-1",
        reason="kv_pressure",
        mode="recompute",
        blocks=3,
        recomputed_tokens=70,
    ),
    RequestDone(
        at=time.monotonic(),
        request_id=f"chatcmpl-{KVL}",
        tenant_id="acme",
        tier="premium",
        session_id="chat-1",
        status="finished_length_capped",
        preemptions=1,
        recomputed_tokens=70,
        block_seconds=2.25,
    ),
]


@pytest.mark.parametrize("stats_first", [True, False])
def test_one_span_per_request_with_genai_and_kvlease_attributes(spans, stats_first):
    assembler, exporter = spans
    if stats_first:
        assembler.request_stats(_stats(), _entry())
    for event in ENGINE_EVENTS:
        assembler.engine_event(event)
    if not stats_first:
        assembler.request_stats(_stats(), _entry())
    assert exporter.get_finished_spans() == ()  # the response has not ended yet
    assembler.request_ended(KVL, _entry())
    [span] = exporter.get_finished_spans()
    assert span.name == "chat kvlease-demo"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "kvlease-demo"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (12, 8)
    assert (a["kvlease.tenant_id"], a["kvlease.tier"]) == ("acme", "premium")
    assert a["kvlease.kv_block_seconds"] == 2.25 and a["kvlease.preemptions"] == 1
    assert a["kvlease.lease_active"] is True
    assert [e.name for e in span.events] == ["kvlease.lease.start", "kvlease.preemption"]
    preemption = span.events[1].attributes
    assert (preemption["kvlease.preemption.mode"], preemption["kvlease.preemption.blocks"]) == (
        "recompute",
        3,
    )
    assert span.end_time - span.start_time == 1_500_000_000
    assert not any(k == "token" or "secret" in k for k in a)


def test_requests_that_did_not_come_through_the_middleware_are_ignored(spans):
    assembler, exporter = spans
    assembler.engine_event(msgspec.structs.replace(ENGINE_EVENTS[2], request_id="plain-request"))
    assembler.flush()
    assert exporter.get_finished_spans() == ()
