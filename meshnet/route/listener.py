"""The coordinator's sockets: the control ROUTER the workers register on, the data PULL
the stages send tokens to, a PUSH per head for prompt chunks, and with keys the CURVE
gatekeeper and the handshake monitor. Bound, secured and closed here; the I/O loop
(io_loop.py) is the only one that sends and receives on them."""

from __future__ import annotations

import errno

import zmq
from zmq.utils.monitor import recv_monitor_message

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.net import addresses
from meshnet.net import protocol as P
from meshnet.net import security, sockets
from meshnet.net.pushes import Pushes
from meshnet.net.security import HANDSHAKE_FAILED, Gatekeeper
from meshnet.route.config import CoordinatorConfig


class Listener:
    def __init__(self, config: CoordinatorConfig):
        self.keys = config.keys
        self.ctx = zmq.Context()
        if config.cpu is not None:
            self.ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, config.cpu)   # before any socket starts the I/O thread
        self.gatekeeper = self.handshakes = self.router = self.data = None
        self.pushes = Pushes(self.ctx, config.keys)
        self.max_message_bytes = config.max_payload + 2 * P.MAX_HEADER_BYTES
        try:
            self._bind(config)
        except BaseException:
            self.close()
            raise

    def _bind(self, config: CoordinatorConfig) -> None:
        keys = config.keys
        # with keys, the control socket is a CURVE server: a worker whose public key is not
        # allowed is refused in the handshake, before any message of it reaches the loop
        self.gatekeeper = Gatekeeper(self.ctx, config.allowed_workers or set(), config.join_key) \
            if keys is not None else None
        self.router = sockets.control_router(self.ctx, max_frame=2 * config.max_payload)
        if keys is not None:
            security.serve(self.router, keys)
        try:
            self.router.bind(config.bind)
        except zmq.ZMQError as e:
            if e.errno == errno.EADDRINUSE:
                raise MeshnetError(E.ADDRESS_IN_USE, f"cannot listen on {config.bind}: the address is already in use "
                                   "(another coordinator?); choose another port with --bind") from None
            raise MeshnetError(E.BAD_ADDRESS, f"cannot listen on {config.bind!r}: {e.strerror}; an address looks like "
                               "tcp://127.0.0.1:5555") from None
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        # a peer refused in the handshake never sends us a message: the socket's monitor is
        # where the refusal shows (no key, a wrong key, a key for another coordinator)
        self.handshakes = self.router.get_monitor_socket(HANDSHAKE_FAILED) if keys is not None else None
        # the data plane: tokens and "chunk taken" from the stages come to this PULL,
        # bound on the control socket's host; prompt chunks go out on a PUSH per head
        self.data = sockets.data_pull(self.ctx, max_frame=2 * config.max_payload)
        if keys is not None:   # only the allowed workers' tails may send tokens
            security.serve(self.data, keys)
        try:
            self.data.bind(config.data_bind or addresses.same_host_any_port(self.endpoint))
        except zmq.ZMQError as e:
            raise MeshnetError(E.BAD_ADDRESS, f"cannot bind the data endpoint {config.data_bind!r}: "
                               f"{e.strerror}") from None
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, identity: bytes, frames: list) -> int | None:
        """Send FRAMES to the worker IDENTITY without blocking: None when it went, else the
        errno (EHOSTUNREACH: its connection is gone; EAGAIN: it does not read)."""
        try:
            self.router.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            return None
        except zmq.ZMQError as e:
            return e.errno

    def push(self, endpoint: str, server_key: str | None, frames: list) -> bool:
        """A data message to a stage's PULL at ENDPOINT (CURVE to SERVER_KEY with keys);
        False when its queue is full."""
        if endpoint not in self.pushes.sockets:
            self.pushes.expect(endpoint, server_key.encode() if server_key else b"")
        try:
            self.pushes.to(endpoint).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def failed_handshake(self) -> tuple[str, str]:
        """The next refusal on the monitor: the peer's endpoint and why."""
        event = recv_monitor_message(self.handshakes)
        why = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its key is not allowed (--allow)",
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it does not speak CURVE with this coordinator's key "
                                                    "(no key, or the key of another coordinator)",
               }.get(event["event"], "the CURVE handshake failed")
        return event.get("endpoint", b"?"), why

    def close(self) -> None:
        self.pushes.close()
        if self.data is not None:
            self.data.close(linger=0)
        if self.handshakes is not None:
            self.router.disable_monitor()
            self.handshakes.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        if self.gatekeeper is not None:
            self.gatekeeper.stop()
        self.ctx.term()


def peer_key(frame) -> str | None:
    """The CURVE public key the ZAP handshake proved for the sender of FRAME (pyzmq's
    authenticator gives it as the User-Id), or None on a link without CURVE."""
    try:
        key = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return key if key and len(key) == 40 else None
