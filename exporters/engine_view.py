"""The API process's view of the engine: the latest scheduler snapshot, plus listeners.

One per API process (`VIEW`). The channel's receiver thread applies each
message from the EngineCore; routes read `snapshot()` and `history`, and
exporters (metrics, ledger) register listeners that see every event once.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.labels import TenantLabels
from exporters.channel import ADDRESS_ENV, Receiver
from exporters.history import History

Listener = Callable[[dict[str, Any]], None]


class EngineView:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, Any] | None = None
        self._listeners: list[Listener] = []
        self.receiver: Receiver | None = None
        self.messages = 0
        self.history = History(TenantLabels.from_env())

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def apply(self, message: dict[str, Any]) -> None:
        with self._lock:
            self.messages += 1
            listeners = list(self._listeners)
            if "state" in message:
                self._state = message["state"]
        if "state" in message:
            self.history.add_state(message["state"])
        for event in message.get("events", ()):
            self.history.add_event(event)
            for listener in listeners:
                listener(event)

    def snapshot(self) -> dict[str, Any] | None:
        """The latest state, with lease time left recounted for now."""
        with self._lock:
            state = copy.deepcopy(self._state)
        if state is None:
            return None
        now = time.monotonic()
        state["age_seconds"] = max(0.0, now - state["at"])
        state["channel_messages"] = self.messages
        leases = []
        for lease in state["leases"]:
            if lease["expires_at"] is not None:
                lease["seconds_left"] = lease["expires_at"] - now
                if lease["seconds_left"] <= 0:
                    continue  # ran out since the snapshot; the engine drops it next step
            leases.append(lease)
        state["leases"] = leases
        return state

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


VIEW = EngineView()
