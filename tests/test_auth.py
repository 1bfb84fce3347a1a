import base64
import hashlib
import hmac
import json
import secrets
import time

import jwt
import pytest
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from jwk_keys import private_jwk, public_half

from kvlease.engine.auth import (
    MAX_TOKEN_BYTES,
    Authenticator,
    AuthError,
    AuthSettings,
    KeyConfigError,
    KeyRing,
    mint_token,
    require_role,
)
from kvlease.engine.tenancy import TenantContext


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def _claims(**overrides) -> dict:
    now = int(time.time())
    claims = {"tenant_id": "acme", "tier": "premium", "iat": now, "exp": now + 600}
    claims.update(overrides)
    return {k: v for k, v in claims.items() if v is not None}


def _sign(secret: str, claims: dict, headers: dict | None = None, alg: str = "HS256") -> str:
    return jwt.encode(claims, secret, algorithm=alg, headers=headers)


def _refused(auth: Authenticator, token: str) -> AuthError:
    with pytest.raises(AuthError) as err:
        auth.verify(token)
    return err.value


def test_a_minted_token_verifies_into_its_tenant_context(auth, hs_ring, tiers):
    token = mint_token(
        hs_ring, tiers, tenant_id="acme", tier="standard", roles=["finance"], session_id="chat-7"
    )
    ctx = auth.authenticate(f"Bearer {token}")
    assert ctx == TenantContext("acme", "standard", frozenset({"finance"}), "chat-7")


def test_unsigned_alg_none_token_is_refused(auth):
    token = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(_claims())}."
    err = _refused(auth, token)
    assert (err.status, err.code) == (401, "unsupported_algorithm")


def test_algorithm_other_than_the_keys_is_refused(auth, secret):
    err = _refused(auth, _sign(secret, _claims(), alg="HS512"))
    assert (err.status, err.code) == (401, "unsupported_algorithm")
    assert "expected HS256" in err.message


def test_hmac_token_signed_with_a_public_key_is_refused(tiers):
    """The classic RS256->HS256 confusion: a public key used as an HMAC secret."""
    jwk = private_jwk("rsa-1", "RS256")
    ring = KeyRing.from_jwks({"keys": [public_half(jwk)]})
    public_pem = jwt.PyJWK(public_half(jwk)).key.public_bytes(
        Encoding.PEM, PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = f"{_b64({'alg': 'HS256', 'kid': 'rsa-1'})}.{_b64(_claims())}"
    mac = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    forged = f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"
    err = _refused(Authenticator(ring, tiers), forged)
    assert err.code == "unsupported_algorithm"


def test_wrong_key_gives_invalid_signature(auth):
    err = _refused(auth, _sign(secrets.token_urlsafe(48), _claims()))
    assert (err.status, err.code) == (401, "invalid_signature")


def test_tampered_tier_breaks_the_signature(auth, hs_ring, tiers):
    token = mint_token(hs_ring, tiers, tenant_id="acme", tier="free")
    header, payload, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=="))
    claims["tier"] = "premium"
    err = _refused(auth, f"{header}.{_b64(claims)}.{sig}")
    assert err.code == "invalid_signature"


def test_expired_token_is_refused(auth, secret):
    past = int(time.time()) - 3600
    err = _refused(auth, _sign(secret, _claims(iat=past - 60, exp=past)))
    assert (err.status, err.code) == (401, "token_expired")


def test_token_expired_within_the_leeway_still_verifies(auth, secret):
    just = int(time.time()) - 3
    assert auth.verify(_sign(secret, _claims(iat=just - 60, exp=just))).tenant_id == "acme"


def test_not_yet_valid_token_is_refused(auth, secret):
    future = int(time.time()) + 3600
    err = _refused(auth, _sign(secret, _claims(nbf=future, exp=future + 600)))
    assert (err.status, err.code) == (401, "token_not_yet_valid")


@pytest.mark.parametrize("claim", ["tenant_id", "tier", "exp"])
def test_each_required_claim_is_required(auth, secret, claim):
    err = _refused(auth, _sign(secret, _claims(**{claim: None})))
    assert (err.status, err.code) == (401, "missing_claim")
    assert claim in err.message


def test_unknown_tier_is_forbidden(auth, secret):
    err = _refused(auth, _sign(secret, _claims(tier="platinum")))
    assert (err.status, err.code) == (403, "tier_not_allowed")


@pytest.mark.parametrize(
    "bad",
    [
        {"tenant_id": ""},
        {"tenant_id": 42},
        {"tenant_id": "a b"},
        {"tenant_id": "x" * 129},
        {"tier": ["premium"]},
        {"session_id": {"id": 1}},
        {"roles": "admin"},
        {"roles": ["root"]},
        {"roles": [1]},
    ],
)
def test_claims_of_the_wrong_shape_are_invalid(auth, secret, bad):
    err = _refused(auth, _sign(secret, _claims(**bad)))
    assert (err.status, err.code) == (401, "invalid_claim")


def test_a_weight_claim_is_checked_against_the_tier(auth, secret, hs_ring, tiers):
    assert _refused(auth, _sign(secret, _claims(weight="heavy"))).code == "invalid_claim"
    assert _refused(auth, _sign(secret, _claims(weight=0))).status == 401
    for bad in (float("nan"), float("inf"), 1e-320):  # NaN and 1e-320 froze the snapshot
        assert _refused(auth, _sign(secret, _claims(weight=bad))).code == "invalid_claim"
    with pytest.raises(KeyConfigError, match="finite number"):
        mint_token(hs_ring, tiers, tenant_id="acme", tier="premium", weight=1e-320)
    above = _refused(auth, _sign(secret, _claims(weight=tiers["premium"].max_weight + 1)))
    assert (above.status, above.code) == (403, "weight_not_allowed")
    token = mint_token(hs_ring, tiers, tenant_id="acme", tier="premium", weight=1.0)
    assert auth.authenticate(f"Bearer {token}").extra_args()["weight"] == 1.0


def test_unknown_kid_is_refused(auth, secret):
    err = _refused(auth, _sign(secret, _claims(), headers={"kid": "2019-key"}))
    assert (err.status, err.code) == (401, "unknown_kid")


@pytest.mark.parametrize(
    "token", ["", "garbage", "a.b.c", "a.b", "....", "eyJhbGciOiJIUzI1NiJ9.e30", "\x00\xff"]
)
def test_malformed_tokens_are_refused(auth, token):
    assert _refused(auth, token).code == "malformed_token"


def test_oversized_token_is_refused_before_decoding(auth, secret):
    token = _sign(secret, _claims(pad="x" * MAX_TOKEN_BYTES))
    err = _refused(auth, token)
    assert (err.status, err.code) == (401, "token_too_large")


@pytest.mark.parametrize(
    "header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer   ", "Token abc", "bearer"]
)
def test_authorization_header_must_be_bearer(auth, header):
    with pytest.raises(AuthError) as err:
        auth.authenticate(header)
    assert (err.value.status, err.value.code) == (401, "malformed_token")


def test_bearer_scheme_is_case_insensitive(auth, hs_ring, tiers):
    token = mint_token(hs_ring, tiers, tenant_id="acme", tier="free")
    assert auth.authenticate(f"bearer {token}").tier == "free"


def test_anonymous_traffic_is_rejected_by_default(auth):
    for header in (None, ""):
        with pytest.raises(AuthError) as err:
            auth.authenticate(header)
        assert (err.value.status, err.value.code) == (401, "missing_token")


def test_anonymous_traffic_can_be_mapped_to_a_named_tier(hs_ring, tiers):
    auth = Authenticator(hs_ring, tiers, AuthSettings(anonymous="free"))
    assert auth.authenticate(None) == TenantContext("anonymous", "free")


def test_anonymous_mapping_to_an_unknown_tier_is_a_config_error(hs_ring, tiers):
    with pytest.raises(KeyConfigError, match="must be 'reject' or a tier"):
        Authenticator(hs_ring, tiers, AuthSettings(anonymous="gold"))


def test_issuer_and_audience_are_checked_when_configured(hs_ring, tiers, secret):
    settings = AuthSettings(issuer="https://idp.example", audience="kvlease")
    auth = Authenticator(hs_ring, tiers, settings)
    good = mint_token(hs_ring, tiers, tenant_id="acme", tier="free", settings=settings)
    assert auth.verify(good).tenant_id == "acme"
    for bad in (
        {"iss": "https://evil.example", "aud": "kvlease"},
        {"iss": "https://idp.example", "aud": "other"},
        {"aud": "kvlease"},
    ):
        err = _refused(auth, _sign(secret, _claims(**bad)))
        assert err.code in {"invalid_claim", "missing_claim"}
        assert err.status == 401


def test_role_gate_forbids_tokens_without_the_role():
    tenant = TenantContext("acme", "premium", frozenset({"finance"}))
    require_role(tenant, "finance")
    with pytest.raises(AuthError) as err:
        require_role(tenant, "admin")
    assert (err.value.status, err.value.code) == (403, "role_not_allowed")


@pytest.mark.parametrize("alg", ["RS256", "ES256", "HS256"])
def test_jwks_ring_signs_and_verifies_each_algorithm(tiers, alg):
    ring = KeyRing.from_jwks({"keys": [private_jwk("k1", alg)]})
    token = mint_token(ring, tiers, tenant_id="acme", tier="premium")
    assert jwt.get_unverified_header(token)["kid"] == "k1"
    assert Authenticator(ring, tiers).verify(token).tier == "premium"


def test_rotation_old_and_new_kid_verify_during_overlap_and_removed_kid_fails(tiers):
    old, new = private_jwk("2026-10", "RS256"), private_jwk("2026-11", "ES256")
    signer_old = KeyRing.from_jwks({"keys": [old]})
    signer_new = KeyRing.from_jwks({"keys": [new]})
    old_token = mint_token(signer_old, tiers, tenant_id="acme", tier="free")
    new_token = mint_token(signer_new, tiers, tenant_id="acme", tier="free")

    overlap = Authenticator(
        KeyRing.from_jwks({"keys": [public_half(new), public_half(old)]}), tiers
    )
    assert overlap.verify(old_token).tenant_id == "acme"
    assert overlap.verify(new_token).tenant_id == "acme"

    after = Authenticator(KeyRing.from_jwks({"keys": [public_half(new)]}), tiers)
    assert after.verify(new_token).tenant_id == "acme"
    assert _refused(after, old_token).code == "unknown_kid"


def test_kid_less_token_is_refused_by_a_jwks_ring(tiers, secret):
    ring = KeyRing.from_jwks({"keys": [private_jwk("k1", "HS256")]})
    err = _refused(Authenticator(ring, tiers), _sign(secret, _claims()))
    assert err.code == "unknown_kid"


def test_signing_uses_the_first_private_key_unless_a_kid_is_given(tiers):
    a, b = private_jwk("a", "ES256"), private_jwk("b", "RS256")
    ring = KeyRing.from_jwks({"keys": [public_half(a) | {"kid": "a-pub"}, b, a]})
    assert ring.signing_kid == "b"
    token = mint_token(ring, tiers, tenant_id="acme", tier="free", kid="a")
    assert jwt.get_unverified_header(token)["kid"] == "a"


def test_public_only_key_cannot_sign(tiers):
    ring = KeyRing.from_jwks({"keys": [public_half(private_jwk("pub", "RS256"))]})
    with pytest.raises(KeyConfigError, match="can verify but not sign"):
        mint_token(ring, tiers, tenant_id="acme", tier="free", kid="pub")


def test_no_key_configured_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("KVLEASE_JWT_SECRET", raising=False)
    monkeypatch.delenv("KVLEASE_JWT_KEYS", raising=False)
    with pytest.raises(KeyConfigError, match="no JWT key configured"):
        KeyRing.from_config()


def test_short_secret_is_refused(monkeypatch):
    monkeypatch.setenv("KVLEASE_JWT_SECRET", "hunter2")
    monkeypatch.delenv("KVLEASE_JWT_KEYS", raising=False)
    with pytest.raises(KeyConfigError, match="at least 32 bytes"):
        KeyRing.from_config()


def test_two_key_sources_at_once_is_a_clear_error(monkeypatch, tmp_path, secret):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [private_jwk("k1", "ES256")]}))
    monkeypatch.setenv("KVLEASE_JWT_SECRET", secret)
    with pytest.raises(KeyConfigError, match="choose one key source"):
        KeyRing.from_config(keys)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, 'needs a "keys" list'),
        ({"keys": []}, 'non-empty "keys" list'),
        ({"keys": [{"kty": "oct", "k": "abc", "alg": "HS256"}]}, 'needs a "kid"'),
        ({"keys": [{"kty": "oct", "k": "abc", "kid": "a"}]}, '"alg" must be one of'),
        ({"keys": [{"kty": "oct", "k": "abc", "kid": "a", "alg": "none"}]}, '"alg" must be'),
        ({"keys": [{"kty": "oct", "k": "YWJj", "kid": "a", "alg": "HS256"}]}, "at least 32 bytes"),
        ({"keys": [{"kty": "RSA", "n": "x", "kid": "a", "alg": "RS256"}]}, "unusable key"),
    ],
)
def test_bad_key_files_fail_with_a_precise_message(doc, message):
    with pytest.raises(KeyConfigError, match=message):
        KeyRing.from_jwks(doc)


def test_duplicate_kid_in_key_file_is_refused():
    jwk = private_jwk("same", "ES256")
    with pytest.raises(KeyConfigError, match="duplicate kid"):
        KeyRing.from_jwks({"keys": [jwk, jwk]})


def test_key_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{not json")
    with pytest.raises(KeyConfigError, match=r"keys\.json: not valid JSON"):
        KeyRing.from_file(path)


def test_mint_refuses_unknown_tier_and_role(hs_ring, tiers):
    with pytest.raises(KeyConfigError, match="unknown tier"):
        mint_token(hs_ring, tiers, tenant_id="acme", tier="gold")
    with pytest.raises(KeyConfigError, match="unknown role"):
        mint_token(hs_ring, tiers, tenant_id="acme", tier="free", roles=["root"])


def test_settings_come_from_the_environment():
    settings = AuthSettings.from_env(
        {
            "KVLEASE_JWT_ISSUER": "https://idp.example",
            "KVLEASE_JWT_AUDIENCE": "kvlease",
            "KVLEASE_JWT_LEEWAY": "5",
            "KVLEASE_ANONYMOUS": "free",
        }
    )
    assert settings == AuthSettings("https://idp.example", "kvlease", 5.0, "free")
    assert AuthSettings.from_env({}) == AuthSettings()


@pytest.mark.parametrize("leeway", ["soon", "-1", "3600"])
def test_bad_leeway_is_a_clear_error(leeway):
    with pytest.raises(KeyConfigError, match="KVLEASE_JWT_LEEWAY"):
        AuthSettings.from_env({"KVLEASE_JWT_LEEWAY": leeway})


@pytest.mark.parametrize("tenant", ["acme\n", "acme\nbob", "x" * 129, ""])
def test_an_id_must_be_the_whole_claim_not_a_prefix_of_it(auth, secret, tenant):
    assert _refused(auth, _sign(secret, _claims(tenant_id=tenant))).code == "invalid_claim"


@pytest.mark.parametrize("tenant", ["__other__", "__unclassified__", "anonymous"])
def test_kvleases_own_label_values_are_refused_as_tenant_ids(auth, hs_ring, tiers, secret, tenant):
    """They would merge with the overflow labels (and the anonymous identity's cache salt)."""
    assert _refused(auth, _sign(secret, _claims(tenant_id=tenant))).code == "invalid_claim"
    with pytest.raises(KeyConfigError, match="reserved"):
        mint_token(hs_ring, tiers, tenant_id=tenant, tier="free")


def test_a_token_valid_for_longer_than_the_maximum_lifetime_is_refused(hs_ring, tiers, secret):
    auth = Authenticator(hs_ring, tiers, AuthSettings(max_token_lifetime=3600))
    now = int(time.time())
    assert auth.verify(_sign(secret, _claims(exp=now + 3600))).tenant_id == "acme"
    refused = _refused(auth, _sign(secret, _claims(exp=now + 10**12)))
    assert refused.code == "invalid_claim" and "longer" in refused.message


@pytest.mark.parametrize("ttl", [float("inf"), float("nan"), 1e300, 31 * 86400, 0])
def test_mint_refuses_a_lifetime_past_the_maximum(hs_ring, tiers, ttl):
    with pytest.raises(KeyConfigError, match="ttl"):
        mint_token(hs_ring, tiers, tenant_id="acme", tier="free", ttl_seconds=ttl)


def test_a_kid_removed_from_the_key_file_stops_verifying_without_a_restart(tiers, tmp_path):
    old, new = private_jwk("2026-10", "RS256"), private_jwk("2026-11", "ES256")
    old_token = mint_token(KeyRing.from_jwks({"keys": [old]}), tiers, tenant_id="a", tier="free")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [public_half(new), public_half(old)]}))
    clock = [0.0]
    auth = Authenticator(KeyRing.from_file(keys), tiers, key_file=keys, clock=lambda: clock[0])
    assert auth.verify(old_token).tenant_id == "a"

    keys.write_text(json.dumps({"keys": [public_half(new)]}))
    clock[0] += 2.0  # past the once-a-second check
    assert _refused(auth, old_token).code == "unknown_kid"

    keys.write_text("{not json")  # a broken edit keeps the ring that works
    clock[0] += 2.0
    assert _refused(auth, old_token).code == "unknown_kid"


def test_a_key_file_that_says_no_keys_revokes_every_key(tiers, tmp_path):
    """`{"keys": []}` is how an operator says "no keys"; a broken or deleted file is not."""
    jwk = private_jwk("2026-11", "ES256")
    token = mint_token(KeyRing.from_jwks({"keys": [jwk]}), tiers, tenant_id="a", tier="free")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [public_half(jwk)]}))
    clock = [0.0]
    auth = Authenticator(KeyRing.from_file(keys), tiers, key_file=keys, clock=lambda: clock[0])
    for broken in ("", "{not json"):
        keys.write_text(broken)
        clock[0] += 2.0
        assert auth.verify(token).tenant_id == "a"  # a half-written file keeps the ring
    keys.write_text(json.dumps({"keys": []}))
    clock[0] += 2.0
    refused = _refused(auth, token)
    assert (refused.status, refused.code) == (401, "unknown_kid")
    assert "no key is configured" in refused.message
    with pytest.raises(KeyConfigError, match="non-empty"):  # a server starts with a key
        KeyRing.from_file(keys)


@pytest.mark.parametrize("exp", ["9999999999", "soon", float("inf")])
def test_a_time_claim_that_is_not_a_number_is_a_401_without_internals(auth, secret, exp):
    refused = _refused(auth, _sign(secret, _claims(exp=exp)))
    assert refused.status == 401 and refused.code in ("invalid_claim", "malformed_token")
    assert "Error" not in refused.message and "int" not in refused.message
