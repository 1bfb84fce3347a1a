"""The Streamlit page through `streamlit.testing.v1.AppTest`: sources down, no ledger,
a real SQLite ledger. The live page against a real server is in test_dashboard_browser."""

from __future__ import annotations

import pytest
from servers import free_port
from streamlit.testing.v1 import AppTest
from waiting import until

from kvlease.dashboard import data
from kvlease.dashboard.launch import APP

ENVS = (
    data.ENGINE_ENV,
    data.PROMETHEUS_ENV,
    data.TOKEN_ENV,
    data.PASSWORD_ENV,
    data.WHATIF_DIR_ENV,
    "KVLEASE_USAGE_DB",
)


@pytest.fixture
def page(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)

    def run(page: str = "live", **env: str) -> AppTest:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # a script run may take long on a busy machine: the timeout only turns a hang into
        # a failure
        app = AppTest.from_file(str(APP), default_timeout=600)
        app.query_params["page"] = page
        return app.run()

    return run


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_live_page_says_so_when_the_engine_is_down(page):
    app = page(**{data.ENGINE_ENV: _dead_url(), data.TOKEN_ENV: "a.b.c"})
    assert not app.exception
    assert "is not reachable" in app.error[0].value


def test_a_failed_refresh_keeps_the_last_picture_marked_stale(page):
    """The pool bar once vanished on a 2-second refresh: one failed fetch blanked the page."""
    import time
    from datetime import UTC, datetime

    url = _dead_url()
    app = page(**{data.ENGINE_ENV: url, data.TOKEN_ENV: "a.b.c"})
    assert "is not reachable" in app.error[0].value  # nothing to keep yet
    state = {
        "pool_blocks": 63,
        "free_blocks": 20,
        "running": 2,
        "waiting": 1,
        "tenants": {"acme": {"running": 3, "cached_leased": 2, "cached": 1}},
        "tenant_tiers": {"acme": "premium"},
        "lease_summary": {},
    }
    live = data.live_from_engine(state, {"samples": [], "events": []}, time.time())
    app.session_state[f"last_live:engine:{url}:5"] = (
        live,
        datetime(2026, 12, 1, 9, 30, tzinfo=UTC),
    )
    app.run()
    assert not app.exception and not app.error
    assert "Showing the figures of 09:30:00 UTC" in app.warning[0].value
    assert list(app.dataframe[0].value["Tenant"]) == ["acme"]  # the tenants are still there


def test_without_a_token_the_live_page_still_says_whether_the_engine_is_there(page):
    """The banner only asked for a token while the engine was stopped."""
    app = page(**{data.ENGINE_ENV: _dead_url()})
    assert not app.exception
    message = app.error[0].value
    assert "is not reachable" in message and "needs a token with the admin role" in message


def test_live_page_says_so_when_prometheus_is_down(page):
    app = page(**{data.PROMETHEUS_ENV: _dead_url()})
    assert not app.exception
    assert app.sidebar.radio(key="source").value == "prometheus"
    assert "Prometheus at" in app.error[0].value


def test_usage_page_without_a_ledger_says_how_to_configure_one(page):
    app = page("usage")
    assert not app.exception
    assert "--usage-db" in app.info[0].value


def test_usage_page_says_so_when_the_ledger_is_unreachable(page):
    app = page("usage", KVLEASE_USAGE_DB=f"postgresql://nobody@127.0.0.1:{free_port()}/none")
    assert not app.exception
    assert "ledger is not readable" in app.error[0].value


def test_usage_page_shows_tenants_costs_and_the_downloads(page, november_ledger, tmp_path):
    budgets = tmp_path / "budgets.toml"
    budgets.write_text('[tenants.acme]\nmonthly = "0.01"\n[tenants.cy]\nmonthly = "100"\n')
    app = page("usage", KVLEASE_USAGE_DB=november_ledger.url, KVLEASE_BUDGETS=str(budgets))
    app.radio(key="preset").set_value("Custom").run()
    app.date_input(key="from").set_value("2026-11-01")
    app.date_input(key="to").set_value("2026-12-01")
    app.run()
    assert not app.exception and not app.error
    tenants, lines, requests = app.dataframe
    table = tenants.value
    assert list(table.columns[:4]) == ["Tenant", "Cost", "Change", "Change %"]
    assert list(table["Tenant"]) == ["acme", "cy", "bob"]  # largest cost first
    assert list(table["Change %"]) == ["-", "-", "-"]  # no October: no percentage, no None
    budget = dict(zip(table["Tenant"], table["Budget this month"], strict=True))
    assert budget["acme"].endswith("exceeded") and budget["cy"].startswith("0% of 100.00")
    assert budget["bob"] == "-"
    assert [m.value for m in app.metric[1:4]] == ["4", "3", "1"]  # requests, tenants, budgets
    labels = [b.proto.label for b in app.get("download_button")]
    assert labels == [
        "Download FOCUS CSV",
        "Tenant summary CSV",
        "Statement CSV",
        "Printable statement (HTML)",
    ]
    # A click only downloads: its rerun could drop the deferred CSV before it is fetched.
    assert all(b.proto.ignore_rerun for b in app.get("download_button"))
    assert [t.label for t in app.tabs] == [
        "Tenants",
        "Over time",
        "Statement",
        "Requests",
        "Reconciliation",
    ]
    owing = app.selectbox(key="statement_tenant")
    assert owing.value == "acme" and owing.options == ["acme", "cy", "bob"]  # largest cost first
    assert set(lines.value["tier"]) == {"premium"}
    assert lines.value["quantity"][0] == "1,201 tokens"
    assert len(requests.value) == 2 and requests.value["Request"][0] == f"kvl-{1:032x}"
    assert "--prometheus" in app.info[0].value  # reconciliation needs a Prometheus

    app.selectbox(key="statement_tenant").set_value("cy").run()
    assert set(app.dataframe[1].value["tier"]) == {"standard"}
    app.selectbox(key="requests_tenant").set_value("bob").run()
    assert list(app.dataframe[2].value["Tier"]) == ["free"]
    app.radio(key="stack").set_value("tenant").run()
    app.radio(key="measure").set_value("tokens").run()
    assert not app.exception
    app.text_input(key="usage_search").input("ac").run()
    assert list(app.dataframe[0].value["Tenant"]) == ["acme"]


def test_usage_page_presets_name_their_window(page, november_ledger):
    app = page("usage", KVLEASE_USAGE_DB=november_ledger.url)
    assert app.radio(key="preset").value == "This month" and not app.exception
    app.radio(key="preset").set_value("Last month").run()
    assert not app.exception and app.caption[0].value.startswith("From ")


def test_switching_pages_keeps_the_page_whole(page, november_ledger):
    app = page("live", **{data.ENGINE_ENV: _dead_url(), data.TOKEN_ENV: "a.b.c"})
    app.sidebar.radio(key="page").set_value("usage").run()
    assert not app.exception
    assert app.header[0].value == "Usage & billing"


def test_dashboard_refuses_a_refresh_faster_than_two_seconds(capsys):
    from kvlease.server.cli import main

    assert main(["dashboard", "--refresh", "1"]) == 2
    assert "at least 2 seconds" in capsys.readouterr().err


def test_the_servers_token_never_reaches_the_browser(page):
    """The field starts empty (masking is display only: a default value is sent), and the
    server's token is still used: the engine is called, and found down."""
    app = page(**{data.ENGINE_ENV: _dead_url(), data.TOKEN_ENV: "secret.admin.jwt"})
    field = app.text_input(key="token")
    assert field.value == "" and "secret" not in str(field.proto)
    assert "is not reachable" in app.error[0].value


def test_a_password_keeps_every_page_behind_a_login(page):
    app = page(**{data.PROMETHEUS_ENV: _dead_url(), data.PASSWORD_ENV: "open-sesame-42"})
    assert not app.exception and not app.sidebar.radio  # nothing but the login
    app.text_input(key="password").input("wrong")
    app.button[0].click().run()
    assert app.error[0].value == "Wrong password." and not app.sidebar.radio
    app.text_input(key="password").input("open-sesame-42")
    app.button[0].click().run()
    assert app.sidebar.radio(key="source").value == "prometheus"


def test_serving_beyond_localhost_needs_a_password(monkeypatch, capsys):
    from kvlease.server.cli import main

    monkeypatch.delenv(data.PASSWORD_ENV, raising=False)
    assert main(["dashboard", "--address", "0.0.0.0"]) == 2
    assert data.PASSWORD_ENV in capsys.readouterr().err


def test_what_if_page_replays_a_trace_in_the_background_and_shows_both_sides(page, tmp_path):
    from kvlease.demo.workload import WorkloadSpec, generate, save_trace

    trace = tmp_path / "trace.csv"
    spec = WorkloadSpec(tenants=(1, 1, 3), duration=8.0, sessions_per_second=1.0, seed=2)
    turns = generate(spec)
    save_trace(turns, trace)
    moved = next(t.tenant_id for t in turns if t.tier == "free")
    app = page("whatif", **{data.WHATIF_DIR_ENV: str(tmp_path)})
    assert not app.exception
    assert app.radio(key="whatif_source").value == "trace"  # no ledger configured
    assert app.radio(key="whatif_preset").value == "Last 7 days with records"
    app.text_input(key="whatif_trace").set_value("trace.csv")
    app.text_area(key="whatif_assign").set_value(f'[tenants]\n"{moved}" = "premium"\n')
    app.number_input(key="whatif_pool").set_value(32)
    next(b for b in app.button if b.label == "Run replay").click()
    app.run()
    job = app.session_state["whatif_job"]
    # Poll as the open page does (every 2 s): a job nobody polls for 30 s is reaped as
    # orphaned, so a bare wait failed whenever the replay took that long (a busy machine).
    state, detail = until(lambda: (s := job.poll())[0] != "running" and s, "the replay", 600, 2.0)
    assert state == "done", detail
    app.run()
    assert not app.exception
    headline = f"Proposed: 1 tenant moved ({moved} to premium); a pool of 32 blocks instead of 64."
    assert app.subheader[0].value == headline  # the change, named first
    tiers = app.dataframe[0].value
    assert set(tiers["tier"]) <= {"premium", "standard", "free"} and len(tiers) >= 2
    premium = tiers.set_index("tier").loc["premium", "requests"]
    assert "->" in premium  # the moved tenant's requests joined premium in the proposed table
    assert len(app.get("plotly_chart")) == 6
    labels = [b.proto.label for b in app.get("download_button")]
    assert labels == ["Report (HTML)", "Report (JSON)"]
    assert all(b.proto.ignore_rerun for b in app.get("download_button"))
    assert headline in job.html_path.read_text()
    folder = job.folder
    job.stop()
    assert not folder.exists()


@pytest.mark.parametrize("name", ["/dev/zero", "../outside.csv", "missing.csv", "/etc/passwd"])
def test_what_if_reads_only_regular_files_under_its_folder(page, tmp_path, name):
    """/dev/zero once took the replay child to 2.7 GB in 5 s; errors told which files
    existed. Every refusal reads the same, and no replay starts."""
    (tmp_path / "outside.csv").write_text("tenant_id\nsecret-cell\n")
    inside = tmp_path / "inside"
    inside.mkdir()
    app = page("whatif", **{data.WHATIF_DIR_ENV: str(inside)})
    app.text_input(key="whatif_trace").set_value(name)
    next(b for b in app.button if b.label == "Run replay").click()
    app.run()
    assert "whatif_job" not in app.session_state
    [error] = app.error
    assert error.value == f"{name!r} is not a readable file under {inside.resolve()}"
    assert "secret-cell" not in error.value


def test_what_if_reads_no_file_without_its_folder(page):
    app = page("whatif")
    app.text_input(key="whatif_trace").set_value("/etc/hosts")
    next(b for b in app.button if b.label == "Run replay").click()
    app.run()
    assert "whatif_job" not in app.session_state
    assert data.WHATIF_DIR_ENV in app.error[0].value


def test_a_replay_child_past_its_memory_bound_is_ended(monkeypatch):
    import subprocess
    import sys

    from kvlease.dashboard import whatif

    monkeypatch.setattr(whatif, "CHILD_MAX_RSS_BYTES", 1)  # any real process is past it
    job = whatif.ReplayJob()
    job.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    state, message = job.poll()
    assert state == "failed" and "more than" in message
    assert job.process.returncode is not None  # killed and reaped
    job.stop()
    assert not job.folder.exists()
