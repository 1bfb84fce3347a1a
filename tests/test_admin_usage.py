"""The usage routes of the admin plugin, in process: ledger reads off the event loop,
and a ledger that fails is an error the client can see, never an empty 200."""

from __future__ import annotations

import threading

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from records import rec

from kvlease.engine.tenancy import TenantContext
from kvlease.exporters.ledger import UsageLedger
from kvlease.server.admin import KvleaseAdminPlugin
from kvlease.server.middleware import STATE_KEY


def _client(roles=frozenset({"finance"}), raise_server_exceptions=True) -> TestClient:
    app = FastAPI()

    @app.middleware("http")
    async def verified(request, call_next):  # what TenantMiddleware leaves for the routes
        request.state.__setattr__(STATE_KEY, TenantContext("fin", "standard", roles))
        return await call_next(request)

    KvleaseAdminPlugin().attach_router(app)
    return TestClient(app, raise_server_exceptions=raise_server_exceptions)


NOV = {"from": "2026-11-01", "to": "2026-12-01"}


def test_usage_is_read_in_a_worker_thread_not_on_the_event_loop(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'usage.db'}"
    UsageLedger(url).write([rec(1), rec(2, tenant="bob")])
    monkeypatch.setenv("KVLEASE_USAGE_DB", url)
    threads: list[str] = []
    rollups = UsageLedger.rollups

    def spy(self, *args, **kw):
        threads.append(threading.current_thread().name)
        yield from rollups(self, *args, **kw)

    monkeypatch.setattr(UsageLedger, "rollups", spy)
    client = _client()
    assert len(client.get("/admin/usage", params=NOV).json()["rows"]) == 2 * 4
    csv = client.get("/admin/usage.csv", params=NOV)
    assert csv.status_code == 200 and csv.text.count("\n") == 1 + 2 * 4  # a row per charge
    assert threads and "MainThread" not in threads
    assert all(not name.startswith("asyncio") for name in threads)


@pytest.mark.parametrize("route", ["/admin/usage.csv", "/admin/usage"])
def test_a_ledger_that_cannot_be_read_is_a_503_not_an_empty_200(route, tmp_path, monkeypatch):
    junk = tmp_path / "junk.db"
    junk.write_text("not a database\n" * 100)
    monkeypatch.setenv("KVLEASE_USAGE_DB", f"sqlite:///{junk}")
    response = _client().get(route, params=NOV)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "ledger_error"


def test_a_missing_ledger_is_not_created_by_a_read(tmp_path, monkeypatch):
    missing = tmp_path / "none" / "usage.db"
    monkeypatch.setenv("KVLEASE_USAGE_DB", f"sqlite:///{missing}")
    assert _client().get("/admin/usage.csv", params=NOV).status_code == 503
    assert not missing.parent.exists()


def test_an_export_that_fails_midway_ends_with_an_error_marker(tmp_path, monkeypatch):
    from sqlalchemy.exc import OperationalError

    url = f"sqlite:///{tmp_path / 'usage.db'}"
    UsageLedger(url).write([rec(i, tenant=f"t{i:04d}") for i in range(1200)])
    monkeypatch.setenv("KVLEASE_USAGE_DB", url)
    read = UsageLedger.read

    def failing(self, *args, **kw):
        for i, record in enumerate(read(self, *args, **kw)):
            if i == 700:  # after the first chunk (500 rows) went out
                raise OperationalError("SELECT", {}, Exception("disk I/O error"))
            yield record

    monkeypatch.setattr(UsageLedger, "read", failing)
    client = _client(raise_server_exceptions=False)
    body = client.get("/admin/usage.csv", params={**NOV, "format": "raw"}).text
    assert body.count("\n") == 1 + 500 + 1  # header, the first chunk, the marker
    assert body.splitlines()[-1].startswith("# error: the export stopped early")
