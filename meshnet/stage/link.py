"""A worker's one link to its coordinator: a DEALER that libzmq keeps connected, the
monitor that says what became of the connection, and the liveness of the coordinator
heard over it."""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.net import security, sockets
from meshnet.net.heartbeat import Liveness
from meshnet.net.security import HANDSHAKE_FAILED, KeyPair

log = logging.getLogger("meshnet.stage.link")

GIVEN_UP_AFTER = 0.5      # seconds after a disconnect with no reconnect scheduled: libzmq gave up


class CoordinatorLink:
    def __init__(self, ctx: zmq.Context, coordinator: str, keys: KeyPair | None, coordinator_key: bytes | None,
                 heartbeat_interval: float, heartbeat_liveness: int):
        self.ctx = ctx
        self.coordinator = coordinator
        self.keys, self.coordinator_key = keys, coordinator_key
        self.heartbeat_interval, self.heartbeat_liveness = heartbeat_interval, heartbeat_liveness
        self.dealer: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.handshake_failures = 0

    def connect(self, max_frame: int) -> None:
        """One DEALER, kept: libzmq reconnects it with its own back-off when the
        coordinator goes away; IMMEDIATE queues nothing while there is no connection, so a
        coordinator that comes back gets no stale backlog, only our heartbeats, and
        answers the first of them with DISCONNECT: we announce again. Only when libzmq
        gives a connection up for good (a protocol error, such as a frame over
        MAXMSGSIZE) is the socket made anew; its monitor says when."""
        if self.dealer is not None:
            self.close(linger=0)
        sock = sockets.control_dealer(self.ctx, max_frame=max_frame)
        if self.keys is not None:
            security.client(sock, self.keys, self.coordinator_key)
        # watched before it connects: on loopback the connection (and a refused handshake's
        # drop) can come before a monitor attached afterwards would see it
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
                                          | HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            sock.connect(self.coordinator)
        except zmq.ZMQError as e:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise MeshnetError(E.BAD_ADDRESS, f"cannot connect to {self.coordinator!r}: {e.strerror}; "
                               "an address looks like tcp://127.0.0.1:5555") from None
        self.dealer, self.monitor = sock, monitor
        self.handshake_state = "none"
        self.disconnected_at: float | None = None
        self.renew_liveness()

    def renew_liveness(self) -> None:
        self.coordinator_alive = Liveness(self.heartbeat_interval, self.heartbeat_liveness)

    def on_event(self) -> None:
        """What the monitor says happened to the connection."""
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.handshake_state = "pending"
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshake_state = "done"
        elif event & HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and self.handshake_state == "pending"):
            # a peer that drops us mid-handshake refused it too: a keyless worker learns no more
            self.handshake_state = "refused"
            self._handshake_refused(event)
        if event & HANDSHAKE_FAILED:
            return
        # libzmq announces a reconnect (CONNECT_RETRIED) right after an ordinary disconnect
        self.disconnected_at = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None

    def given_up(self) -> bool:
        """libzmq dropped the connection and schedules no reconnect: the socket is spent."""
        return self.disconnected_at is not None and time.monotonic() - self.disconnected_at > GIVEN_UP_AFTER

    def _handshake_refused(self, event: int) -> None:
        self.handshake_failures += 1
        if self.handshake_failures in (1, 10, 100) or self.handshake_failures % 1000 == 0:
            log.warning("worker: the coordinator at %s refused the handshake (%d times): %s", self.coordinator,
                        self.handshake_failures,
                        "this worker's key is not on its --allow list" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                        else "it does not serve CURVE with the key given in --coordinator-key, or it wants one "
                             "and this worker has none")

    def send(self, frames: list) -> None:
        try:
            self.dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # the coordinator is not reading: heartbeats will tell whether it is gone

    def close(self, linger: int) -> None:
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=linger)
