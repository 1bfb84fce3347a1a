"""Shared fixtures: the shipped tier table and an HS256 key ring.

Keys are generated per test session; no key material is stored in the repo.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from records import NOV, rec

from kvlease.engine.auth import Authenticator, KeyRing
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.ledger import UsageLedger

# `make test-vllm-next` runs the scheduler's own tests against vLLM 0.33.0's code (the GPU
# release), installed beside the CPU torch: vLLM must then be told it runs on the CPU
# before a scheduler is built.
if os.environ.get("KVLEASE_VLLM_NEXT"):
    import vllm
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    if vllm.__version__ != os.environ["KVLEASE_VLLM_NEXT"]:
        raise RuntimeError(f"expected vLLM {os.environ['KVLEASE_VLLM_NEXT']} on PYTHONPATH")
    vllm.platforms._current_platform = CpuPlatform()

# vLLM's in-process engines put their ZMQ sockets here, not loose in /tmp (a killed
# engine leaves its sockets); removed when the session ends.
_VLLM_SOCKETS = tempfile.mkdtemp(prefix="kvlease-tests-vllm-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_SOCKETS)
atexit.register(shutil.rmtree, _VLLM_SOCKETS, True)

# Property tests check behaviour, never speed: no per-example deadline and no
# "input generation is slow" failure when the machine is busy (as CI's two cores are).
settings.register_profile("kvlease", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvlease")


@pytest.fixture(scope="session")
def tiers() -> TierTable:
    return TierTable.load()


@pytest.fixture(scope="session")
def secret() -> str:
    return secrets.token_urlsafe(48)


@pytest.fixture(scope="session")
def hs_ring(secret: str) -> KeyRing:
    return KeyRing.from_secret(secret)


@pytest.fixture
def auth(hs_ring: KeyRing, tiers: TierTable) -> Authenticator:
    return Authenticator(hs_ring, tiers)


@pytest.fixture(scope="session")
def kvlease_home(tmp_path_factory):
    """A KVLEASE_HOME for the test session, with the demo model built where kvlease looks."""
    from kvlease.demo.model import BUILD_ID, ensure_demo_model

    home = tmp_path_factory.mktemp("kvlease-home")
    ensure_demo_model(home / "models" / BUILD_ID)
    return home


@pytest.fixture(scope="session")
def demo_model(kvlease_home) -> str:
    from kvlease.demo.model import BUILD_ID

    return str(kvlease_home / "models" / BUILD_ID)


@pytest.fixture(scope="session")
def stock_engine(demo_model):
    from engines import RecordingScheduler, start_engine

    return start_engine(demo_model, RecordingScheduler)


@pytest.fixture(scope="session")
def kvlease_engine(demo_model):
    from engines import recording, start_engine

    from kvlease.engine.events import EVENT_CAPACITY
    from kvlease.engine.vllm_scheduler import TenantAwareScheduler

    return start_engine(
        demo_model,
        recording(TenantAwareScheduler),
        # its events are read here (no channel: none are kept unless asked)
        additional_config={"kvlease": {"debug_accounting": True, "event_capacity": EVENT_CAPACITY}},
    )


@pytest.fixture(scope="session")
def postgres_url():
    from bench.postgres import postgres_cluster

    with postgres_cluster() as url:
        yield url


@pytest.fixture
def november_ledger(tmp_path) -> UsageLedger:
    """Four records in November 2026: acme (premium) x2, the second a leased next turn
    (its lease kept 320 prefix tokens), bob (free), cy (standard)."""
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    ledger.write(
        [
            rec(
                i,
                tenant,
                tier,
                "kvlease-demo",
                NOV + 3600 * i,
                input_tokens=1000 + i,
                lease_covered_tokens=320 if i == 1 else 0,
            )
            for i, (tenant, tier) in enumerate(
                [("acme", "premium"), ("acme", "premium"), ("bob", "free"), ("cy", "standard")]
            )
        ]
    )
    return ledger


@pytest.fixture(scope="module")
def usage_db(tmp_path_factory) -> str:
    """A SQLite ledger URL for one test module's server."""
    return f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'usage.db'}"


@pytest.fixture(scope="session")
def pressured_ledger(tmp_path_factory) -> str:
    """The ledger URL of `pressured_server`."""
    return f"sqlite:///{tmp_path_factory.mktemp('pressured-ledger') / 'usage.db'}"


@pytest.fixture(scope="session")
def pressured_server(kvlease_home, tmp_path_factory, pressured_ledger):
    """`kvlease serve` on 48 blocks of 32 tokens, with its own ledger: six tenants
    streaming 200-token replies run it short. One per test session, shared by the
    dashboard's browser module and the Grafana module (an engine start saved): the
    browser module runs first (file order) and opens with the idle-engine page."""
    from servers import kvlease_serve

    folder = tmp_path_factory.mktemp("serve")
    budgets = folder / "budgets.toml"  # budgets far above any spend: the Grafana panel's data
    budgets.write_text(
        "".join(f'[tenants.{t}]\nmonthly = "1000000"\n' for t in ("premium-a", "premium-g"))
    )
    args = ["--usage-db", pressured_ledger, "--num-blocks", "48", "--budgets", str(budgets)]
    srv = kvlease_serve(kvlease_home, folder / "server.log", *args)
    yield srv
    srv.stop(signal.SIGKILL)
