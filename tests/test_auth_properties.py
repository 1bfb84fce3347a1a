"""Whatever arrives in an Authorization header, the verifier either returns a
TenantContext or raises AuthError: never any other exception (a 500)."""

import base64
import hashlib
import hmac
import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlease.engine.auth import Authenticator, AuthError
from kvlease.engine.tenancy import TenantContext

# Fixtures are stateless here; the first draw of st.text builds Hypothesis's
# unicode tables, which its too-slow check would take for a slow strategy.
SUPPRESSED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
claim_names = st.sampled_from(
    ["tenant_id", "tier", "exp", "nbf", "iat", "iss", "aud", "roles", "session_id", "sub"]
)
ident = st.from_regex(r"[A-Za-z0-9._:@-]{1,20}", fullmatch=True)
now = int(time.time())
valid_claims = st.fixed_dictionaries(
    {
        "tenant_id": ident,
        "tier": st.sampled_from(["premium", "standard", "free"]),
        "exp": st.integers(now + 60, now + 10**6),
    },
    optional={
        "roles": st.lists(st.sampled_from(["admin", "finance"]), max_size=2),
        "session_id": ident,
        "iat": st.integers(now - 1000, now),
        "nbf": st.integers(now - 1000, now),
    },
)
# Valid claims with some replaced by arbitrary JSON and some removed.
mutated_claims = st.tuples(
    valid_claims, st.dictionaries(claim_names, json_values, max_size=3), st.sets(claim_names)
).map(lambda t: {k: v for k, v in (t[0] | t[1]).items() if k not in t[2]})
claim_sets = valid_claims | mutated_claims | st.dictionaries(st.text(max_size=8), json_values)
headers = st.just({}) | st.fixed_dictionaries(
    {}, optional={"kid": json_values, "typ": json_values, "crit": json_values, "x5u": json_values}
)


def _part(value) -> str:
    """base64url(JSON) as a JWT segment; json.dumps writes NaN/Infinity, as an attacker may."""
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def _check(auth: Authenticator, header_value) -> None:
    try:
        result = auth.authenticate(header_value)
    except AuthError as err:
        assert err.status in (401, 403)
        assert err.code and err.message
    else:
        assert isinstance(result, TenantContext)


@settings(max_examples=400, suppress_health_check=SUPPRESSED)
@given(raw=st.binary(max_size=600))
def test_random_bytes_only_ever_verify_or_raise_auth_error(auth, raw):
    _check(auth, "Bearer " + raw.decode("latin-1"))
    _check(auth, raw.decode("utf-8", "replace"))


@settings(max_examples=400, suppress_health_check=SUPPRESSED)
@given(claims=claim_sets, header=headers)
def test_random_claims_signed_with_the_real_key_only_verify_or_raise(auth, secret, claims, header):
    signing_input = f"{_part({**header, 'alg': 'HS256'})}.{_part(claims)}"
    mac = hmac.new(secret.encode(), signing_input.encode(), hashlib.sha256).digest()
    _check(auth, f"Bearer {signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}")


@settings(max_examples=300, suppress_health_check=SUPPRESSED)
@given(header=st.dictionaries(st.text(max_size=6), json_values, max_size=4), payload=json_values)
def test_random_unsigned_structures_only_verify_or_raise(auth, header, payload):
    _check(auth, f"Bearer {_part(header)}.{_part(payload)}.c2ln")
