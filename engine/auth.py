"""JWT -> TenantContext: the only way a request gets a tenant identity.

Every failure is an `AuthError` carrying an HTTP status, a stable code and a
reason a client can act on; nothing else escapes `Authenticator.verify`, so the
server can turn any bad token into a 401/403 in OpenAI's error shape instead of
a 500. Keys come from the environment or a key file, never from code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from kvlease.engine.labels import OTHER, UNCLASSIFIED
from kvlease.engine.tenancy import MAX_WEIGHT, MIN_WEIGHT, TenantContext, TierTable, valid_weight

HS256_KEY_ENV = "KVLEASE_JWT_SECRET"  # the variable's name; the key lives only there
KEYS_ENV = "KVLEASE_JWT_KEYS"
ISSUER_ENV = "KVLEASE_JWT_ISSUER"
AUDIENCE_ENV = "KVLEASE_JWT_AUDIENCE"
LEEWAY_ENV = "KVLEASE_JWT_LEEWAY"
ANONYMOUS_ENV = "KVLEASE_ANONYMOUS"
MAX_LIFETIME_ENV = "KVLEASE_JWT_MAX_LIFETIME"

MAX_TOKEN_BYTES = 8192
MIN_HMAC_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key is at least the hash size
ROLES = frozenset({"admin", "finance", "metrics"})  # metrics: scrape /metrics
ALGORITHMS = frozenset({"HS256", "RS256", "ES256"})
ANONYMOUS_TENANT = "anonymous"
# Label and identity values of kvlease's own: a tenant by that name would merge with them.
RESERVED_TENANTS = frozenset({OTHER, UNCLASSIFIED, ANONYMOUS_TENANT})
DEFAULT_MAX_LIFETIME = 30 * 86400.0
KEY_FILE_CHECK_SECONDS = 1.0
_ID_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")  # with fullmatch: no trailing newline slips by
ID_RULE = "1-128 characters of [A-Za-z0-9._:@-]"
logger = logging.getLogger("kvlease.auth")


def valid_id(value: object) -> bool:
    """A tenant or session id kvlease accepts (the whole string, not a prefix)."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


class AuthError(Exception):
    """A request's credentials were refused. `status` is 401 or 403."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class KeyConfigError(ValueError):
    """No usable signing/verifying key is configured; the message says how to fix it."""


def _unauthorized(code: str, message: str) -> AuthError:
    return AuthError(401, code, message)


@dataclass(frozen=True)
class Key:
    """One verification key. `sign_key` is None when only the public half is known."""

    kid: str | None
    algorithm: str
    verify_key: Any
    sign_key: Any | None


@dataclass(frozen=True)
class KeyRing:
    """Keys by `kid`. Rotation: publish the new key beside the old one, move
    signing to it, drop the old one once its tokens have expired.

    A ring built from a single HS256 secret holds one key with no kid; a JWKS
    ring requires every key to have a distinct `kid` and an explicit `alg`.
    `signing_kid` is the key `kvlease token` uses when no `--kid` is given:
    the first key in the file that has private material.
    """

    keys: Mapping[str | None, Key]
    signing_kid: str | None

    @classmethod
    def from_secret(cls, secret: str) -> KeyRing:
        if len(secret.encode()) < MIN_HMAC_SECRET_BYTES:
            raise KeyConfigError(
                f"{HS256_KEY_ENV} is too short: an HS256 secret needs at least "
                f"{MIN_HMAC_SECRET_BYTES} bytes (try: python -c 'import secrets; "
                "print(secrets.token_urlsafe(48))')"
            )
        key = Key(None, "HS256", secret, secret)
        return cls({None: key}, None)

    @classmethod
    def from_jwks(cls, doc: Any, source: str = "<jwks>", allow_empty: bool = False) -> KeyRing:
        """The ring a JWKS document holds. `allow_empty`: `{"keys": []}` is a ring that
        verifies nothing (a reloaded file saying "no keys" revokes every key); at start a
        server needs at least one key."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("keys"), list):
            raise KeyConfigError(f'{source}: a JWKS document needs a "keys" list')
        if not doc["keys"] and not allow_empty:
            raise KeyConfigError(f'{source}: a JWKS document needs a non-empty "keys" list')
        keys: dict[str | None, Key] = {}
        signing_kid = None
        for i, jwk in enumerate(doc["keys"]):
            where = f"{source}: key #{i}"
            if not isinstance(jwk, Mapping):
                raise KeyConfigError(f"{where} is not a JSON object")
            kid, alg = jwk.get("kid"), jwk.get("alg")
            if not isinstance(kid, str) or not kid:
                raise KeyConfigError(f'{where} needs a "kid" (key rotation selects keys by kid)')
            if alg not in ALGORITHMS:
                raise KeyConfigError(
                    f'{where} ({kid}): "alg" must be one of {sorted(ALGORITHMS)}, got {alg!r}'
                )
            if kid in keys:
                raise KeyConfigError(f"{where}: duplicate kid {kid!r}")
            try:
                parsed = jwt.PyJWK(dict(jwk), algorithm=alg)
            except (jwt.PyJWTError, ValueError, TypeError) as exc:
                raise KeyConfigError(f"{where} ({kid}): unusable key: {exc}") from None
            verify_key, sign_key = _split_key(parsed.key, alg, jwk)
            if alg == "HS256" and len(verify_key) < MIN_HMAC_SECRET_BYTES:
                raise KeyConfigError(
                    f"{where} ({kid}): HS256 key needs at least {MIN_HMAC_SECRET_BYTES} bytes"
                )
            keys[kid] = Key(kid, alg, verify_key, sign_key)
            if signing_kid is None and sign_key is not None:
                signing_kid = kid
        return cls(keys, signing_kid)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], allow_empty: bool = False) -> KeyRing:
        file = Path(path)
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise KeyConfigError(f"{file}: cannot read key file: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise KeyConfigError(f"{file}: not valid JSON: {exc}") from None
        return cls.from_jwks(doc, source=str(file), allow_empty=allow_empty)

    @classmethod
    def from_config(cls, keys_path: str | os.PathLike[str] | None = None) -> KeyRing:
        """The configured ring: `--jwt-keys`/`$KVLEASE_JWT_KEYS`, or `$KVLEASE_JWT_SECRET`.

        Exactly one source must be set; kvlease has no built-in key.
        """
        path = keys_path or os.environ.get(KEYS_ENV)
        secret = os.environ.get(HS256_KEY_ENV)
        if path and secret:
            raise KeyConfigError(
                f"both a key file ({path}) and {HS256_KEY_ENV} are set: choose one key source"
            )
        if path:
            return cls.from_file(path)
        if secret:
            return cls.from_secret(secret)
        raise KeyConfigError(
            f"no JWT key configured: set {HS256_KEY_ENV} (HS256 secret, at least "
            f"{MIN_HMAC_SECRET_BYTES} bytes) or pass --jwt-keys PATH (a JWKS file)"
        )


def _split_key(key: Any, alg: str, jwk: Mapping[str, Any]) -> tuple[Any, Any | None]:
    """(verify, sign) halves of a parsed JWK; asymmetric keys verify with the public half."""
    if alg == "HS256":
        return key, key
    if "d" in jwk:  # private JWK: keep it for signing, verify with its public half
        return key.public_key(), key
    return key, None


@dataclass(frozen=True)
class AuthSettings:
    """Verification options. `anonymous` is "reject" or the tier for token-less traffic."""

    issuer: str | None = None
    audience: str | None = None
    leeway_seconds: float = 10.0
    anonymous: str = "reject"
    max_token_lifetime: float = DEFAULT_MAX_LIFETIME  # refuse tokens valid for longer

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AuthSettings:
        env = os.environ if env is None else env
        leeway_raw = env.get(LEEWAY_ENV, "10")
        try:
            leeway = float(leeway_raw)
        except ValueError:
            raise KeyConfigError(
                f"{LEEWAY_ENV} must be a number of seconds, got {leeway_raw!r}"
            ) from None
        if not 0 <= leeway <= 300:
            raise KeyConfigError(f"{LEEWAY_ENV} must be between 0 and 300 seconds, got {leeway}")
        lifetime_raw = env.get(MAX_LIFETIME_ENV, str(DEFAULT_MAX_LIFETIME))
        try:
            lifetime = float(lifetime_raw)
        except ValueError:
            lifetime = -1.0
        if not (math.isfinite(lifetime) and lifetime > 0):
            raise KeyConfigError(
                f"{MAX_LIFETIME_ENV} must be a positive number of seconds, got {lifetime_raw!r}"
            )
        return cls(
            issuer=env.get(ISSUER_ENV) or None,
            audience=env.get(AUDIENCE_ENV) or None,
            leeway_seconds=leeway,
            anonymous=env.get(ANONYMOUS_ENV, "reject"),
            max_token_lifetime=lifetime,
        )


class Authenticator:
    """Verifies Bearer tokens against a key ring and a tier table.

    Safe to share between requests. With a `key_file` (a JWKS file), the ring follows
    the file: at most once a second a request checks its modification time and reloads
    it, so a removed `kid` stops verifying within a second of the file's change, with no
    restart. A file that no longer loads keeps the previous ring (and says so in the log).
    """

    def __init__(
        self,
        keyring: KeyRing,
        tiers: TierTable,
        settings: AuthSettings | None = None,
        key_file: str | os.PathLike[str] | None = None,
        clock=time.monotonic,
    ):
        self.keyring = keyring
        self.tiers = tiers
        self.settings = settings or AuthSettings()
        self._key_file = Path(key_file) if key_file else None
        self._key_stamp = self._file_stamp()
        self._clock = clock
        self._next_check = clock() + KEY_FILE_CHECK_SECONDS
        anon = self.settings.anonymous
        if anon != "reject" and anon not in tiers:
            raise KeyConfigError(
                f"{ANONYMOUS_ENV}={anon!r}: must be 'reject' or a tier ({', '.join(tiers)})"
            )

    def authenticate(self, authorization: str | None) -> TenantContext:
        """Identity for an `Authorization` header value (None when absent)."""
        if not authorization:
            if self.settings.anonymous == "reject":
                raise _unauthorized(
                    "missing_token", "an Authorization: Bearer <token> header is required"
                )
            return TenantContext(ANONYMOUS_TENANT, self.settings.anonymous)
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized(
                "malformed_token", "the Authorization header must be 'Bearer <token>'"
            )
        return self.verify(token.strip())

    def verify(self, token: str) -> TenantContext:
        if len(token.encode("utf-8", "surrogatepass")) > MAX_TOKEN_BYTES:
            raise _unauthorized("token_too_large", f"token is larger than {MAX_TOKEN_BYTES} bytes")
        key = self._key_for(token)
        claims = self._decode(token, key)
        return self._context(claims)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        if self._key_file is None:
            return None
        try:
            st = self._key_file.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _follow_key_file(self) -> None:
        now = self._clock()
        if self._key_file is None or now < self._next_check:
            return
        self._next_check = now + KEY_FILE_CHECK_SECONDS
        stamp = self._file_stamp()
        if stamp == self._key_stamp:
            return
        self._key_stamp = stamp
        try:
            self.keyring = KeyRing.from_file(self._key_file, allow_empty=True)
        except KeyConfigError as exc:
            logger.error(
                "kvlease: key file changed but does not load, keeping the old ring: %s", exc
            )
            return
        logger.info(
            "kvlease: key ring reloaded from %s: kids %s",
            self._key_file,
            sorted(str(k) for k in self.keyring.keys),
        )

    def _key_for(self, token: str) -> Key:
        self._follow_key_file()
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, ValueError, TypeError):
            raise _unauthorized("malformed_token", "token is not a well-formed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.lower() == "none":
            raise _unauthorized("unsupported_algorithm", "unsigned tokens (alg 'none') are refused")
        if not self.keyring.keys:
            raise _unauthorized("unknown_kid", "no key is configured: every token is refused")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise _unauthorized("malformed_token", "the token header's 'kid' must be a string")
        if kid is None and None not in self.keyring.keys:
            raise _unauthorized("unknown_kid", "token has no 'kid' and the key ring requires one")
        key = self.keyring.keys.get(kid)
        if key is None:
            raise _unauthorized("unknown_kid", f"no key with kid {kid!r} is configured")
        if alg != key.algorithm:
            raise _unauthorized(
                "unsupported_algorithm",
                f"algorithm {alg!r} is not allowed for this key (expected {key.algorithm})",
            )
        return key

    def _decode(self, token: str, key: Key) -> dict[str, Any]:
        s = self.settings
        try:
            return jwt.decode(
                token,
                key.verify_key,
                algorithms=[key.algorithm],
                audience=s.audience,
                issuer=s.issuer,
                leeway=s.leeway_seconds,
                options={
                    "require": ["exp", "tenant_id", "tier"],
                    "verify_aud": s.audience is not None,
                    "verify_iss": s.issuer is not None,
                },
            )
        except jwt.ExpiredSignatureError:
            raise _unauthorized("token_expired", "token has expired") from None
        except jwt.ImmatureSignatureError:
            raise _unauthorized("token_not_yet_valid", "token is not valid yet (nbf/iat)") from None
        except jwt.InvalidSignatureError:
            raise _unauthorized("invalid_signature", "token signature does not verify") from None
        except jwt.MissingRequiredClaimError as exc:
            raise _unauthorized("missing_claim", f"token lacks the '{exc.claim}' claim") from None
        except jwt.InvalidAudienceError:
            raise _unauthorized("invalid_claim", "token audience ('aud') is not accepted") from None
        except jwt.InvalidIssuerError:
            raise _unauthorized("invalid_claim", "token issuer ('iss') is not accepted") from None
        except (jwt.PyJWTError, ValueError, TypeError, OverflowError):
            # DecodeError and friends, and non-numeric exp/nbf/iat values.
            raise _unauthorized(
                "malformed_token", "token is not valid: its claims do not decode"
            ) from None

    def _context(self, claims: Mapping[str, Any]) -> TenantContext:
        tenant_id = claims["tenant_id"]
        if not valid_id(tenant_id):
            raise _unauthorized("invalid_claim", f"'tenant_id' must be {ID_RULE}")
        if tenant_id in RESERVED_TENANTS:
            raise _unauthorized("invalid_claim", f"tenant id {tenant_id!r} is reserved")
        for name in ("exp", "nbf", "iat"):
            value = claims.get(name)
            # PyJWT reads "123" as 123; kvlease's own arithmetic must never meet a string.
            if value is not None and not (
                isinstance(value, int | float) and not isinstance(value, bool)
            ):
                raise _unauthorized("invalid_claim", f"'{name}' must be a number (NumericDate)")
            if isinstance(value, float) and not math.isfinite(value):
                raise _unauthorized("invalid_claim", f"'{name}' must be a finite number")
        lifetime = self.settings.max_token_lifetime
        if claims["exp"] - time.time() > lifetime + self.settings.leeway_seconds:
            raise _unauthorized(
                "invalid_claim", f"token is valid for longer than the {lifetime:.0f} s allowed"
            )
        tier = claims["tier"]
        if not isinstance(tier, str):
            raise _unauthorized("invalid_claim", "'tier' must be a string")
        if tier not in self.tiers:
            raise AuthError(403, "tier_not_allowed", f"tier {tier[:64]!r} is not served here")
        session_id = claims.get("session_id")
        if session_id is not None and not valid_id(session_id):
            raise _unauthorized("invalid_claim", f"'session_id' must be {ID_RULE}")
        weight = claims.get("weight")
        if weight is not None:
            if not valid_weight(weight):
                raise _unauthorized(
                    "invalid_claim",
                    f"'weight' must be a finite number from {MIN_WEIGHT} to {MAX_WEIGHT}",
                )
            if weight > self.tiers[tier].max_weight:
                raise AuthError(
                    403,
                    "weight_not_allowed",
                    f"weight {weight} is above tier {tier!r}'s max_weight "
                    f"{self.tiers[tier].max_weight}",
                )
            weight = float(weight)
        roles = _roles(claims.get("roles", []))
        return TenantContext(tenant_id, tier, roles, session_id, weight)


def _roles(raw: Any) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(r, str) for r in raw):
        raise _unauthorized("invalid_claim", "'roles' must be a list of strings")
    unknown = sorted(set(raw) - ROLES)
    if unknown:
        raise _unauthorized("invalid_claim", f"unknown role {unknown[0][:32]!r}")
    return frozenset(raw)


def require_role(ctx: TenantContext, role: str) -> None:
    """Raise 403 unless the verified identity holds `role` (admin, finance)."""
    if role not in ctx.roles:
        raise AuthError(403, "role_not_allowed", f"this route needs the '{role}' role")


def mint_token(
    keyring: KeyRing,
    tiers: TierTable,
    *,
    tenant_id: str,
    tier: str,
    roles: Iterable[str] = (),
    session_id: str | None = None,
    weight: float | None = None,
    ttl_seconds: float = 3600,
    kid: str | None = None,
    settings: AuthSettings | None = None,
    now: float | None = None,
) -> str:
    """A signed token that `Authenticator.verify` accepts, for operators and tests."""
    if tier not in tiers:
        raise KeyConfigError(f"unknown tier {tier!r} (tiers: {', '.join(tiers)})")
    for value, what in ((tenant_id, "tenant"), (session_id, "session")):
        if value is not None and not valid_id(value):
            raise KeyConfigError(f"{what} id must be {ID_RULE}, got {value!r}")
    if tenant_id in RESERVED_TENANTS:
        raise KeyConfigError(f"tenant id {tenant_id!r} is reserved by kvlease")
    if weight is not None and not (valid_weight(weight) and weight <= tiers[tier].max_weight):
        raise KeyConfigError(
            f"weight must be a finite number from {MIN_WEIGHT} to tier {tier!r}'s max_weight "
            f"{tiers[tier].max_weight}, got {weight}"
        )
    role_list = sorted(set(roles))
    unknown = set(role_list) - ROLES
    if unknown:
        raise KeyConfigError(f"unknown role(s) {sorted(unknown)} (roles: {sorted(ROLES)})")
    settings = settings or AuthSettings()
    if not (math.isfinite(ttl_seconds) and 0 < ttl_seconds <= settings.max_token_lifetime):
        raise KeyConfigError(
            f"ttl must be more than 0 and at most {settings.max_token_lifetime:.0f} seconds "
            f"({MAX_LIFETIME_ENV}), got {ttl_seconds}"
        )
    chosen = kid if kid is not None else keyring.signing_kid
    key = keyring.keys.get(chosen)
    if key is None:
        raise KeyConfigError(f"no key with kid {chosen!r} in the key ring")
    if key.sign_key is None:
        raise KeyConfigError(f"key {chosen!r} has no private part: it can verify but not sign")
    issued = int(time.time() if now is None else now)
    claims: dict[str, Any] = {
        "tenant_id": tenant_id,
        "tier": tier,
        "iat": issued,
        "exp": issued + int(ttl_seconds),
        "jti": uuid.uuid4().hex,
    }
    if role_list:
        claims["roles"] = role_list
    if session_id is not None:
        claims["session_id"] = session_id
    if weight is not None:
        claims["weight"] = weight
    if settings.issuer:
        claims["iss"] = settings.issuer
    if settings.audience:
        claims["aud"] = settings.audience
    headers = {"kid": key.kid} if key.kid is not None else None
    return jwt.encode(claims, key.sign_key, algorithm=key.algorithm, headers=headers)
