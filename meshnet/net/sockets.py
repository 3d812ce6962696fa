"""The ZeroMQ socket policy, in one place: every control and data socket of a coordinator
and a worker is made here, with the same high-water marks, linger and frame cap.

- A socket never lingers: a closed socket drops what it still holds, so closing a route
  never waits on a peer that is gone.
- MAXMSGSIZE is a hard cap far above any valid frame: libzmq drops a peer sending past it
  before allocating the frame (between the valid size and the cap the peer gets an
  `oversized` error), and a message's frame count and total size are bounded where it is
  read (protocol.recv_frames).
- Every send of the data plane is NOBLOCK, and a send at the high-water mark fails the
  session (hop_unreachable): the mark must stand above any backlog a working route
  builds (a tail's tokens while the coordinator is busy, a stage's queued residuals), so
  both planes take the coordinator's 10,000 messages; the worker's sockets had 1,000.
  Only a peer that floods reaches it, and the frame cap bounds what each message holds.
- CURVE (security.serve / security.client) goes on before a socket binds or connects, so
  the caller applies it between making the socket and using it.
"""

from __future__ import annotations

import zmq

from meshnet.net.heartbeat import RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS

HWM = 10_000   # messages queued each way on any socket


def control_router(ctx: zmq.Context, max_frame: int) -> zmq.Socket:
    """The coordinator's control socket: workers' DEALERs connect to it."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an unroutable send raises, never vanishes
    _common(sock, max_frame)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


def control_dealer(ctx: zmq.Context, max_frame: int) -> zmq.Socket:
    """A worker's control socket to its coordinator, kept: libzmq reconnects it with its own
    back-off, and IMMEDIATE queues nothing while there is no connection, so a coordinator
    that comes back gets no stale backlog."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock, max_frame)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


def fetch_dealer(ctx: zmq.Context, max_frame: int) -> zmq.Socket:
    """A worker's socket to a holder of model bytes (weights/fetch.py): requests queue until
    the connection is up (no IMMEDIATE), and a holder that never answers is given up by
    the fetcher's own deadline."""
    sock = ctx.socket(zmq.DEALER)
    _common(sock, max_frame)
    return sock


def data_pull(ctx: zmq.Context, max_frame: int) -> zmq.Socket:
    """Where a stage (or the coordinator) takes the data plane's messages in."""
    sock = ctx.socket(zmq.PULL)
    _common(sock, max_frame)
    sock.setsockopt(zmq.RCVHWM, HWM)
    return sock


def data_push(ctx: zmq.Context) -> zmq.Socket:
    """One peer's data plane out: residuals to the next stage, tokens to the coordinator,
    prompt chunks to a head."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    return sock


def _common(sock: zmq.Socket, max_frame: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
