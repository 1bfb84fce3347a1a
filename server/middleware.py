"""TenantMiddleware: the front door of vLLM's OpenAI server (pure ASGI).

It runs before any vLLM route. For every non-public request it verifies the
Bearer JWT (`kvlease.engine.auth`), and for a JSON POST it rewrites the body so the
engine sees only server-chosen tenant fields:

- `vllm_xargs` = {tenant_id, tier, session_id} from the verified token,
- `cache_salt` = HMAC-SHA256(server key, tenant_id): prefix-cache hits never
  cross tenants (the timing side channel of CVE-2025-46570),
- `priority` = the tier's priority,

dropping whatever the client sent in those fields, and the `X-Request-Id` and
`X-Vllm-Priority` headers vLLM would otherwise honour. Errors never raise
(an exception in middleware is a 500): they are answered here, in OpenAI's
error shape. Use it with `kvlease serve`, or alone on a plain vLLM server:
`--middleware kvlease.server.middleware.TenantMiddleware`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from pydantic import TypeAdapter, ValidationError

from kvlease.engine.affinity import RANK_HEADER, session_rank
from kvlease.engine.auth import (
    ID_RULE,
    KEYS_ENV,
    Authenticator,
    AuthError,
    AuthSettings,
    KeyConfigError,
    KeyRing,
    valid_id,
)
from kvlease.engine.budgets import Verdict, estimate
from kvlease.engine.labels import TenantLabels
from kvlease.engine.tenancy import TenantContext, TierTable
from kvlease.exporters.join import InFlight, new_request_id
from kvlease.exporters.ledger import MODEL_LENGTH
from kvlease.exporters.metrics import multiprocess
from kvlease.exporters.periods import period
from kvlease.exporters.spend import Hold
from kvlease.exporters.telemetry import TELEMETRY
from kvlease.exporters.writer import wait_seconds

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

logger = logging.getLogger("kvlease.server")
SALT_KEY_ENV = "KVLEASE_CACHE_SALT_KEY"
MAX_BODY_ENV = "KVLEASE_MAX_BODY_BYTES"
# Bytes of request bodies this API process holds at once (read, parsed, handed to vLLM
# until its response ends): past it a new body waits for none of them, it gets a 503.
BODIES_ENV = "KVLEASE_MAX_BODY_BYTES_IN_FLIGHT"
METRICS_AUTH_ENV = "KVLEASE_METRICS_AUTH"
# vLLM's --data-parallel-size, which `kvlease serve` copies here: the ranks to pin over.
DATA_PARALLEL_ENV = "KVLEASE_DATA_PARALLEL_SIZE"
METRICS_ROLES = frozenset({"metrics", "admin"})
PUBLIC_PREFIXES = ("/metrics/",)  # vLLM mounts its Prometheus app at /metrics
PUBLIC_PATHS = frozenset(
    {
        "/health",
        "/ready",
        "/ping",
        "/version",
        "/metrics",
        "/openapi.json",
        "/docs",
        "/redoc",
        "/docs/oauth2-redirect",
    }
)
TENANT_PREFIXES = ("/v1/", "/inference/")
TENANT_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/invocations"}
)
# Operational routes that would touch every tenant: abort anyone's request, swap adapters.
ADMIN_PATHS = frozenset(
    {"/inference/v1/abort_requests", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
)
RESPONSES_PATH = "/v1/responses"
RESPONSE_ROUTES = frozenset({"render"})  # /v1/responses/<name> routes that are not an id
MAX_RESPONSE_OWNERS = 100_000  # stored responses whose tenant is remembered (LRU)
# Routes whose successful responses are engine requests with a usage record.
GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/completions",
        RESPONSES_PATH,
        "/v1/messages",
        "/inference/v1/generate",
        "/invocations",
    }
)
# Tenant routes that never make an engine request (and /v1/responses/<id>[/cancel]).
ENGINE_FREE_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/count_tokens",
    }
)
# Tenant routes whose request models have no `vllm_xargs`: their engine requests would run
# unclassified and unbilled, so kvlease does not serve them to tenants.
REFUSED_PATHS = frozenset({"/v1/systemone"})
# kvlease chooses the request id, the priority and the rank (kvlease.engine.affinity), not clients.
DROPPED_HEADERS = frozenset({b"x-request-id", b"x-vllm-priority", RANK_HEADER})
SESSION_HEADER = b"x-session-id"
STATE_KEY = "kvlease_tenant"  # request.state.kvlease_tenant: the verified TenantContext
# Set when the server begins its SIGTERM drain (`kvlease serve` sets it, kvlease.server.serve):
# requests arriving then get 503 instead of reaching a half-stopped vLLM, and so does one
# the drain overtakes inside vLLM before its response began (`TenantMiddleware._forward`).
DRAINING = threading.Event()


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ConfigError(ValueError):
    """The server cannot start with this configuration."""


@dataclass(frozen=True)
class ServerConfig:
    authenticator: Authenticator
    tiers: TierTable
    salt_key: bytes
    max_body_bytes: int = 16 * 1024 * 1024
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    metrics_auth: bool = False  # /metrics needs a token with the metrics (or admin) role
    data_parallel_size: int = 1  # engines behind this server; sessions are pinned to one

    @classmethod
    def from_env(cls) -> ServerConfig:
        """Everything from `KVLEASE_*` variables; raises ConfigError with the fix."""
        try:
            tiers = TierTable.load()
            auth = Authenticator(
                KeyRing.from_config(), tiers, AuthSettings.from_env(), os.environ.get(KEYS_ENV)
            )
        except (KeyConfigError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc
        raw_key = os.environ.get(SALT_KEY_ENV)
        if raw_key is not None and len(raw_key.encode()) < 32:
            raise ConfigError(f"{SALT_KEY_ENV} must be at least 32 bytes")
        # Without a configured key the salt is per process: prefix caches do not
        # outlive a restart anyway.
        salt_key = raw_key.encode() if raw_key else secrets.token_bytes(32)
        try:
            max_body = int(os.environ.get(MAX_BODY_ENV, 16 * 1024 * 1024))
            bodies = int(os.environ.get(BODIES_ENV, 4 * max_body))
        except ValueError:
            raise ConfigError(f"{MAX_BODY_ENV} and {BODIES_ENV} are numbers of bytes") from None
        if not 0 < max_body <= bodies:
            raise ConfigError(f"need 0 < {MAX_BODY_ENV} <= {BODIES_ENV}")
        try:
            TenantLabels.from_env()  # labels are made in two processes: fail here, not there
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        metrics_auth = os.environ.get(METRICS_AUTH_ENV, "").lower() in ("1", "true", "yes", "on")
        ranks = os.environ.get(DATA_PARALLEL_ENV, "1")
        if not ranks.isdigit() or int(ranks) < 1:
            raise ConfigError(f"{DATA_PARALLEL_ENV} must be a whole number >= 1, not {ranks!r}")
        return cls(auth, tiers, salt_key, max_body, bodies, metrics_auth, int(ranks))

    def cache_salt(self, tenant_id: str) -> str:
        return hmac.new(self.salt_key, tenant_id.encode(), hashlib.sha256).hexdigest()


def error_payload(status: int, message: str, code: str) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps(error_payload(status, message, code)).encode()


async def send_error(send: Send, status: int, message: str, code: str, headers=()) -> None:
    body = error_body(status, message, code)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _shutting_down(send: Send) -> None:
    await send_error(
        send,
        503,
        "the server is shutting down; retry on another replica",
        "shutting_down",
        [(b"retry-after", b"5"), (b"connection", b"close")],
    )


def _is_metrics(path: str) -> bool:
    return path == "/metrics" or path.startswith("/metrics/")


def _is_preflight(scope: Scope) -> bool:
    """A CORS preflight as Starlette's CORSMiddleware recognises one (and answers itself)."""
    return (
        scope["method"] == "OPTIONS"
        and _header(scope, b"origin") is not None
        and _header(scope, b"access-control-request-method") is not None
    )


async def _multiprocess_metrics(send: Send) -> None:
    """`/metrics` under `--api-server-count` > 1. vLLM's own route then reads only
    prometheus_client's multiprocess files, so it would miss kvlease's collector; this
    answers with both: every process's files (vLLM's series and kvlease's per-process
    counters, summed) plus the engine series, which every API process holds whole."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    if TELEMETRY.metrics is not None:
        registry.register(TELEMETRY.metrics)
    body = generate_latest(registry)
    headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def route_class(path: str) -> str:
    """Who may call `path`: "public" (anyone), "tenant" (any verified token) or "admin"
    (role-gated: /admin/* checks its own roles; every other route, such as vLLM's
    operational endpoints, needs the admin role)."""
    if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
        return "public"
    if path in ADMIN_PATHS:
        return "admin"
    if path.startswith(TENANT_PREFIXES) or path in TENANT_PATHS:
        return "tenant"
    return "admin"


def engine_requests(path: str, doc: dict[str, Any]) -> int | None:
    """How many engine requests vLLM makes of this body (None: only known at its end).

    Fields are read as vLLM's request models read them (pydantic's lax mode: `"n": 3.0`
    and `"n": "3"` are 3). `n` choices per prompt; a list of prompts on /v1/completions
    and on /invocations, which serves a completion body as /v1/completions does; one
    conversation each on /v1/chat/completions/batch; /v1/responses may loop through
    sub-requests (tools). A malformed field counts as 1: vLLM refuses the body before any
    engine request. The join also waits for the response's end, so a count that comes
    out low never cuts a record short (kvlease.exporters.join)."""
    if path == RESPONSES_PATH:
        return None
    params = doc.get("sampling_params") if path == "/inference/v1/generate" else doc
    n = _lax(int, params.get("n", 1)) if isinstance(params, dict) else 1
    n = n if isinstance(n, int) and n >= 1 else 1
    if path == "/v1/chat/completions/batch":
        conversations = doc.get("messages")
        return len(conversations) if isinstance(conversations, list) and conversations else 1
    prompt = doc.get("prompt")
    completion = path == "/v1/completions" or (path == "/invocations" and "messages" not in doc)
    if completion and isinstance(prompt, list) and prompt:
        one_prompt_of_token_ids = all(type(t) is int for t in prompt)
        return n if one_prompt_of_token_ids else n * len(prompt)
    return n


def makes_engine_requests(path: str) -> bool:
    """Whether a POST on this tenant route may become engine requests."""
    return path not in ENGINE_FREE_PATHS and not path.startswith(f"{RESPONSES_PATH}/")


def refused_fields(doc: dict[str, Any]) -> str | None:
    """Why vLLM may not run this body for a tenant, or None.

    Beam search sends each step as new engine requests built without the body's
    `vllm_xargs`, `cache_salt` and `priority`: they would run unclassified, at priority 0
    and unsalted, and bill one token of each."""
    if _lax(bool, doc.get("use_beam_search", False)) is True:
        return "beam search (use_beam_search) is not served by kvlease"
    model = doc.get("model")
    if isinstance(model, str) and len(model) > MODEL_LENGTH:
        return f"'model' is longer than {MODEL_LENGTH} characters"  # no ledger takes it
    return None


_ADAPTERS: dict[type, TypeAdapter] = {int: TypeAdapter(int), bool: TypeAdapter(bool)}


def _lax(kind: type, value: Any) -> Any:
    """`value` as pydantic's lax mode (vLLM's request models) reads it, or None."""
    try:
        return _ADAPTERS[kind].validate_python(value)
    except ValidationError:
        return None


class TenantMiddleware:
    """Verifies tenants and rewrites their requests; see the module docstring.

    In-flight requests per tenant are counted here (one API process) to
    enforce the tier's `max_concurrent_requests` with HTTP 429. The tenant of each
    response it let through `/v1/responses` is remembered (the last 100,000, as vLLM's
    response store lives in this process too), so `/v1/responses/{id}` and its
    `/cancel` answer only that tenant (and admins): 404 to anyone else.
    """

    def __init__(self, app: Callable, config: ServerConfig | None = None) -> None:
        self.app = app
        self.config = config or ServerConfig.from_env()
        self.in_flight: Counter[str] = Counter()
        self.body_bytes = 0  # of the request bodies this process holds (BODIES_ENV)
        self._response_owner: OrderedDict[str, str] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # A websocket body cannot be rewritten, so it would reach the engine unsalted.
            await send({"type": "websocket.close", "code": 1008, "reason": "not served"})
            return
        route = "public"  # lifespan
        if scope["type"] == "http":
            route = route_class(scope["path"])
            if self.config.metrics_auth and _is_metrics(scope["path"]):
                route = "metrics"
            elif _is_preflight(scope):
                # A CORS preflight carries no credentials; vLLM's CORSMiddleware, inside
                # this one, answers it without reaching a route. Any other OPTIONS request
                # reaches the route like a GET would, so it is checked like one.
                route = "public"
        if route == "public":
            if _is_metrics(scope.get("path", "")) and multiprocess():
                await _multiprocess_metrics(send)
                return
            await self.app(scope, receive, send)
            return
        if DRAINING.is_set() and route == "tenant":
            await _shutting_down(send)
            return
        ctx = await self._verify(scope, send, route)
        if ctx is None:
            return  # already answered with an error
        scope.setdefault("state", {})[STATE_KEY] = ctx
        if route == "metrics" and multiprocess():
            await _multiprocess_metrics(send)
        elif route == "tenant":
            await self._tenant_request(scope, receive, send, ctx)
        else:
            await self.app(scope, receive, send)

    async def _verify(self, scope: Scope, send: Send, route: str) -> TenantContext | None:
        """The verified identity, or None after answering 401/403."""
        try:
            ctx = self.config.authenticator.authenticate(_header(scope, b"authorization"))
        except AuthError as err:
            await self._refuse(send, err.status, err.message, err.code)
            return None
        # /admin/* checks its own roles; any other admin route needs the admin role.
        if (
            route == "admin"
            and not scope["path"].startswith("/admin/")
            and "admin" not in ctx.roles
        ):
            await self._refuse(send, 403, "this route needs the 'admin' role", "role_not_allowed")
            return None
        if route == "metrics" and not (METRICS_ROLES & ctx.roles):
            await self._refuse(send, 403, "/metrics needs the 'metrics' role", "role_not_allowed")
            return None
        return ctx

    async def _tenant_request(
        self, scope: Scope, receive: Receive, send: Send, token_ctx: TenantContext
    ) -> None:
        """Count it against the tier's limit (before its body is read, so a slow body
        cannot slip past the limit), give it an id, rewrite its body, and follow its
        response: the usage record committed before the last byte."""
        if self._someone_elses_response(scope["path"], token_ctx):
            await send_error(send, 404, "no such response", "not_found")
            return
        if scope["path"] in REFUSED_PATHS:
            msg = f"{scope['path']} is not served by kvlease: its requests cannot be billed"
            await send_error(send, 404, msg, "not_supported")
            return
        ctx = await self._session(scope, send, token_ctx)
        if ctx is None:
            return  # already answered with an error
        budget = TELEMETRY.budgets.verdict(ctx.tenant_id) if TELEMETRY.budgets else None
        if budget is not None and budget.blocked:
            await send_error(
                send,
                429,
                f"tenant {ctx.tenant_id!r} has spent its monthly budget "
                f"({budget.budget.monthly} {self.config.tiers.currency}); it renews at the "
                "start of the next month (UTC)",
                "budget_exceeded",
                [(b"retry-after", str(_seconds_to_next_month()).encode())],
            )
            return
        limit = self.config.tiers[ctx.tier].max_concurrent_requests
        if limit is not None and self.in_flight[ctx.tenant_id] >= limit:
            await send_error(
                send,
                429,
                f"tenant {ctx.tenant_id!r} already has {limit} requests in flight "
                f"(tier {ctx.tier} limit)",
                "too_many_concurrent_requests",
                [(b"retry-after", b"1")],
            )
            return
        self.in_flight[ctx.tenant_id] += 1
        try:
            await self._admitted(scope, receive, send, ctx, _budget_headers(budget))
        finally:
            self.in_flight[ctx.tenant_id] -= 1
            if not self.in_flight[ctx.tenant_id]:
                del self.in_flight[ctx.tenant_id]

    async def _session(self, scope: Scope, send: Send, ctx: TenantContext) -> TenantContext | None:
        """The chat session the `X-Session-Id` header names, when the token names none (the
        claim wins): a chatbot backend keeps one token per tenant and names each
        conversation. Sessions live inside the verified tenant: leases, routing and the
        ledger key them by (tenant, session), so tenant A's "s1" is never tenant B's."""
        header = _header(scope, SESSION_HEADER)
        if header is None or ctx.session_id is not None:
            return ctx
        if not valid_id(header):
            await send_error(send, 400, f"X-Session-Id must be {ID_RULE}", "invalid_session_id")
            return None
        ctx = replace(ctx, session_id=header)
        scope["state"][STATE_KEY] = ctx
        return ctx

    async def _admitted(
        self, scope: Scope, receive: Receive, send: Send, ctx: TenantContext, headers=()
    ) -> None:
        request_id = new_request_id()
        entry = InFlight(ctx, scope["path"], time.time_ns(), _header(scope, b"traceparent"))
        kept = [(k, v) for k, v in scope["headers"] if k.lower() not in DROPPED_HEADERS]
        scope["headers"] = [*kept, (b"x-request-id", request_id.encode())]
        if ctx.session_id is not None and self.config.data_parallel_size > 1:
            rank = session_rank(ctx.tenant_id, ctx.session_id, self.config.data_parallel_size)
            scope["headers"].append((RANK_HEADER, str(rank).encode()))
        if scope["method"] != "POST":
            await self._forward(scope, receive, send, entry, request_id, None, headers)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return  # already answered with an error
        try:  # the body stays counted in `body_bytes` until its response has ended
            rewritten = await self._rewrite_body(scope, body, receive, send, entry, request_id)
            if rewritten is not None:
                receive, hold = rewritten
                await self._forward(scope, receive, send, entry, request_id, hold, headers)
        finally:
            self.body_bytes -= len(body)

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        entry: InFlight,
        request_id: str,
        hold: Hold | None,
        headers=(),
    ) -> None:
        """Hand the request to vLLM and follow its response to the usage record."""
        join, writer = TELEMETRY.join, TELEMETRY.writer
        record = None  # resolved once this request's usage record has committed
        if writer is not None and scope["path"] in GENERATION_PATHS:
            record = writer.expect(request_id)
        # Any POST on a tenant route may become engine requests (pooling routes, routes a
        # newer vLLM adds): the join hears of its end, so every one of them is billed.
        engine = scope["method"] == "POST" and makes_engine_requests(scope["path"])
        response = _Response(send, scope["path"], request_id, entry, record, engine, headers)
        join.in_flight[request_id] = entry
        try:
            await self.app(scope, receive, response.send)
        except Exception as exc:
            # The drain began while the request was on its way in: vLLM's renderer refuses
            # it ("cannot schedule new futures after shutdown"), a 500 unless answered here.
            if not DRAINING.is_set() or response.started:
                raise
            # Its type only: an exception's text may quote the request (the prompt, a header).
            logger.info(
                "request %s overtaken by the drain (%s): answered 503",
                request_id,
                type(exc).__name__,
            )
            await _shutting_down(send)
        finally:
            if hold is not None and TELEMETRY.budgets is not None:
                TELEMETRY.budgets.release(hold)
            if record is not None and writer is not None:
                writer.forget(request_id)
            if engine and not response.ended:
                join.request_ended(request_id, entry)  # ended early: the engine half alone
            join.in_flight.pop(request_id, None)

    async def _refuse(self, send: Send, status: int, message: str, code: str) -> None:
        headers = [(b"www-authenticate", b'Bearer realm="kvlease"')] if status == 401 else []
        await send_error(send, status, message, code, headers)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body, its bytes counted in `body_bytes` (released by `_admitted` when
        the request ends); None after a 413 (one body too large), a 503 (the bodies in
        flight would pass their bound) or a disconnect."""
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                self.body_bytes += len(chunk)
                chunks.append(chunk)
                if size > self.config.max_body_bytes:
                    msg = f"request body is larger than {self.config.max_body_bytes} bytes"
                    await send_error(send, 413, msg, "body_too_large")
                    return None
                if self.body_bytes > self.config.max_body_bytes_in_flight:
                    msg = "the server holds as many request bodies as it may; retry shortly"
                    await send_error(send, 503, msg, "server_busy", [(b"retry-after", b"1")])
                    return None
                if not message.get("more_body", False):
                    size = 0  # kept: released when the request ends
                    return b"".join(chunks)
        finally:
            self.body_bytes -= size

    async def _rewrite_body(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        entry: InFlight,
        request_id: str,
    ) -> tuple[Receive, Hold | None] | None:
        """Put the tenant fields in the body, hold its estimated cost against the tenant's
        budget, and replay it to the app; None after answering with an error."""
        content_type = (_header(scope, b"content-type") or "application/json").split(";")[0]
        if content_type.strip().lower() != "application/json":
            # Only a JSON body can carry the tenant fields; anything else would reach
            # the engine unclassified and unsalted.
            await send_error(
                send, 415, "kvlease accepts JSON request bodies only", "unsupported_media_type"
            )
            return None
        try:
            doc = json.loads(body) if body else None
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, huge ints, deep nesting
            reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
            await send_error(send, 400, f"request body is not valid JSON: {reason}", "invalid_json")
            return None
        hold = None
        if isinstance(doc, dict):
            refused = refused_fields(doc)
            if refused is not None:
                await send_error(send, 400, refused, "unsupported_parameter")
                return None
            if not self._may_continue(doc, entry.ctx):
                # The same answer as vLLM's for an id it never stored: ids cannot be probed.
                msg = f"Response with id '{doc['previous_response_id']}' not found."
                await send_error(send, 404, msg, "not_found")
                return None
            entry.engine_requests = engine_requests(scope["path"], doc)
            if TELEMETRY.budgets is not None and TELEMETRY.budgets.verdict(entry.ctx.tenant_id):
                choices = entry.engine_requests or 1
                hold = await self._hold(send, doc, len(body), choices, entry.ctx)
                if hold is None:
                    return None  # already answered with an error
            body = self._with_tenant_fields(doc, scope["path"], entry, request_id)
            scope["headers"] = [
                (k, v) for k, v in scope["headers"] if k.lower() != b"content-length"
            ] + [(b"content-length", str(len(body)).encode())]
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnects reach vLLM as usual

        return replay, hold

    async def _hold(
        self, send: Send, doc: dict, size: int, choices: int, ctx: TenantContext
    ) -> Hold | None:
        """Hold the request's estimated cost (kvlease.engine.budgets.estimate) against the
        tenant's budget; None after a 429 when a `block` budget cannot take it."""
        prices = self.config.tiers[ctx.tier].prices
        amount = estimate(size, doc, choices, prices.input_per_1k, prices.output_per_1k)
        assert TELEMETRY.budgets is not None  # the caller checked
        hold = TELEMETRY.budgets.hold(ctx.tenant_id, amount)
        if hold is None:
            await send_error(
                send,
                429,
                f"tenant {ctx.tenant_id!r}: this request (up to {amount:.6f} "
                f"{self.config.tiers.currency}) with those in flight could pass its monthly "
                "budget; it renews at the start of the next month (UTC)",
                "budget_exceeded",
                [(b"retry-after", b"1")],
            )
        return hold

    def _someone_elses_response(self, path: str, ctx: TenantContext) -> bool:
        parts = path.split("/")  # "", "v1", "responses", id[, "cancel"]
        if len(parts) < 4 or parts[:3] != ["", "v1", "responses"] or parts[3] in RESPONSE_ROUTES:
            return False
        return "admin" not in ctx.roles and self._response_owner.get(parts[3]) != ctx.tenant_id

    def _may_continue(self, doc: dict[str, Any], ctx: TenantContext) -> bool:
        """A `previous_response_id` names one of this tenant's own stored responses."""
        previous = doc.get("previous_response_id")
        if previous is None or "admin" in ctx.roles:
            return True
        return self._response_owner.get(str(previous)) == ctx.tenant_id

    def _remember_response(self, response_id: str, tenant_id: str) -> None:
        self._response_owner[response_id] = tenant_id
        if len(self._response_owner) > MAX_RESPONSE_OWNERS:
            self._response_owner.popitem(last=False)

    def _with_tenant_fields(self, doc: dict, path: str, entry: InFlight, request_id: str) -> bytes:
        """The body as the engine must see it: only server-chosen tenant fields."""
        ctx = entry.ctx
        if isinstance(doc.get("model"), str):
            entry.model = doc["model"]
        if path == RESPONSES_PATH:
            # vLLM names a response's engine requests from the body, not X-Request-Id.
            doc["request_id"] = f"resp_{request_id}"
            self._remember_response(doc["request_id"], ctx.tenant_id)
        doc["vllm_xargs"] = ctx.extra_args()
        if isinstance(doc.get("sampling_params"), dict):  # /inference/v1/generate
            doc["sampling_params"]["extra_args"] = ctx.extra_args()
        doc["cache_salt"] = self.config.cache_salt(ctx.tenant_id)
        doc["priority"] = self.config.tiers[ctx.tier].priority
        # vLLM's own session field (KV events, its routers) names the verified session,
        # scoped by tenant, never what the client wrote.
        doc.pop("session_id", None)
        if ctx.session_id is not None:
            doc["session_id"] = f"{ctx.tenant_id}/{ctx.session_id}"
        return json.dumps(doc).encode()


class _Response:
    """One tenant response on its way out: the request id on it, vLLM's 501 (an API the
    served model does not have) turned into a 404 and its 500 during the drain into the
    drain's 503, and the last body chunk held until the usage record has committed
    (`record`), within a bound."""

    def __init__(
        self,
        send: Send,
        path: str,
        request_id: str,
        entry: InFlight,
        record: asyncio.Future | None,
        engine: bool,
        headers=(),
    ) -> None:
        self._send, self.path, self.request_id, self.record = send, path, request_id, record
        self.headers = [(b"x-request-id", request_id.encode()), *headers]
        self.entry, self.engine = entry, engine
        self.replaced = False  # answered with kvlease's own error; vLLM's body is dropped
        self.streaming = False  # a server-sent event stream
        self.hold = False
        self.started = False  # the response's start went out
        self.ended = False  # the last body chunk went out

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.hold = self.record is not None and message["status"] == 200
            self.streaming = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
            if 400 <= message["status"] < 500 and self.engine and TELEMETRY.metrics:
                TELEMETRY.metrics.request_refused(self.entry.ctx.tenant_id)
            if message["status"] == 501:
                self.replaced = True
                msg = f"{self.path} is not supported by the served model"
                await send_error(self._send, 404, msg, "not_supported", self.headers)
                return
            if message["status"] == 500 and DRAINING.is_set():  # vLLM's answer to the drain
                self.replaced = True
                await _shutting_down(self._send)
                return
            message["headers"] = [*message.get("headers", []), *self.headers]
        elif self.replaced:
            return
        else:  # a body chunk
            if self.streaming:
                # What a crash would leave unbilled, journaled by kvlease.exporters.open_records.
                self.entry.streamed_tokens += streamed_tokens(message.get("body", b""))
            if not message.get("more_body", False):
                if self.engine:
                    # Every engine request has produced its output: the join may count them.
                    TELEMETRY.join.request_ended(self.request_id, self.entry)
                if self.hold and self.record is not None:
                    await _until_committed(self.record, self.request_id)
                self.ended = True
        await self._send(message)


# A server-sent event carrying generated text: completions' "text", chat's "content",
# the Responses API's and Anthropic's text deltas; a role-only or usage-only event is not.
_TEXT_EVENT = re.compile(rb'^data: .*?"(?:text|content|delta)":"(?!")', re.MULTILINE)


def streamed_tokens(chunk: bytes) -> int:
    """Output tokens a body chunk of an SSE stream carries, counted as events with text:
    a lower bound (vLLM may put several tokens in one event)."""
    return len(_TEXT_EVENT.findall(chunk)) if b"data: " in chunk else 0


def _budget_headers(verdict: Verdict | None) -> list[tuple[bytes, bytes]]:
    """A budgeted tenant's responses say how much of the month's budget is spent, and,
    past it under `on_exceed = "warn"`, that it is exceeded."""
    if verdict is None:
        return []
    headers = [(b"x-kvlease-budget-used", f"{verdict.ratio:.4f}".encode())]
    if verdict.exceeded:
        headers.append((b"x-kvlease-budget", b"exceeded"))
    return headers


def _seconds_to_next_month() -> int:
    now = time.time()
    return max(1, int(period(now, "month")[1] - now))


async def _until_committed(record: asyncio.Future, request_id: str) -> None:
    """Hold the last byte until the usage record is durable, within a bound."""
    try:
        await asyncio.wait_for(asyncio.shield(record), wait_seconds())
    except TimeoutError:
        logger.warning("usage record for %s not committed in time; answering anyway", request_id)


def _header(scope: Scope, name: bytes, default: str | None = None) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return default
