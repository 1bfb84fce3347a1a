"""`kvlease demo`: one tenant, one verified token, one reply from a real vLLM engine.

The key is generated for this run and lives only in this process, so no demo
secret ever exists in the repository or on disk.
"""

from __future__ import annotations

import os
import secrets
import time

from engine.auth import Authenticator, KeyRing, mint_token
from engine.demo_model import default_model_dir, ensure_demo_model
from engine.runtime import prepare_environment, require_vllm
from engine.tenancy import TenantContext, TierTable

PROMPT = "Hello! Which tier am I on, and how long does my cache lease last?"


def run_demo(model: str | None = None, tiers_path: str | None = None) -> int:
    tiers = TierTable.load(tiers_path)
    require_vllm()
    if model is None:
        if not (default_model_dir() / ".complete").exists():
            print(f"building the demo model in {default_model_dir()} (once) ...", flush=True)
        model = str(ensure_demo_model())
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never ask the hub
    prepare_environment()

    keyring = KeyRing.from_secret(secrets.token_urlsafe(48))
    token = mint_token(
        keyring, tiers, tenant_id="acme", tier="premium", session_id="demo-1", ttl_seconds=600
    )
    ctx = Authenticator(keyring, tiers).authenticate(f"Bearer {token}")
    tier = tiers[ctx.tier]
    print(
        f"minted and verified a token for tenant {ctx.tenant_id!r}: tier {tier.name} "
        f"(priority {tier.priority}, lease {tier.lease_seconds:g} s)",
        flush=True,
    )

    print(f"starting vLLM with {model} (about 30 s on 2 CPU cores) ...", flush=True)
    started = time.monotonic()
    reply, prompt_tokens = _chat(model, ctx)
    print(f"engine answered after {time.monotonic() - started:.1f} s")
    print(f"user ({prompt_tokens} prompt tokens): {PROMPT}")
    print(f"assistant: {reply!r}")
    print("(the demo model is random-init: its words are gibberish, its KV blocks are real)")
    return 0


def _chat(model: str, ctx: TenantContext) -> tuple[str, int]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=True, block_size=32, max_model_len=1024, seed=0)
    params = SamplingParams(max_tokens=32, temperature=0.0, extra_args=ctx.extra_args())
    [out] = llm.chat([{"role": "user", "content": PROMPT}], params, use_tqdm=False)
    return out.outputs[0].text, len(out.prompt_token_ids)
