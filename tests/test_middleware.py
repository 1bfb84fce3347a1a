"""TenantMiddleware as pure ASGI, in front of a recording app: no engine, milliseconds."""

import asyncio
import json
import logging

import pytest
from waiting import ticks_until

from kvlease.engine.auth import Authenticator, mint_token
from kvlease.server.middleware import ServerConfig, TenantMiddleware, engine_requests, route_class


class Recorder:
    """A stand-in for vLLM's app: records what reached it, answers 200."""

    def __init__(self):
        self.calls = []

    async def __call__(self, scope, receive, send):
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.calls.append((scope, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(app, path, method="POST", body=b"", headers=(), chunks=None):
    """Run one request through `app`; returns (status, headers, body)."""
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
    }
    parts = chunks if chunks is not None else [body]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), out


@pytest.fixture
def config(hs_ring, tiers):
    return ServerConfig(Authenticator(hs_ring, tiers), tiers, b"k" * 32, max_body_bytes=8192)


@pytest.fixture
def app(config):
    return TenantMiddleware(Recorder(), config)


def bearer(hs_ring, tiers, tenant="acme", tier="free", **kw):
    return (
        "Authorization",
        f"Bearer {mint_token(hs_ring, tiers, tenant_id=tenant, tier=tier, **kw)}",
    )


JSON = ("Content-Type", "application/json")


def test_verified_identity_replaces_every_client_tenant_field(app, config, hs_ring, tiers):
    client_body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "vllm_xargs": {"tenant_id": "victim", "tier": "premium"},
        "cache_salt": "victim-salt",
        "priority": -100,
    }
    status, headers, _ = call(
        app,
        "/v1/chat/completions",
        body=json.dumps(client_body).encode(),
        headers=[
            bearer(hs_ring, tiers, "acme", "standard", session_id="chat-1"),
            JSON,
            ("X-Request-Id", "forged"),
            ("X-Vllm-Priority", "-5"),
        ],
    )
    assert status == 200
    scope, body = app.app.calls[-1]
    doc = json.loads(body)
    assert doc["vllm_xargs"] == {"tenant_id": "acme", "tier": "standard", "session_id": "chat-1"}
    assert doc["cache_salt"] == config.cache_salt("acme") != config.cache_salt("victim")
    assert doc["priority"] == 1
    assert doc["messages"] == client_body["messages"]
    sent_headers = dict(scope["headers"])
    assert b"x-vllm-priority" not in sent_headers
    assert sent_headers[b"x-request-id"].startswith(b"kvl-")
    assert sent_headers[b"content-length"] == str(len(body)).encode()
    assert headers[b"x-request-id"] == sent_headers[b"x-request-id"]
    assert scope["state"]["kvlease_tenant"].tenant_id == "acme"


def test_salts_differ_per_tenant_and_per_server_key(config):
    other = ServerConfig(config.authenticator, config.tiers, b"z" * 32)
    assert config.cache_salt("a") != config.cache_salt("b")
    assert config.cache_salt("a") != other.cache_salt("a")


def test_a_body_split_across_messages_is_reassembled(app, hs_ring, tiers):
    raw = json.dumps({"model": "m", "prompt": "x" * 100}).encode()
    status, _, _ = call(
        app,
        "/v1/completions",
        chunks=[raw[:10], raw[10:50], raw[50:]],
        headers=[bearer(hs_ring, tiers), JSON],
    )
    assert status == 200
    assert json.loads(app.app.calls[-1][1])["prompt"] == "x" * 100


@pytest.mark.parametrize("path", ["/health", "/metrics", "/openapi.json", "/ready"])
def test_public_routes_need_no_token(app, path):
    assert call(app, path, method="GET")[0] == 200


@pytest.mark.parametrize(
    ("path", "roles", "status"),
    [
        ("/v1/models", (), 200),
        ("/pause", (), 403),
        ("/reset_prefix_cache", (), 403),
        ("/pause", ("admin",), 200),
        ("/admin/state", (), 200),  # the admin route itself checks the role
        ("/v1/load_lora_adapter", (), 403),  # would change every tenant's model
        ("/v1/unload_lora_adapter", (), 403),
        ("/v1/load_lora_adapter", ("admin",), 200),
    ],
)
def test_operational_routes_need_the_admin_role(app, hs_ring, tiers, path, roles, status):
    got, _, body = call(app, path, method="GET", headers=[bearer(hs_ring, tiers, roles=roles)])
    assert got == status
    if status == 403:
        assert json.loads(body)["error"]["code"] == "role_not_allowed"


def test_token_in_token_out_requests_carry_the_tenant_in_sampling_params(app, hs_ring, tiers):
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4, "extra_args": {"x": 1}}}
    call(
        app,
        "/inference/v1/generate",
        body=json.dumps(body).encode(),
        headers=[bearer(hs_ring, tiers, "acme", "premium"), JSON],
    )
    doc = json.loads(app.app.calls[-1][1])
    assert doc["sampling_params"]["extra_args"] == {"tenant_id": "acme", "tier": "premium"}
    assert doc["priority"] == 0 and doc["cache_salt"]


def test_route_classes():
    assert route_class("/inference/v1/abort_requests") == "admin"
    assert route_class("/inference/v1/generate") == "tenant"
    assert route_class("/v1/chat/completions") == "tenant"
    assert route_class("/tokenize") == "tenant"
    assert route_class("/metrics") == "public"
    assert route_class("/collective_rpc") == "admin"


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", [JSON], 400, "invalid_json"),
        (b"\xff\xfe", [JSON], 400, "invalid_json"),
        (
            b"prompt=hi",
            [("Content-Type", "application/x-www-form-urlencoded")],
            415,
            "unsupported_media_type",
        ),
        (b"x" * 9000, [JSON], 413, "body_too_large"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", [JSON], 400, "invalid_json"),  # int limit
        (b"[" * 2000 + b"]" * 2000, [JSON], 400, "invalid_json"),  # recursion
    ],
)
def test_bad_bodies_are_answered_in_openai_shape(app, hs_ring, tiers, body, headers, status, code):
    got, got_headers, out = call(
        app, "/v1/completions", body=body, headers=[bearer(hs_ring, tiers), *headers]
    )
    assert got == status
    assert got_headers[b"content-type"] == b"application/json"
    error = json.loads(out)["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    assert app.app.calls == []


def test_missing_token_is_a_401_with_a_bearer_challenge(app):
    status, headers, body = call(app, "/v1/models", method="GET")
    assert status == 401 and headers[b"www-authenticate"].startswith(b"Bearer")
    assert json.loads(body)["error"] == {
        "message": "an Authorization: Bearer <token> header is required",
        "type": "authentication_error",
        "param": None,
        "code": "missing_token",
    }


async def _post_status(app, auth, body_after: asyncio.Event | None = None) -> int:
    """One POST through `app` concurrently with others; its status. `body_after`: the
    body arrives only once that event is set (a slow client)."""
    sent = []

    async def receive():
        if body_after is not None:
            await body_after.wait()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [
            (auth[0].lower().encode(), auth[1].encode()),
            (b"content-type", b"application/json"),
        ],
    }
    await app(scope, receive, send)
    return sent[0]["status"]


def test_a_tenant_over_its_tier_concurrency_cap_gets_429(config, hs_ring, tiers):
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = TenantMiddleware(slow_app, config)
    auth = bearer(hs_ring, tiers, "busy", "free")  # free: 8 at a time

    async def main():
        tasks = [asyncio.create_task(_post_status(app, auth)) for _ in range(9)]
        await ticks_until(lambda: any(t.done() for t in tasks), "the ninth request refused")
        assert app.in_flight["busy"] == 8
        release.set()
        return sorted(await asyncio.gather(*tasks))

    assert asyncio.run(main()) == [200] * 8 + [429]
    assert app.in_flight == {}


def test_websockets_are_closed(app):
    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "websocket", "path": "/v1/realtime", "headers": []}, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "not served"}]


def test_an_api_the_model_does_not_support_is_a_404_not_a_501(config, hs_ring, tiers):
    async def unsupported(scope, receive, send):
        await send({"type": "http.response.start", "status": 501, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "NotImplementedError"}'})

    app = TenantMiddleware(unsupported, config)
    status, _, body = call(app, "/v1/systemone", body=b"{}", headers=[bearer(hs_ring, tiers), JSON])
    assert status == 404
    assert json.loads(body)["error"]["code"] == "not_supported"


def test_the_limit_counts_a_request_before_its_body_arrives(config, hs_ring, tiers):
    """50 requests whose bodies come a tick after their headers: 8 admitted (free's cap)."""
    release = asyncio.Event()
    app = TenantMiddleware(Recorder(), config)
    auth = bearer(hs_ring, tiers, "slow", "free")

    async def main():
        tasks = [asyncio.create_task(_post_status(app, auth, release)) for _ in range(50)]
        await ticks_until(lambda: sum(t.done() for t in tasks) == 42, "42 refused bodiless")
        release.set()
        return sorted(await asyncio.gather(*tasks))

    assert asyncio.run(main()) == [200] * 8 + [429] * 42
    assert app.in_flight == {}


PREFLIGHT = [("Origin", "https://chat.example"), ("Access-Control-Request-Method", "POST")]


def test_cors_preflights_are_not_refused(app):
    status, _, _ = call(app, "/v1/chat/completions", method="OPTIONS", headers=PREFLIGHT)
    assert status == 200  # answered by the app (vLLM's CORS middleware), not a 401


def test_an_options_request_that_is_no_preflight_needs_a_token(app):
    """OPTIONS reaches the route as a GET would (vLLM's /metrics app answers any method)."""
    for path in ("/v1/chat/completions", "/admin/state"):
        assert call(app, path, method="OPTIONS")[0] == 401
    assert call(app, "/v1/chat/completions", method="OPTIONS", headers=PREFLIGHT[:1])[0] == 401


@pytest.mark.parametrize("headers", [(), PREFLIGHT])
def test_options_never_opens_metrics_behind_metrics_auth(config, headers):
    import dataclasses

    app = TenantMiddleware(Recorder(), dataclasses.replace(config, metrics_auth=True))
    for path in ("/metrics", "/metrics/", "/metrics/x"):
        assert call(app, path, method="OPTIONS", headers=headers)[0] == 401
    assert app.app.calls == []


@pytest.mark.parametrize(
    ("path", "doc", "expected"),
    [
        ("/v1/chat/completions", {"messages": [], "n": 3}, 3),
        ("/v1/chat/completions", {"n": "three"}, 1),  # vLLM refuses it: no engine request
        ("/v1/chat/completions", {"n": 3.0}, 3),  # vLLM's models coerce as pydantic does
        ("/v1/chat/completions", {"n": "3"}, 3),
        ("/v1/chat/completions", {"n": 2.5}, 1),  # refused by vLLM
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": "2"}, 6),
        ("/invocations", {"prompt": ["a", "b", "c"]}, 3),  # served as /v1/completions
        ("/invocations", {"messages": [{}], "n": 2}, 2),  # served as chat
        ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, 4),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, 2),
        ("/v1/chat/completions/batch", {"messages": [[{}], [{}], [{}]]}, 3),
        ("/inference/v1/generate", {"sampling_params": {"n": 2}}, 2),
        ("/v1/responses", {"input": "hi"}, None),  # sub-requests: counted at its end
    ],
)
def test_engine_requests_are_counted_from_the_body(path, doc, expected):
    assert engine_requests(path, doc) == expected


@pytest.mark.parametrize("value", [True, "true", 1, "yes"])
def test_beam_search_is_refused_before_the_engine(app, hs_ring, tiers, value):
    """Its step requests would run without the tenant's fields, salt and priority."""
    body = json.dumps({"model": "m", "prompt": "hi", "use_beam_search": value}).encode()
    status, _, out = call(app, "/v1/completions", body=body, headers=[bearer(hs_ring, tiers), JSON])
    assert status == 400 and json.loads(out)["error"]["code"] == "unsupported_parameter"
    assert app.app.calls == []


def test_beam_search_off_is_served(app, hs_ring, tiers):
    body = json.dumps({"model": "m", "prompt": "hi", "use_beam_search": "false"}).encode()
    assert call(app, "/v1/completions", body=body, headers=[bearer(hs_ring, tiers), JSON])[0] == 200


def test_vllms_session_field_is_the_verified_session(app, hs_ring, tiers):
    body = json.dumps({"model": "m", "messages": [], "session_id": "someone-else"}).encode()
    path = "/v1/chat/completions"
    call(app, path, body=body, headers=[bearer(hs_ring, tiers, session_id="s1"), JSON])
    call(app, path, body=body, headers=[bearer(hs_ring, tiers), JSON])
    sent = [json.loads(b).get("session_id") for _, b in app.app.calls]
    assert sent == ["acme/s1", None]


def test_only_the_owner_continues_a_stored_response(app, hs_ring, tiers):
    """Another tenant's id and a made-up one get the same 404: ids cannot be probed."""
    first = json.dumps({"model": "m", "input": "hi"}).encode()
    _, headers, _ = call(app, "/v1/responses", body=first, headers=[bearer(hs_ring, tiers), JSON])
    mine = f"resp_{headers[b'x-request-id'].decode()}"
    answers = {}
    for tenant, previous in (("acme", mine), ("mallory", mine), ("mallory", "resp_made_up")):
        body = json.dumps({"model": "m", "input": "go on", "previous_response_id": previous})
        status, _, out = call(
            app, "/v1/responses", body=body.encode(), headers=[bearer(hs_ring, tiers, tenant), JSON]
        )
        answers[(tenant, previous)] = (status, json.loads(out) if status != 200 else None)
    assert answers[("acme", mine)][0] == 200
    theirs, made_up = answers[("mallory", mine)], answers[("mallory", "resp_made_up")]
    assert theirs[0] == made_up[0] == 404
    assert theirs[1]["error"]["message"].replace(mine, "X") == made_up[1]["error"][
        "message"
    ].replace("resp_made_up", "X")


def test_a_response_is_named_with_the_request_id(app, hs_ring, tiers):
    """vLLM names /v1/responses engine requests from the body's request_id."""
    body = json.dumps({"model": "m", "input": "hi", "request_id": "resp_mine"}).encode()
    _, headers, _ = call(app, "/v1/responses", body=body, headers=[bearer(hs_ring, tiers), JSON])
    doc = json.loads(app.app.calls[-1][1])
    assert doc["request_id"] == f"resp_{headers[b'x-request-id'].decode()}"


@pytest.mark.parametrize(
    ("roles", "status"), [(None, 401), ((), 403), (("metrics",), 200), (("admin",), 200)]
)
def test_metrics_auth_asks_for_the_metrics_role(config, hs_ring, tiers, roles, status):
    import dataclasses

    app = TenantMiddleware(Recorder(), dataclasses.replace(config, metrics_auth=True))
    headers = [] if roles is None else [bearer(hs_ring, tiers, roles=roles)]
    for path in ("/metrics", "/metrics/"):
        assert call(app, path, method="GET", headers=headers)[0] == status


def test_metrics_stay_public_without_metrics_auth(app):
    assert call(app, "/metrics", method="GET")[0] == 200


def test_a_stored_response_answers_only_its_tenant(app, hs_ring, tiers):
    body = json.dumps({"model": "m", "input": "hi"}).encode()
    _, headers, _ = call(app, "/v1/responses", body=body, headers=[bearer(hs_ring, tiers), JSON])
    response_id = f"resp_{headers[b'x-request-id'].decode()}"
    for path in (f"/v1/responses/{response_id}", f"/v1/responses/{response_id}/cancel"):
        method = "GET" if path.endswith(response_id) else "POST"
        mine = call(app, path, method=method, headers=[bearer(hs_ring, tiers, "acme")])
        theirs = call(app, path, method=method, headers=[bearer(hs_ring, tiers, "mallory")])
        admin = call(
            app, path, method=method, headers=[bearer(hs_ring, tiers, "ops", roles=("admin",))]
        )
        assert (mine[0], theirs[0], admin[0]) == (200, 404, 200)
        assert json.loads(theirs[2])["error"]["code"] == "not_found"
    render = call(app, "/v1/responses/render", body=body, headers=[bearer(hs_ring, tiers), JSON])
    assert render[0] == 200  # a route, not a response id


def _xargs(app, hs_ring, tiers, tenant="acme", session_header=None, **claims):
    headers = [bearer(hs_ring, tiers, tenant, "premium", **claims), JSON]
    if session_header is not None:
        headers.append(("X-Session-Id", session_header))
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    status, _, out = call(app, "/v1/completions", body=body, headers=headers)
    if status != 200:
        return status, json.loads(out)
    return status, json.loads(app.app.calls[-1][1])["vllm_xargs"]


def test_a_session_header_names_the_chat_inside_the_verified_tenant(app, hs_ring, tiers):
    assert _xargs(app, hs_ring, tiers, session_header="s1")[1] == {
        "tenant_id": "acme",
        "tier": "premium",
        "session_id": "s1",
    }
    _, other = _xargs(app, hs_ring, tiers, tenant="bob", session_header="s1")
    assert (other["tenant_id"], other["session_id"]) == ("bob", "s1")  # (tenant, session)
    assert "session_id" not in _xargs(app, hs_ring, tiers)[1]


def test_the_token_session_claim_wins_over_the_header(app, hs_ring, tiers):
    _, xargs = _xargs(app, hs_ring, tiers, session_header="header", session_id="claim")
    assert xargs["session_id"] == "claim"


@pytest.mark.parametrize("value", ["", "x" * 129, "a b", "s1\u00e9", "../etc"])
def test_a_bad_session_header_is_a_400_in_openai_shape(app, hs_ring, tiers, value):
    status, doc = _xargs(app, hs_ring, tiers, session_header=value)
    assert status == 400 and doc["error"]["code"] == "invalid_session_id"
    assert "1-128 characters" in doc["error"]["message"]


def _rank_header(app):
    scope = app.app.calls[-1][0]
    return [v.decode() for k, v in scope["headers"] if k == b"x-data-parallel-rank"]


def test_each_session_is_pinned_to_one_data_parallel_rank(config, hs_ring, tiers):
    import dataclasses

    from kvlease.engine.affinity import session_rank

    app = TenantMiddleware(Recorder(), dataclasses.replace(config, data_parallel_size=2))
    seen = {}
    for _turn in range(2):
        for session in ("s1", "s2", "s3", "s4", "s5", "s6"):
            _xargs(app, hs_ring, tiers, session_header=session)
            rank = _rank_header(app)
            assert rank == [str(session_rank("acme", session, 2))]
            assert seen.setdefault(session, rank) == rank  # every turn to the same rank
    assert {r[0] for r in seen.values()} == {"0", "1"}  # both ranks get sessions


def test_sessionless_requests_and_client_rank_headers_are_left_to_vllms_balancer(
    config, hs_ring, tiers
):
    import dataclasses

    app = TenantMiddleware(Recorder(), dataclasses.replace(config, data_parallel_size=2))
    headers = [bearer(hs_ring, tiers), JSON, ("X-data-parallel-rank", "1")]
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    assert call(app, "/v1/completions", body=body, headers=headers)[0] == 200
    assert _rank_header(app) == []  # the client's choice is dropped, none is added
    _xargs(app, hs_ring, tiers, session_header="s1")  # one engine: nothing to pin
    one = TenantMiddleware(Recorder(), config)
    _xargs(one, hs_ring, tiers, session_header="s1")
    assert _rank_header(one) == []


def test_a_model_name_no_ledger_can_store_is_refused(app, hs_ring, tiers):
    body = json.dumps({"model": "m" * 300, "messages": []}).encode()
    status, _, out = call(
        app, "/v1/chat/completions", body=body, headers=[bearer(hs_ring, tiers), JSON]
    )
    assert status == 400 and "longer than 200" in json.loads(out)["error"]["message"]


def test_the_bodies_in_flight_are_bounded_and_released_when_their_requests_end(hs_ring, tiers):
    """One 15 MB body was admitted on the free tier, and eight made about 3 GB: now the
    bodies one API process holds at once are bounded, past it a 503 asks to retry."""
    import dataclasses

    config = ServerConfig(Authenticator(hs_ring, tiers), tiers, b"k" * 32)
    config = dataclasses.replace(config, max_body_bytes=1000, max_body_bytes_in_flight=2500)
    release = asyncio.Event()

    class Slow(Recorder):
        async def __call__(self, scope, receive, send):
            await release.wait()
            await super().__call__(scope, receive, send)

    app = TenantMiddleware(Slow(), config)
    body = json.dumps({"model": "m", "prompt": "x" * 900}).encode()
    headers = [(k.lower().encode(), v.encode()) for k, v in (bearer(hs_ring, tiers), JSON)]

    async def one() -> int:
        sent = []
        done = False

        async def receive():
            nonlocal done
            if done:
                await asyncio.Event().wait()  # a client that never sends more
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        await app(scope, receive, send)
        return next(m for m in sent if m["type"] == "http.response.start")["status"]

    async def main():
        tasks = [asyncio.create_task(one()) for _ in range(4)]
        await ticks_until(lambda: sum(t.done() for t in tasks) == 2, "two refused at once")
        assert app.body_bytes == 2 * len(body)  # two held, waiting in the app
        release.set()
        statuses = sorted(await asyncio.gather(*tasks))
        assert app.body_bytes == 0
        return statuses

    assert asyncio.run(main()) == [200, 200, 503, 503]


def test_requests_during_the_drain_get_503_and_public_routes_still_answer(app, hs_ring, tiers):
    from kvlease.server.middleware import DRAINING

    DRAINING.set()
    try:
        body = json.dumps({"model": "m", "prompt": "hi"}).encode()
        status, headers, out = call(
            app, "/v1/completions", body=body, headers=[bearer(hs_ring, tiers), JSON]
        )
        assert status == 503 and json.loads(out)["error"]["code"] == "shutting_down"
        assert headers[b"retry-after"] == b"5"
        assert call(app, "/health", method="GET")[0] == 200
    finally:
        DRAINING.clear()


class _Overtaken:
    """vLLM's app when the drain begins while a request is on its way in: the signal
    handler runs (DRAINING set) and the renderer refuses the request, with an exception
    (the completions route) or an error response of vLLM's own."""

    def __init__(self, raises: bool):
        self.raises = raises

    async def __call__(self, scope, receive, send):
        from kvlease.server.middleware import DRAINING

        DRAINING.set()
        if self.raises:  # quoting the request, as an exception may
            raise RuntimeError(f"cannot schedule new futures after shutdown: {PROMPT}")
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "shutdown"}'})


PROMPT = "my card number is 4111 1111 1111 1111"


@pytest.mark.parametrize("raises", [True, False], ids=["exception", "error-response"])
def test_a_request_the_drain_overtakes_inside_vllm_gets_503_not_500_and_logs_no_request_text(
    config, hs_ring, tiers, raises, caplog
):
    from kvlease.server.middleware import DRAINING

    caplog.set_level(logging.INFO, logger="kvlease")
    app = TenantMiddleware(_Overtaken(raises), config)
    body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
    try:
        status, headers, out = call(
            app, "/v1/completions", body=body, headers=[bearer(hs_ring, tiers), JSON]
        )
    finally:
        DRAINING.clear()
    assert status == 503 and json.loads(out)["error"]["code"] == "shutting_down"
    assert headers[b"retry-after"] == b"5"
    assert "4111" not in caplog.text
    assert ("overtaken by the drain (RuntimeError)" in caplog.text) is raises


def test_an_error_inside_vllm_while_not_draining_is_not_disguised(config, hs_ring, tiers):
    class Failing:
        async def __call__(self, scope, receive, send):
            raise RuntimeError("a real fault")

    app = TenantMiddleware(Failing(), config)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    with pytest.raises(RuntimeError, match="a real fault"):  # Starlette answers it with 500
        call(app, "/v1/completions", body=body, headers=[bearer(hs_ring, tiers), JSON])


def test_streamed_output_is_counted_from_events_that_carry_text():
    from kvlease.server.middleware import streamed_tokens

    chat = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
        b'data: {"id":"c","choices":[{"index":1,"delta":{"content":"lo"},"finish_reason":null}]}'
        b"\n\n"
    )
    completion = b'data: {"id":"x","choices":[{"index":0,"text":" world","logprobs":null}]}\n\n'
    usage_only = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3}}\n\ndata: [DONE]\n\n'
    responses = (
        b'event: response.created\ndata: {"type":"response.created"}\n\n'
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
    )
    assert [streamed_tokens(c) for c in (chat, completion, usage_only, responses, b"")] == [
        2,
        1,
        0,
        1,
        0,
    ]
