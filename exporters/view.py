"""The API process's view of the engines: the latest snapshot of each, plus listeners.

The channel's receiver thread applies each `kvlease.engine.events.Message` from an
EngineCore (one per data-parallel rank); routes read `engines()` (each rank),
`state_json()` (the whole, every rank summed, and each rank) and `history`,
and the request join registers a listener that sees every event of the
requests this API process owns once.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvlease.engine.channel import ADDRESS_ENV, Receiver, address_for
from kvlease.engine.events import EngineState, Event, Message
from kvlease.engine.labels import TenantLabels
from kvlease.exporters.history import History
from kvlease.exporters.ranks import merge_states

Listener = Callable[[Event], None]
_API_PROCESS = re.compile(r"ApiServer_(\d+)")


def api_server_index() -> int:
    """This process's index among vLLM's API processes: vLLM names the processes it
    spawns for `--api-server-count N` `ApiServer_0` ... `ApiServer_{N-1}` (and passes
    the same index to the engines as each request's `client_index`); one API
    process is 0."""
    match = _API_PROCESS.fullmatch(multiprocessing.current_process().name)
    return int(match.group(1)) if match else 0


def _leases_now(state: EngineState, now: float) -> EngineState:
    """`state` with lease time left recounted for now (expired ones gone)."""
    leases = []
    for lease in state.leases:
        if lease.expires_at is not None:
            left = lease.expires_at - now
            if left <= 0:
                continue  # ran out since the snapshot; the engine drops it next step
            lease = msgspec.structs.replace(lease, seconds_left=left)
        leases.append(lease)
    return msgspec.structs.replace(state, leases=leases)


class EngineView:
    """Holds one snapshot per engine rank (O(ranks) memory); `state_json()` merges them
    on each call, O(ranks x tenants)."""

    def __init__(self, labels: TenantLabels | None = None, api_server: int = 0) -> None:
        self._lock = threading.Lock()
        self._states: dict[int, EngineState] = {}
        self._listeners: list[Listener] = []
        self.api_server = api_server  # events of requests owned elsewhere skip the listeners
        self.receiver: Receiver | None = None
        self.messages = 0
        self._history = History(labels) if labels is not None else None

    @property
    def history(self) -> History:
        """Made on first use, not at import: the label settings are read from the
        environment, which `kvlease serve` checks (with a one-line error) first."""
        if self._history is None:
            with self._lock:
                if self._history is None:
                    self._history = History(TenantLabels.from_env())
        return self._history

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def apply(self, message: Message) -> None:
        with self._lock:
            self.messages += 1
            listeners = list(self._listeners)
            if message.state is not None:
                self._states[message.engine] = message.state
                engines = {r: self._states[r] for r in sorted(self._states)}
        if message.state is not None:
            self.history.add_state(engines)
        for event in message.events:
            self.history.add_event(event, message.engine)
            if getattr(event, "api_server", self.api_server) != self.api_server:
                continue  # another API process's request: it joins that one's record
            for listener in listeners:
                listener(event)

    def engines(self) -> dict[int, EngineState]:
        """Each rank's latest state, lease time left recounted for now."""
        with self._lock:
            states = dict(self._states)
        now = time.monotonic()
        return {rank: _leases_now(states[rank], now) for rank in sorted(states)}

    def has_state(self) -> bool:
        """Some engine has sent its state (the engine is up)."""
        with self._lock:
            return bool(self._states)

    def state_json(self) -> dict[str, Any] | None:
        """`/admin/state`: the whole, its age and the message count, and under `engines`
        each data-parallel rank's own state (keyed by rank)."""
        engines = self.engines()
        if not engines:
            return None
        now = time.monotonic()
        whole = merge_states(list(engines.values()))
        out: dict[str, Any] = msgspec.to_builtins(whole)
        out["age_seconds"] = max(0.0, now - whole.at)
        out["channel_messages"] = self.messages
        out["engines"] = {str(rank): msgspec.to_builtins(state) for rank, state in engines.items()}
        return out

    def start(self, address: str | None = None) -> bool:
        """Bind this API process's channel address once; False when none is configured."""
        with self._lock:
            if self.receiver is not None:
                return True
            base = address or os.environ.get(ADDRESS_ENV)
            if not base:
                return False
            self.api_server = api_server_index()
            self.receiver = Receiver(address_for(base, self.api_server), self.apply)
            return True

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
