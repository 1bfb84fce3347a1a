"""The API process's view of the engine: the latest scheduler snapshot, plus listeners.

The channel's receiver thread applies each `engine.events.Message` from the
EngineCore; routes read `snapshot()` / `state_json()` and `history`, and the
request join registers a listener that sees every event once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from engine.channel import ADDRESS_ENV, Receiver
from engine.events import EngineState, Event, Message
from engine.labels import TenantLabels
from exporters.history import History

Listener = Callable[[Event], None]


class EngineView:
    def __init__(self, labels: TenantLabels | None = None) -> None:
        self._lock = threading.Lock()
        self._state: EngineState | None = None
        self._listeners: list[Listener] = []
        self.receiver: Receiver | None = None
        self.messages = 0
        self.history = History(labels or TenantLabels.from_env())

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def apply(self, message: Message) -> None:
        with self._lock:
            self.messages += 1
            listeners = list(self._listeners)
            if message.state is not None:
                self._state = message.state
        if message.state is not None:
            self.history.add_state(message.state)
        for event in message.events:
            self.history.add_event(event)
            for listener in listeners:
                listener(event)

    def snapshot(self) -> EngineState | None:
        """The latest state, with lease time left recounted for now (expired ones gone)."""
        with self._lock:
            state = self._state
        if state is None:
            return None
        now = time.monotonic()
        leases = []
        for lease in state.leases:
            if lease.expires_at is not None:
                left = lease.expires_at - now
                if left <= 0:
                    continue  # ran out since the snapshot; the engine drops it next step
                lease = msgspec.structs.replace(lease, seconds_left=left)
            leases.append(lease)
        return msgspec.structs.replace(state, leases=leases)

    def state_json(self) -> dict[str, Any] | None:
        """`snapshot()` as `/admin/state` answers it: plus its age and the message count."""
        state = self.snapshot()
        if state is None:
            return None
        out = msgspec.to_builtins(state)
        out["age_seconds"] = max(0.0, time.monotonic() - state.at)
        out["channel_messages"] = self.messages
        return out

    def start(self, address: str | None = None) -> bool:
        """Bind the channel once per process; False when no address is configured."""
        with self._lock:
            if self.receiver is not None:
                return True
            address = address or os.environ.get(ADDRESS_ENV)
            if not address:
                return False
            self.receiver = Receiver(address, self.apply)
            return True

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
