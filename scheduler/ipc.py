"""The scheduler's socket: a zmq ROUTER that many clients (DEALER sockets) talk to at once."""

from __future__ import annotations

import zmq

from scheduler.io_struct import ServerMessage, encode


class SchedulerIPC:
    """Receives raw client messages and answers each client on its own identity.

    ``poll`` also watches extra file descriptors (the grammar manager's wake-up pipe), so the idle loop
    sleeps in one place and wakes for whichever comes first.
    """

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.bind(endpoint)
        self.endpoint = endpoint
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)

    def watch(self, fd: int) -> None:
        self.poller.register(fd, zmq.POLLIN)

    def receive(self, timeout_s: float | None) -> list[tuple[bytes, bytes]]:
        """Every pending ``(client_id, payload)``, waiting up to ``timeout_s`` (None: forever) for the first."""
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        if not dict(self.poller.poll(timeout_ms)).get(self.socket):
            return []
        messages: list[tuple[bytes, bytes]] = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            if len(frames) == 2:
                messages.append((frames[0], frames[1]))

    def send(self, client_id: bytes, message: ServerMessage) -> None:
        self.socket.send_multipart([client_id, encode(message)])

    def close(self, linger_s: float = 2.0) -> None:
        """Close after giving queued outputs (the shutdown's aborts) up to ``linger_s`` to reach their clients."""
        self.socket.close(linger=int(linger_s * 1000))
        self.context.term()
