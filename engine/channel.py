"""The channel from vLLM's EngineCore process to the API server process.

kvlease's scheduler runs in the EngineCore process; `/admin/state`, metrics,
spans and the ledger live in the API process (or processes). The channel is
ZeroMQ PUSH/PULL sockets over ipc (pyzmq is already a vLLM dependency):

- Each API process binds a PULL socket at `address_for($KVLEASE_CHANNEL, i)`, i its
  index among vLLM's API processes (`--api-server-count`; 0 when there is one).
  `kvlease serve` chooses a fresh base address per run and exports it before the
  engine starts, so every EngineCore and API process inherits it.
- Each scheduler (one per data-parallel rank) connects one PUSH socket to every API
  process and sends each `kvlease.engine.events.Message` (msgspec JSON, tagged with its rank)
  to all of them: the events since the last message, at the end of each step that
  finished a request (its usage record waits for them) or took a sample, and with a
  sample (every `sample_seconds` while busy, and at idle) an `EngineState` snapshot
  with cumulative totals. So every API process holds the picture of every rank; the
  events of a request also name the API process that owns it (`api_server`), and only
  that one joins them into the request's usage record.
- Sends never block the engine loop: what a full socket refuses waits in a bounded
  per-socket backlog and goes before the next message; only that backlog can overflow
  (its events counted as dropped, visible in every snapshot).

Why not the alternatives: prometheus_client's multiprocess mode carries
numbers but not events, and vLLM's `SchedulerStats` has no field for
custom data that survives its typed msgpack decoding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import uuid
from collections import deque
from collections.abc import Callable

import zmq

from kvlease.engine.events import EVENT_CAPACITY, Message, decode, encode

ADDRESS_ENV = "KVLEASE_CHANNEL"
SEND_QUEUE = 10_000  # messages queued in ZeroMQ before sends report "full"

logger = logging.getLogger("kvlease.channel")


def new_address() -> str:
    """A fresh ipc address for one server run."""
    return f"ipc://{tempfile.gettempdir()}/kvlease-{uuid.uuid4().hex[:12]}.ipc"


def configured() -> bool:
    """Whether this process's scheduler has API processes to send to (`kvlease serve` set
    the channel's address before the engine started)."""
    return bool(os.environ.get(ADDRESS_ENV))


def address_for(base: str, api_server: int) -> str:
    """The address API process `api_server` binds, for the run's base address."""
    return base if api_server == 0 else f"{base}-{api_server}"


class Publisher:
    """The EngineCore end: one PUSH socket per API process, each message sent to all.

    Invariant: each socket's backlog holds at most `capacity` events (messages that
    socket refused, oldest first). `publish` encodes a message once and costs one
    non-blocking send per API process that keeps up; O(backlog) for one that does not.
    """

    def __init__(self, addresses: list[str], capacity: int = EVENT_CAPACITY) -> None:
        self.capacity = capacity
        self._sockets = []
        for address in addresses:
            socket = zmq.Context.instance().socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
            socket.setsockopt(zmq.LINGER, 2000)  # flush on close, bounded
            socket.connect(address)
            self._sockets.append(socket)
        self._backlogs: list[deque[tuple[bytes, int]]] = [deque() for _ in addresses]

    def publish(self, message: Message) -> int:
        """Send to every API process; returns how many of its events some API process
        will never get (its backlog was full)."""
        raw, n = encode(message), len(message.events)
        dropped = 0
        for socket, backlog in zip(self._sockets, self._backlogs, strict=True):
            backlog.append((raw, n))
            while backlog:
                try:
                    socket.send(backlog[0][0], zmq.NOBLOCK)
                except zmq.Again:
                    break
                backlog.popleft()
            lost, held = 0, sum(events for _, events in backlog)
            while held > self.capacity:  # that API process is not reading: bound the backlog
                held -= backlog[0][1]
                lost += backlog.popleft()[1]
            dropped = max(dropped, lost)
        return dropped

    def close(self) -> None:
        for socket in self._sockets:
            socket.close()

    @classmethod
    def from_env(cls, api_servers: int = 1, capacity: int = EVENT_CAPACITY) -> Publisher | None:
        if not configured():
            return None
        base = os.environ[ADDRESS_ENV]
        return cls([address_for(base, i) for i in range(api_servers)], capacity)


class Receiver:
    """The API-process end: a daemon thread hands each message to `on_message`."""

    def __init__(self, address: str, on_message: Callable[[Message], None]) -> None:
        self.address = address
        self._on_message = on_message
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, SEND_QUEUE)
        self._socket.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlease-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            while True:
                try:
                    raw = self._socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    self._on_message(decode(raw))
                except Exception:  # one bad message must not stop the channel
                    logger.exception("kvlease channel: dropping a message that failed to apply")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()
        if self.address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.address.removeprefix("ipc://"))
