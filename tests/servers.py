"""Real servers for tests: `kvlease serve` (or plain vLLM) as a subprocess on loopback."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import procs
from waiting import until, wait

from bench.postgres import free_port
from kvlease.demo.prometheus import config_text
from kvlease.engine import processes
from kvlease.engine.auth import KeyRing, mint_token
from kvlease.engine.tenancy import TierTable


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    secret: str
    log: Path
    startup_statuses: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(
        self,
        tenant: str,
        tier: str = "free",
        roles=(),
        session: str | None = None,
        ttl: float = 3600,
    ) -> str:
        return mint_token(
            KeyRing.from_secret(self.secret),
            TierTable.load(),
            tenant_id=tenant,
            tier=tier,
            roles=roles,
            session_id=session,
            ttl_seconds=ttl,
        )

    def headers(self, tenant: str, tier: str = "free", **kw) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(tenant, tier, **kw)}"}

    def admin_state(self) -> dict:
        r = httpx.get(f"{self.url}/admin/state", headers=self.headers("ops", roles=["admin"]))
        r.raise_for_status()
        return r.json()

    def folder(self) -> Path | None:
        """The run folder of `kvlease serve` (kvlease.engine.processes); None for a server
        that keeps none (plain vLLM) or has removed it."""
        return run_folder(self.proc.pid, "serve")

    def tree(self) -> list[int]:
        """Every live process of the server: its supervisor and what that started (by the
        run folder's mark, and by its child's process group: vLLM's renamed engine
        processes may no longer show the mark)."""
        folder = self.folder()
        marked = set(processes.members(folder)) if folder else set()
        child = folder / processes.CHILD_FILE if folder else None
        if child is not None and child.exists():
            marked.update(procs.group(int(child.read_text())))
        return ([self.proc.pid] if self.proc.poll() is None else []) + sorted(marked)

    def api_pid(self) -> int:
        """The API server process: the supervised child of `kvlease serve`."""
        [child] = [p for p in self.tree() if procs.parent_of(p) == self.proc.pid]
        return child

    def crash(self) -> None:
        """Every process of the server killed at once, as a machine crash would."""
        for pid in self.tree():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        """Signal the server; SIGKILL takes every process of it at once (`crash`)."""
        if sig == signal.SIGKILL:
            self.crash()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def run_folder(owner: int, command: str) -> Path | None:
    """The run folder `owner` (a supervising kvlease command) keeps for `command`."""
    for folder in Path(tempfile.gettempdir()).glob(f"{processes.FOLDER_PREFIX}{command}-*"):
        with contextlib.suppress(OSError, ValueError):
            if int((folder / processes.OWNER_FILE).read_text()) == owner:
                return folder
    return None


def start(
    command: list[str],
    home: Path,
    log: Path,
    extra_env: dict | None = None,
    timeout: float = 300,
    port: int | None = None,
    answering: int = 200,
) -> Server:
    """Start a server (on `port`, else a free one) and wait until /health answers
    `answering` (200: up; 503: still starting its engine), recording what it said before."""
    port = port or free_port()
    secret = secrets.token_urlsafe(48)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEASE_", "VLLM_"))}
    env.update(
        KVLEASE_HOME=str(home),
        KVLEASE_JWT_SECRET=secret,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        **(extra_env or {}),
    )
    out = log.open("w")
    proc = subprocess.Popen(
        [*command, "--port", str(port)],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(proc, port, secret, log)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}; log:\n{log.read_text()[-4000:]}"
            )
        try:
            status = httpx.get(f"{server.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            status = 0
        server.startup_statuses.append(status)
        return status == answering

    if wait(healthy, timeout, interval=0.25):
        return server
    server.stop(signal.SIGKILL)
    raise TimeoutError(f"server did not become healthy; log:\n{log.read_text()[-4000:]}")


def kvlease_serve(
    home: Path, log: Path, *args: str, port: int | None = None, answering: int = 200
) -> Server:
    return start(
        [sys.executable, "-m", "kvlease", "serve", "--num-blocks", "256", *args],
        home,
        log,
        port=port,
        answering=answering,
    )


@contextlib.contextmanager
def prometheus(
    targets: list[str],
    folder: Path,
    interval: str = "1s",
    rules: Path | None = None,
    bearer: str | None = None,
):
    """A real Prometheus (Debian's) scraping `targets` (host:port), evaluating `rules`,
    sending `bearer` as its scrape token; yields its base URL once it is ready."""
    import shutil

    port = free_port()
    config = folder / "prometheus.yml"
    bearer_file = None
    if bearer is not None:
        bearer_file = folder / "scrape-token"
        bearer_file.write_text(bearer)
    config.write_text(config_text(targets, interval, rules, bearer_file))
    proc = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: answers(f"{url}/-/ready"), f"Prometheus ready at {url}", 60, 0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def wait_for_series(url: str, query: str, timeout: float = 60) -> list:
    """Poll an instant query until it returns at least one series."""

    def series() -> list:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5)
            return r.json()["data"]["result"]
        return []

    return until(series, f"Prometheus at {url} returns a series for {query}", timeout, 0.5)


def answers(url: str) -> bool:
    """`url` answers 200 (no answer yet is not an error)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False
