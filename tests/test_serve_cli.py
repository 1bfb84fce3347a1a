"""`kvlease serve` refuses a bad configuration at once: one line, exit status 2."""

import os
import subprocess
import sys

import pytest


def _serve(*args, env_secret=True, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEASE_")}
    env.update(env_extra or {})
    if env_secret:
        env["KVLEASE_JWT_SECRET"] = "s" * 48
    return subprocess.run(
        [sys.executable, "-m", "kvlease", "serve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_serve_without_a_key_refuses_to_start():
    done = _serve("--port", "1", env_secret=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kvlease serve: error: no JWT key configured: set KVLEASE_JWT_SECRET (HS256 secret, "
        "at least 32 bytes) or pass --jwt-keys PATH (a JWKS file)"
    ]


def test_serve_refuses_a_scheduler_other_than_kvleases():
    done = _serve("--scheduler-cls", "my.Scheduler")
    assert done.returncode == 2 and "--scheduler-cls is set by kvlease serve" in done.stderr


def test_serve_refuses_a_bad_tier_file(tmp_path):
    bad = tmp_path / "tiers.toml"
    bad.write_text('currency = "USD"\n[tiers.free]\npriority = -1\n')
    done = _serve("--tiers", str(bad))
    assert done.returncode == 2 and "tiers.toml" in done.stderr


def _serve_pool(
    kvlease_home, blocks: str, max_model_len: str, *more: str
) -> subprocess.CompletedProcess:
    argv = ["serve", "--num-blocks", blocks, "--max-model-len", max_model_len, "--port", "1"]
    return subprocess.run(
        [sys.executable, "-m", "kvlease", *argv, *more],
        env={**os.environ, "KVLEASE_JWT_SECRET": "s" * 48, "KVLEASE_HOME": str(kvlease_home)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.engine  # imports vLLM's argument parser (about 10 s)
def test_serve_refuses_a_pool_smaller_than_one_request(kvlease_home):
    done = _serve_pool(kvlease_home, "8", "1024")
    assert done.returncode == 2
    assert "--num-blocks 8 of 32 tokens holds at most 224 tokens" in done.stderr


@pytest.mark.engine
def test_serve_refuses_lease_caps_that_leave_less_than_one_request(kvlease_home):
    """The shipped caps hold 4 + 2 of 23 blocks: a 736-token request needs all 23."""
    done = _serve_pool(kvlease_home, "24", "736")
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]  # above it: the demo model's build
    assert line.startswith("kvlease serve: error: --num-blocks 24, --max-model-len 736:")
    assert "reserve 6 of 23 KV blocks (standard 2, premium 4), leaving 17" in line
    assert "needs 23" in line


@pytest.mark.engine
def test_serve_refuses_a_tenant_kv_share_smaller_than_one_request(kvlease_home, tmp_path):
    from importlib import resources

    tiers = tmp_path / "tiers.toml"
    text = resources.files("kvlease.engine").joinpath("tiers.toml").read_text()
    tiers.write_text(text.replace("[tiers.free]\n", "[tiers.free]\nmax_tenant_kv_share = 0.1\n"))
    done = _serve_pool(kvlease_home, "64", "512", "--tiers", str(tiers))
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "tier 'free': max_tenant_kv_share lets one tenant hold 6 of 63 KV blocks" in line
    assert "needs 16" in line


def test_an_unreachable_ledger_is_one_line_without_its_password():
    done = _serve("--usage-db", "postgresql://kv:hunter2-secret@127.0.0.1:1/usage")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("kvlease serve: error: usage ledger") and "hunter2" not in line
    assert "***" in line


def test_serve_refuses_a_bad_budget_file(tmp_path):
    bad = tmp_path / "budgets.toml"
    bad.write_text('[tenants.acme]\nmonthly = "-5"\n')
    done = _serve("--budgets", str(bad), "--usage-db", f"sqlite:///{tmp_path / 'u.db'}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"kvlease serve: error: budgets {bad}: tenants.acme.monthly must be above 0"
    ]


def _shape(**given):
    import argparse

    from kvlease.server.serve import EXTERNAL_LB_FLAGS

    flags = {f.removeprefix("--").replace("-", "_"): None for f in EXTERNAL_LB_FLAGS}
    flags |= {"headless": False, "data_parallel_external_lb": False}
    flags |= {"data_parallel_hybrid_lb": False, "data_parallel_multi_port_external_lb": False}
    return argparse.Namespace(
        **(flags | {"data_parallel_size": 1, "api_server_count": None} | given)
    )


def test_data_parallel_defaults_to_an_api_process_per_rank_sharing_one_salt(monkeypatch):
    from kvlease.server.middleware import DATA_PARALLEL_ENV, SALT_KEY_ENV
    from kvlease.server.serve import scale_out

    monkeypatch.delenv(SALT_KEY_ENV, raising=False)
    monkeypatch.delenv(DATA_PARALLEL_ENV, raising=False)
    args = _shape(data_parallel_size=2)
    assert scale_out(args) == 2 and args.api_server_count == 2
    assert os.environ[DATA_PARALLEL_ENV] == "2" and len(os.environ[SALT_KEY_ENV]) == 64
    one = _shape(data_parallel_size=2, api_server_count=1)
    assert scale_out(one) == 1 and one.api_server_count is None  # vLLM's single-server path
    monkeypatch.setenv(SALT_KEY_ENV, "k" * 40)
    scale_out(_shape(api_server_count=3))
    assert os.environ[SALT_KEY_ENV] == "k" * 40  # an operator's key is kept


@pytest.mark.parametrize(
    "given",
    [{"headless": True}, {"data_parallel_rank": 0}, {"data_parallel_external_lb": True},
     {"data_parallel_start_rank": 2}, {"api_server_count": 0}],
)  # fmt: skip
def test_load_balancing_kvlease_cannot_keep_sessions_in_is_one_line(monkeypatch, given):
    from kvlease.server.middleware import DATA_PARALLEL_ENV, ConfigError
    from kvlease.server.serve import scale_out

    monkeypatch.delenv(DATA_PARALLEL_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        scale_out(_shape(data_parallel_size=2, **given))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVLEASE_HASH_TENANT_LABELS": "1"}, "KVLEASE_TENANT_LABEL_KEY"),
        ({"KVLEASE_MAX_TENANT_LABELS": "many"}, "must be an integer"),
    ],
)
def test_bad_label_settings_are_one_line(tmp_path, env, message):
    done = _serve("--usage-db", f"sqlite:///{tmp_path}/u.db", env_extra=env)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("kvlease serve: error:") and message in line


def test_a_ledger_url_kvlease_does_not_speak_is_one_line(tmp_path):
    done = _serve("--usage-db", "mysql://x")
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "is not a ledger URL" in line


def test_every_kvlease_serve_flag_reaches_the_environment(monkeypatch, tmp_path):
    """FLAGS is the one table: each flag that names a variable sets it (a path made
    absolute, a switch as 1, a number as given, 0 included)."""
    from kvlease.server import serve

    environ = {k: v for k, v in os.environ.items() if k not in {f.env for f in serve.FLAGS}}
    monkeypatch.setattr(os, "environ", environ)  # nothing leaks into later tests
    monkeypatch.chdir(tmp_path)
    args, rest = serve._kvlease_args(
        ["--tiers", "t.toml", "--max-tenant-labels", "0", "--otel", "--port", "9"]
    )
    serve._export(args)
    assert rest == ["--port", "9"]
    assert environ[serve.TIERS_ENV] == str(tmp_path / "t.toml")
    assert environ[serve.MAX_LABELS_ENV] == "0"
    assert environ[serve.OTEL_ENV] == "1"
    assert serve.METRICS_AUTH_ENV not in environ  # a switch left off sets nothing
