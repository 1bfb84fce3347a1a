"""Plays a workload trace against a kvlease server through the stock `openai` client.

Closed loop, one stream per tenant: each tenant plays its sessions one after
another, and each turn as soon as the previous reply has arrived, with its own
token per session (tenant, tier and session are claims of the JWT, as in
production). A turn sends the conversation so far plus the new user message,
streams the reply and keeps it in the history, so the next turn shares a prefix
with this one. Replies are exactly `output_tokens` long (`ignore_eos`).

Why closed loop: the demand on the KV pool is then set in tokens (every tenant
always has one request in flight, each holding its whole conversation), not by
how fast the machine answers. A trace's think times would let a fast machine
serve every turn before the next arrives and never fill the pool.
`LoadStats` counts what the clients saw.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import openai

from kvlease.demo.workload import TIERS, Turn

VOCABULARY = (
    "cache block lease tenant prefix engine token stream reply session tier premium "
    "standard free pool evict preempt schedule batch prompt model answer question"
)
WORDS = tuple(VOCABULARY.split())

TokenFor = Callable[[Turn], str]  # a session's JWT


@dataclass
class LoadStats:
    """What the clients saw, by tier. Updated from one event loop: no lock needed."""

    started: float = field(default_factory=time.monotonic)
    requests: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)  # 429: the tier's in-flight cap
    errors: Counter[str] = field(default_factory=Counter)
    error_statuses: Counter[int] = field(default_factory=Counter)  # HTTP status, 0: no answer
    output_tokens: Counter[str] = field(default_factory=Counter)
    ttft: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TIERS})
    latency: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TIERS})
    last_errors: list[str] = field(default_factory=list)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def tokens_per_second(self) -> float:
        elapsed = max(1e-6, time.monotonic() - self.started)
        return sum(self.output_tokens.values()) / elapsed


TOKENS_PER_WORD = 2.5  # the demo model's tokenizer on WORDS; near enough for others


def prompt(turn: Turn, seed: int = 0) -> str:
    """About `input_tokens` tokens of text for a turn (words of the demo vocabulary)."""
    rng = random.Random(f"{seed}:{turn.session_id}:{turn.turn}")
    words = [rng.choice(WORDS) for _ in range(max(1, round(turn.input_tokens / TOKENS_PER_WORD)))]
    return f"{turn.tenant_id}: " + " ".join(words)


async def play(
    sessions: Iterable[list[Turn]],
    tenants: Iterable[str],
    base_url: str,
    token_for: TokenFor,
    model: str,
    stats: LoadStats,
    stop: asyncio.Event,
    max_context: int = 1400,
    max_requests: int | None = None,
    streams: dict[str, int] | None = None,
) -> None:
    """One task per tenant (`streams[tenant]` for a tenant with several concurrent chat
    streams), each playing that tenant's sessions from `sessions` in order, until the
    sessions run out, `stop` is set, or `max_requests` requests have completed. A session
    ends early once its next turn could pass `max_context` tokens (the server's context
    length, counted from the server's own token usage), as a chat app would start a new
    one."""
    source = iter(sessions)
    queued: dict[str, deque[list[Turn]]] = {t: deque() for t in tenants}

    def next_session(tenant: str) -> list[Turn] | None:
        """The tenant's next session: the shared stream is read on demand, in order."""
        while not queued[tenant]:
            session = next(source, None)
            if session is None:
                return None
            queued.setdefault(session[0].tenant_id, deque()).append(session)
        return queued[tenant].popleft()

    def done() -> bool:
        return stop.is_set() or (max_requests is not None and stats.total_requests >= max_requests)

    async def tenant_loop(tenant: str) -> None:
        while not done() and (session := next_session(tenant)) is not None:
            token = token_for(session[0])
            await _session(session, base_url, token, model, stats, done, max_context)

    streams = streams or {}
    tasks = [
        asyncio.create_task(tenant_loop(t)) for t in list(queued) for _ in range(streams.get(t, 1))
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _session(
    turns: list[Turn],
    base_url: str,
    token: str,
    model: str,
    stats: LoadStats,
    done: Callable[[], bool],
    max_context: int,
) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=300)
    history: list[dict[str, str]] = []
    context = 0  # tokens the conversation holds: the server's count after each reply
    try:
        for turn in turns:
            # The next turn's text is estimated (its words at TOKENS_PER_WORD), so it is
            # given twice its estimate, and the chat template its margin, before it is sent.
            if context + 2 * turn.input_tokens + turn.output_tokens > max_context or done():
                return
            history.append({"role": "user", "content": prompt(turn)})
            answer = await ask(client, model, history, turn, stats)
            if answer is None:
                await asyncio.sleep(1)  # a refusal (429) or an error: back off, as a user would
                return
            reply, held = answer
            context = held or context + 2 * turn.input_tokens + turn.output_tokens
            # The whole conversation goes with the next turn: its prefix is this one's.
            history.append({"role": "assistant", "content": reply})
    finally:
        await client.close()


async def ask(client, model, history, turn: Turn, stats: LoadStats) -> tuple[str, int] | None:
    """Stream one chat turn: the reply's text and the tokens the conversation now holds
    (the server's prompt plus completion count), or None after a refusal or an error."""
    sent = time.monotonic()
    first = None
    held = 0
    parts: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=turn.output_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.monotonic() - sent
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                stats.output_tokens[turn.tier] += chunk.usage.completion_tokens
                held = chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    except openai.RateLimitError:
        stats.rejected[turn.tier] += 1
        return None
    except openai.APIError as err:
        stats.errors[turn.tier] += 1
        stats.error_statuses[getattr(err, "status_code", 0) or 0] += 1
        stats.last_errors = [*stats.last_errors[-4:], f"{turn.tenant_id}: {err}"]
        return None
    stats.requests[turn.tier] += 1
    stats.latency[turn.tier].append(time.monotonic() - sent)
    if first is not None:
        stats.ttft[turn.tier].append(first)
    return "".join(parts), held
