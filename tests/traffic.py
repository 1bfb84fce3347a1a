"""Multi-tenant chat traffic for server tests: one streaming `openai` client per tenant."""

from __future__ import annotations

import threading
import time

import openai
from waiting import until


class Traffic:
    """One streaming chat client per tenant, in a loop, until stopped."""

    def __init__(self, server, tenants: list[tuple[str, str]], max_tokens: int = 200) -> None:
        self.server = server
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=t, daemon=True) for t in tenants]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt()

    def wait_for(self, completed: int, timeout: float = 120) -> None:
        until(lambda: self.completed >= completed, f"{completed} chats completed", timeout, 0.5)

    def halt(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(120)

    def _run(self, tenant: str, tier: str) -> None:
        client = openai.OpenAI(
            base_url=f"{self.server.url}/v1",
            api_key=self.server.token(tenant, tier, session=f"{tenant}-chat"),
            max_retries=0,
            timeout=120,
        )
        messages = [{"role": "user", "content": f"{tenant} asks about the cache. " * 6}]
        while not self.stop.is_set():
            try:
                stream = client.chat.completions.create(
                    model="kvlease-demo",
                    messages=messages,
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in stream:
                    pass
                with self._lock:
                    self.completed += 1
            except openai.APIError as err:
                with self._lock:
                    self.errors.append(f"{tenant}: {err}")
                time.sleep(0.5)  # a back-off before the next chat
