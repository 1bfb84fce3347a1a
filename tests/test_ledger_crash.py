"""kill -9 under load: no answered request loses its usage record, none is counted twice."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx
import pytest
from servers import start

from exporters.ledger import UsageLedger

pytestmark = pytest.mark.engine


def _serve(home, log, usage_db):
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
    return start(command, home, log)


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

    clients = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while len(answered) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(server.proc.pid, signal.SIGKILL)  # the API server, engine and workers at once
    server.proc.wait(30)
    stop.set()
    for c in clients:
        c.join(30)
    assert len(answered) >= 30

    restarted = _serve(kvlease_home, tmp_path / "second.log", usage_db)
    try:
        ledger = UsageLedger(usage_db)
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
