"""Admin routes as a vLLM endpoint plugin (`vllm.endpoint_plugins`: kvlease_admin).

`kvlease serve` allow-lists it; on a plain vLLM server set
`VLLM_PLUGINS=kvlease_admin` (and `KVLEASE_CHANNEL`, see engine/channel.py).
Routes trust only the identity TenantMiddleware verified and left in
`request.state.kvlease_tenant`; without the middleware they answer 401.
"""

from __future__ import annotations

import json
import logging
from argparse import Namespace
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from kvlease.engine.auth import AuthError, require_role
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.billing import focus_rows, usage
from kvlease.exporters.exports import export_chunks
from kvlease.exporters.ledger import LedgerError, one_line
from kvlease.exporters.periods import parse_window
from kvlease.exporters.pricing import UnpricedRecord
from kvlease.exporters.telemetry import TELEMETRY
from kvlease.server.middleware import STATE_KEY, error_payload

logger = logging.getLogger("kvlease.admin")


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
    state = TELEMETRY.view.state_json()
    if state is None:
        return _error(503, "no scheduler state has arrived from the engine yet", "no_engine_state")
    return state


async def admin_history(request: Request) -> Any:
    """The last `seconds` (default 300, at most 600) of occupancy samples and events."""
    if (refused := _authorize(request, "admin")) is not None:
        return refused
    try:
        seconds = float(request.query_params.get("seconds", "300"))
    except ValueError:
        return _error(400, "seconds must be a number", "invalid_window")
    return TELEMETRY.view.history.since(seconds)


def _window(request: Request) -> tuple[float, float, str]:
    q = request.query_params
    granularity = q.get("granularity", "month")
    if granularity not in ("hour", "day", "month"):
        raise ValueError("granularity must be hour, day or month")
    start, end = parse_window(q.get("from"), q.get("to"))
    return start, end, granularity


async def usage_csv(request: Request) -> Any:
    """The FOCUS CSV of `kvlease usage export` for a window, streamed (role: finance).

    The ledger is read in a worker thread, never on the event loop. The first chunk
    (the header and the first group, after the query has run) is read before the status
    line, so a ledger that fails up front gets a 503 in OpenAI's shape; one that fails
    mid-stream ends the body with an `# error:` line and a broken chunked transfer, so no
    client mistakes a truncated file for a whole one."""
    if (refused := _authorize(request, "finance")) is not None:
        return refused
    try:
        start, end, granularity = _window(request)
    except ValueError as exc:
        return _error(400, str(exc), "invalid_window")
    tenants = request.query_params.getlist("tenant")
    fmt = request.query_params.get("format", "focus")

    def open_export() -> tuple[Iterator[str], str | None]:
        ledger, tiers = TELEMETRY.ledger(), TierTable.load()
        chunks = export_chunks(ledger, (start, end), fmt, granularity, tiers, tenants)
        return chunks, next(chunks, None)

    try:
        chunks, first = await run_in_threadpool(open_export)
    except (LedgerError, SQLAlchemyError) as exc:
        logger.error("kvlease: /admin/usage.csv: the ledger failed: %s", one_line(exc))
        return _error(503, f"the usage ledger is not readable: {one_line(exc)}", "ledger_error")
    except UnpricedRecord as exc:
        return _error(503, str(exc), "unpriced_record")
    except ValueError as exc:  # an unknown format
        return _error(400, str(exc), "invalid_format")

    def body() -> Iterator[str]:
        if first is not None:
            yield first
        try:
            yield from chunks
        except (LedgerError, SQLAlchemyError, UnpricedRecord) as exc:
            logger.error("kvlease: /admin/usage.csv stopped: %s", one_line(exc))
            yield f"# error: the export stopped early: {one_line(exc)}\n"
            raise

    name = f"kvlease-usage-{granularity}.csv"
    return StreamingResponse(  # a sync iterator: Starlette runs it in its thread pool
        body(),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


async def usage_json(request: Request) -> Any:
    """FOCUS rows as JSON, `{"tenant_filter": [...], "rows": [...]}`: finance and admin see
    every tenant, a tenant only itself. Streamed as it is read, in a worker thread, 500
    rows a chunk: a month of 240,000 rows never sits whole in memory nor stalls the event
    loop (it once built 383 MB and held /health 3.9 s). A ledger that fails before the
    first row is a 503; one that fails later breaks the chunked body, never a short
    document that parses."""
    ctx = getattr(request.state, STATE_KEY, None)
    if ctx is None:
        return _error(401, "usage routes need kvlease's TenantMiddleware", "missing_token")
    try:
        start, end, granularity = _window(request)
    except ValueError as exc:
        return _error(400, str(exc), "invalid_window")
    tenants = request.query_params.getlist("tenant")
    if not ({"finance", "admin"} & ctx.roles):
        tenants = [ctx.tenant_id]  # a tenant sees its own usage only

    def open_rows() -> tuple[Iterator[str], str]:
        found = usage(TELEMETRY.ledger(), (start, end), granularity, tenants)
        rows = focus_rows(found, granularity, TierTable.load(), (start, end))
        chunks = _json_chunks(rows)
        head = json.dumps({"tenant_filter": tenants})[:-1] + ', "rows": ['
        return chunks, head + next(chunks)

    try:
        chunks, first = await run_in_threadpool(open_rows)
    except (LedgerError, SQLAlchemyError) as exc:
        return _error(503, f"the usage ledger is not readable: {one_line(exc)}", "ledger_error")
    except UnpricedRecord as exc:
        return _error(503, str(exc), "unpriced_record")

    def body() -> Iterator[str]:
        yield first
        yield from chunks
        yield "]}"

    return StreamingResponse(body(), media_type="application/json")


def _json_chunks(rows: Iterator[dict[str, str]], size: int = 500) -> Iterator[str]:
    """The rows as the inside of a JSON array, `size` a chunk; at least one chunk."""
    buffer: list[str] = []
    separator = ""
    for row in rows:
        buffer.append(separator + json.dumps(row))
        separator = ","
        if len(buffer) == size:
            yield "".join(buffer)
            buffer = []
    yield "".join(buffer)


async def ready(request: Request) -> Any:
    """200 once the engine serves (vLLM serves routes only after the engine is up)."""
    return {"status": "ready", "engine_state": TELEMETRY.view.has_state()}


class KvleaseAdminPlugin:
    name = "kvlease_admin"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route("/admin/state", admin_state, methods=["GET"], tags=["kvlease"])
        app.add_api_route("/admin/history", admin_history, methods=["GET"], tags=["kvlease"])
        app.add_api_route("/ready", ready, methods=["GET"], tags=["kvlease"])
        app.add_api_route("/admin/usage.csv", usage_csv, methods=["GET"], tags=["kvlease"])
        app.add_api_route("/admin/usage", usage_json, methods=["GET"], tags=["kvlease"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        TELEMETRY.start()
