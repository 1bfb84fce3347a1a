"""The channel from vLLM's EngineCore process to the API server process.

kvlease's scheduler runs in the EngineCore process; `/admin/state`, metrics,
spans and the ledger live in the API process. The channel is a ZeroMQ
PUSH/PULL pair over an ipc socket (pyzmq is already a vLLM dependency):

- The API process binds a PULL socket at `$KVLEASE_CHANNEL`; `kvlease serve`
  chooses a fresh address per run and exports it before the engine starts,
  so the EngineCore process inherits it.
- The scheduler connects a PUSH socket and sends one `engine.events.Message`
  (msgspec JSON) per engine step that has something to say: its events, and
  every `sample_seconds` an `EngineState` snapshot with cumulative totals.
  Sends never block the engine loop: when the socket's queue is full the
  message stays in the scheduler and goes with the next step, and only the
  scheduler's bounded event buffer can overflow (counted, and visible in
  every snapshot).

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
from collections.abc import Callable

import zmq

from engine.events import Message, decode, encode

ADDRESS_ENV = "KVLEASE_CHANNEL"
SEND_QUEUE = 10_000  # messages queued in ZeroMQ before sends report "full"

logger = logging.getLogger("kvlease.channel")


def new_address() -> str:
    """A fresh ipc address for one server run."""
    return f"ipc://{tempfile.gettempdir()}/kvlease-{uuid.uuid4().hex[:12]}.ipc"


class Publisher:
    """The EngineCore end. `send` returns False instead of blocking when full."""

    def __init__(self, address: str) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        self._socket.setsockopt(zmq.LINGER, 2000)  # flush on close, bounded
        self._socket.connect(address)

    def send(self, message: Message) -> bool:
        try:
            self._socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._socket.close()

    @classmethod
    def from_env(cls) -> Publisher | None:
        address = os.environ.get(ADDRESS_ENV)
        return cls(address) if address else None


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
