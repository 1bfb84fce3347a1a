import json

import jwt
import pytest
from jwk_keys import private_jwk

from kvlease.engine.auth import Authenticator, KeyRing
from kvlease.server.cli import main


@pytest.fixture
def env_secret(monkeypatch, secret):
    monkeypatch.setenv("KVLEASE_JWT_SECRET", secret)
    monkeypatch.delenv("KVLEASE_JWT_KEYS", raising=False)
    return secret


def test_token_prints_only_a_token_that_verifies(env_secret, tiers, capsys):
    code = main(
        [
            "token",
            "--tenant",
            "acme",
            "--tier",
            "standard",
            "--roles",
            "admin,finance",
            "--session",
            "s-1",
            "--ttl",
            "120",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("\n") == 1
    ctx = Authenticator(KeyRing.from_secret(env_secret), tiers).verify(out.strip())
    assert (ctx.tenant_id, ctx.tier, ctx.session_id) == ("acme", "standard", "s-1")
    assert ctx.roles == {"admin", "finance"}
    claims = jwt.decode(out.strip(), options={"verify_signature": False})
    assert claims["exp"] - claims["iat"] == 120


def test_token_without_a_configured_key_exits_2_with_a_message(monkeypatch, capsys):
    monkeypatch.delenv("KVLEASE_JWT_SECRET", raising=False)
    monkeypatch.delenv("KVLEASE_JWT_KEYS", raising=False)
    assert main(["token", "--tenant", "acme", "--tier", "free"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no JWT key configured" in captured.err


def test_token_for_an_unknown_tier_exits_2(env_secret, capsys):
    assert main(["token", "--tenant", "acme", "--tier", "gold"]) == 2
    assert "unknown tier 'gold'" in capsys.readouterr().err


def test_token_signs_with_the_chosen_kid_from_a_key_file(monkeypatch, tmp_path, tiers, capsys):
    monkeypatch.delenv("KVLEASE_JWT_SECRET", raising=False)
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps({"keys": [private_jwk("old", "RS256"), private_jwk("new", "ES256")]})
    )
    assert (
        main(
            ["token", "--tenant", "acme", "--tier", "free", "--jwt-keys", str(keys), "--kid", "new"]
        )
        == 0
    )
    token = capsys.readouterr().out.strip()
    assert jwt.get_unverified_header(token) == {"alg": "ES256", "kid": "new", "typ": "JWT"}
    assert Authenticator(KeyRing.from_file(keys), tiers).verify(token).tenant_id == "acme"


def test_token_uses_the_tier_file_given(env_secret, tmp_path, capsys):
    custom = tmp_path / "tiers.toml"
    custom.write_text(
        'currency = "EUR"\n[tiers.gold]\npriority = 0\nlease_seconds = 5\nleased_cache_cap = 0.1\n'
        "[tiers.gold.prices]\ninput_per_1k = 1\ncached_input_per_1k = 1\noutput_per_1k = 1\n"
        "block_hour = 1\n"
    )
    assert main(["token", "--tenant", "acme", "--tier", "gold", "--tiers", str(custom)]) == 0
    assert main(["token", "--tenant", "acme", "--tier", "gold"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ttl", "inf"], "ttl"),
        (["--ttl", "1e300"], "ttl"),
        (["--tenant", "acme\n"], "tenant id"),
        (["--tenant", "__other__"], "reserved"),
    ],
)
def test_bad_token_requests_exit_2_with_one_line(env_secret, capsys, args, message):
    argv = ["token", "--tenant", "acme", "--tier", "free", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
