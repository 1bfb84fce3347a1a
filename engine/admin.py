"""Admin routes as a vLLM endpoint plugin (`vllm.endpoint_plugins`: kvlease_admin).

`kvlease serve` allow-lists it; on a plain vLLM server set
`VLLM_PLUGINS=kvlease_admin` (and `KVLEASE_CHANNEL`, see exporters/channel.py).
Routes trust only the identity TenantMiddleware verified and left in
`request.state.kvlease_tenant`; without the middleware they answer 401.
"""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.auth import AuthError, require_role
from engine.server import STATE_KEY, error_payload
from exporters.engine_view import VIEW


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_payload(status, message, code))


def _authorize(request: Request, role: str) -> JSONResponse | None:
    ctx = getattr(request.state, STATE_KEY, None)
    if ctx is None:
        return _error(401, "admin routes need kvlease's TenantMiddleware", "missing_token")
    try:
        require_role(ctx, role)
    except AuthError as err:
        return _error(err.status, err.message, err.code)
    return None


async def admin_state(request: Request) -> Any:
    """Live pool: per-tenant blocks by state, leases with time left, queue lengths."""
    if (refused := _authorize(request, "admin")) is not None:
        return refused
    state = VIEW.snapshot()
    if state is None:
        return _error(503, "no scheduler state has arrived from the engine yet", "no_engine_state")
    return state


async def ready(request: Request) -> Any:
    """200 once the engine serves (vLLM serves routes only after the engine is up)."""
    return {"status": "ready", "engine_state": VIEW.snapshot() is not None}


class KvleaseAdminPlugin:
    name = "kvlease_admin"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route("/admin/state", admin_state, methods=["GET"], tags=["kvlease"])
        app.add_api_route("/ready", ready, methods=["GET"], tags=["kvlease"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        from exporters import metrics

        VIEW.start()
        metrics.install()
