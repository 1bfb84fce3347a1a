"""kill -9 under load: no answered request loses its usage record, none is counted twice,
and the streams it cut are billed for what they had streamed."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx
import pytest
from servers import start
from sqlalchemy import text

from exporters.ledger import UsageLedger

pytestmark = pytest.mark.engine


def _serve(home, log, usage_db):
    # Streams are journaled every second here (5 s by default), so the test waits less.
    env = {"KVLEASE_OPEN_RECORD_SECONDS": "1"}
    command = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--num-blocks",
        "128",
        "--usage-db",
        usage_db,
    ]
    return start(command, home, log, env)


def test_kill_9_mid_load_keeps_exactly_one_record_per_answered_request(kvlease_home, tmp_path):
    usage_db = f"sqlite:///{tmp_path / 'usage.db'}"
    server = _serve(kvlease_home, tmp_path / "first.log", usage_db)
    answered: list[str] = []
    stop = threading.Event()

    def client(n: int) -> None:
        headers = server.headers(f"crash-{n}", "standard")
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                try:
                    r = http.post(
                        f"{server.url}/v1/completions",
                        headers=headers,
                        json={
                            "model": "kvlease-demo",
                            "prompt": f"client {n}",
                            "max_tokens": 40,
                            "ignore_eos": True,
                        },
                    )
                    if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40:
                        answered.append(r.headers["x-request-id"])  # a complete response
                except (httpx.HTTPError, ValueError):
                    return  # the server is gone

    streams: dict[int, dict] = {}

    def stream(n: int) -> None:
        """A long stream, which the kill may cut before its final record."""
        body = {"model": "kvlease-demo", "prompt": f"stream {n}", "max_tokens": 1800}
        state = streams[n] = {"events": 0}
        try:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                headers=server.headers(f"stream-{n}", "standard"),
                json={**body, "stream": True, "ignore_eos": True},
                timeout=60,
            ) as r:
                state["id"] = r.headers["x-request-id"]
                for line in r.iter_lines():
                    state["events"] += line.startswith('data: {"id"')
                    state["finished"] = state.get("finished") or line == "data: [DONE]"
        except httpx.HTTPError:
            return  # the server is gone

    clients = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while len(answered) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    # Then three long streams (1,800 tokens each, beside six clients), cut once one of
    # them has been journaled while still streaming.
    streamers = [threading.Thread(target=stream, args=(n,)) for n in range(3)]
    for c in streamers:
        c.start()
    clients += streamers
    ledger = UsageLedger(usage_db)

    def journaled() -> set[str]:
        with ledger.engine.connect() as conn:
            return {r[0] for r in conn.execute(text("SELECT request_id FROM usage_open"))}

    def streaming() -> set[str]:
        return {s["id"] for s in list(streams.values()) if "id" in s and not s.get("finished")}

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not streaming() & journaled():
        time.sleep(0.1)
    was_journaled = journaled()
    os.killpg(server.proc.pid, signal.SIGKILL)  # the API server, engine and workers at once
    server.proc.wait(30)
    stop.set()
    for c in clients:
        c.join(30)
    assert len(answered) >= 30

    # Streams cut after their first journal tick; one that finished has its own record.
    cut = {
        s["id"]: s["events"]
        for s in streams.values()
        if "id" in s and not s.get("finished") and s["id"] in was_journaled
    }
    assert cut and all(cut.values())

    restarted = _serve(kvlease_home, tmp_path / "second.log", usage_db)
    try:
        # The restarted server finds the open records nobody refreshes and bills them.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not set(cut) <= {
            r.request_id for r in ledger.read(0, 4e9)
        }:
            time.sleep(0.5)
        recovered = {r.request_id: r for r in ledger.read(0, 4e9) if r.request_id in cut}
        assert set(recovered) == set(cut)
        for request_id, record in recovered.items():
            assert record.partial and record.outcome == "aborted"
            assert 0 < record.output_tokens <= cut[request_id]  # journaled before the kill
        assert journaled() == set()
        records = list(ledger.read(0, 4e9))
        ids = [r.request_id for r in records]
        for request_id in answered:
            assert ids.count(request_id) == 1, request_id
        assert len(ids) == len(set(ids))
        assert ledger.write(records) == 0  # replaying every record changes nothing
        assert ledger.count() == len(records)
        r = httpx.post(
            f"{restarted.url}/v1/completions",
            headers=restarted.headers("after"),
            json={"model": "kvlease-demo", "prompt": "after", "max_tokens": 2},
        )
        assert r.status_code == 200
        assert r.headers["x-request-id"] in {x.request_id for x in ledger.read(0, 4e9)}
    finally:
        restarted.stop(signal.SIGKILL)
