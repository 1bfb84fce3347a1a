"""Fresh JWKs for tests: generated per call, never stored."""

from __future__ import annotations

import secrets

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa


def private_jwk(kid: str, alg: str) -> dict:
    """A fresh private JWK (with `kid` and `alg`) for RS256, ES256 or HS256."""
    if alg == "RS256":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        jwk = jwt.algorithms.RSAAlgorithm.to_jwk(key, as_dict=True)
    elif alg == "ES256":
        key = ec.generate_private_key(ec.SECP256R1())
        jwk = jwt.algorithms.ECAlgorithm.to_jwk(key, as_dict=True)
    else:
        jwk = jwt.algorithms.HMACAlgorithm.to_jwk(secrets.token_bytes(32), as_dict=True)
    return {**jwk, "kid": kid, "alg": alg}


def public_half(jwk: dict) -> dict:
    """The JWK without its private members, as a verifier would publish it."""
    private = {"d", "p", "q", "dp", "dq", "qi", "oth"}
    return {k: v for k, v in jwk.items() if k not in private}
