"""A worker in a tensor-parallel group of two: the leader's side (its follower joined and their
stream linked before the leader's stage loads) and a follower's whole life (join, link, load
its share, follow the leader's calls until it is stopped or the group breaks).

The leader is the route's stage (it registers with the coordinator as any worker); the
follower talks only to its leader: a PAIR socket (CURVE, each told the other's public key,
in a ZeroMQ context of its own whose authenticator admits only that key) for the join and
then the mirrored calls (stage/tp_mirror.py), and the engine's stream for the rows
(stage/tp_group.py). The leader tells the follower its layers and every stage option that
decides how sessions are laid out (context, sessions, pool, batch, numerics, KV types), so
the two engines hold their sessions alike.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.engine.binding import Stage
from meshnet.net import protocol as P
from meshnet.net import security
from meshnet.net.fields import ProtocolError
from meshnet.net.member_link import split_endpoint
from meshnet.net.security import Gatekeeper, KeyPair
from meshnet.stage.tp_group import GroupLink
from meshnet.stage.tp_mirror import follow

JOIN_TIMEOUT_S = 300.0   # a leader waits this long for its follower (which may be loading a model)
LOOK_MS = 200            # a leader waiting for its follower's load looks this often whether it is gone
CONTROL_HWM = 1024       # mirrored calls queued for a follower before the leader calls it lost
STAGE_OPTIONS = ("n_ctx", "max_sessions", "n_batch", "pool_cells", "numerics", "flash_attn", "kv_type")
MAX_CTX = 1 << 20        # a leader's options a follower takes, bounded: tokens of context a session ...
MAX_BATCH = 8192         # ... and tokens a pass


@dataclass(frozen=True)
class GroupOptions:
    """meshnet worker --tp RANK/SIZE: with BIND (the leader) or LEADER (a follower), and the
    other member's public key where the links are keyed."""
    rank: int
    size: int
    bind: str | None = None
    leader: str | None = None
    peer_key: bytes | None = None
    join_timeout_s: float = JOIN_TIMEOUT_S


def group_id(model_sha256: str | None, layers: tuple[int, int]) -> bytes:
    return f"{model_sha256 or '-'}:{layers[0]}:{layers[1]}".encode()


def _control(ctx: zmq.Context, max_payload: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, CONTROL_HWM)
    sock.setsockopt(zmq.RCVHWM, CONTROL_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_payload + P.MAX_HEADER_BYTES)
    return sock


def _wait(sock: zmq.Socket, timeout_s: float, max_payload: int, what: str) -> P.Message:
    if timeout_s <= 0 or not sock.poll(max(1, int(timeout_s * 1000))):   # (poll(-1) would wait for ever)
        raise MeshnetError(E.TIMEOUT, f"no {what} in {timeout_s:g} s")
    frames, why = P.recv_frames(sock, 2, max_payload + P.MAX_HEADER_BYTES)
    if why is not None:
        raise MeshnetError(E.OVERSIZED, f"the {what}: {why}")
    return P.decode(frames, max_payload)


class LeaderGroup:
    """The leader's follower, joined and linked: its control socket (GroupStage's) and the
    group's stream (the stage's tp_link)."""

    def __init__(self, options: GroupOptions, keys: KeyPair | None, model_sha256: str | None,
                 layers: tuple[int, int], stage_options: dict, max_payload: int):
        if options.size != 2 or options.rank != 0 or not options.bind:
            raise MeshnetError(E.INVALID_ARGUMENT, "a worker leads a group of 2 as member 0, with --tp-bind")
        if (keys is None) != (options.peer_key is None):
            raise MeshnetError(E.BAD_KEY, "a keyed leader needs its follower's public key (--tp-peer-key), and only then")
        self.ctx, self.gatekeeper, self.control, self.link = zmq.Context(), None, None, None
        self.timeout_s = options.join_timeout_s
        try:
            if keys is not None:
                self.gatekeeper = Gatekeeper(self.ctx, {options.peer_key})
            self.control = _control(self.ctx, max_payload)
            self.link = GroupLink(0, 2, keys, group=group_id(model_sha256, layers))
            if keys is not None:
                security.serve(self.control, keys)
            self.control.bind(options.bind)
            self._admit(options, model_sha256, layers, stage_options, max_payload)
        except BaseException:
            self.close()
            raise

    def _admit(self, options, model_sha256, layers, stage_options, max_payload) -> None:
        print(f"meshnet worker: waiting for tensor-parallel member 1 at "
              f"{self.control.getsockopt_string(zmq.LAST_ENDPOINT)}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + options.join_timeout_s
        while True:
            # a join that is not this group's member 1 (a wrong model, rank or message) is
            # refused, and the leader waits on for the right one (until its deadline)
            try:
                join = _wait(self.control, deadline - time.monotonic(), max_payload, "join from member 1")
            except ProtocolError as e:
                print(f"meshnet worker: refused a join that is not a message of the protocol: {e}", file=sys.stderr,
                      flush=True)
                continue
            if (join.type == P.GROUP_JOIN and join["rank"] == 1 and join["size"] == 2
                    and join.get("model") == model_sha256):
                break
            why = f"not member 1 of this group of 2 on model {model_sha256}"
            print(f"meshnet worker: refused a join ({join.type}, {join.fields}): {why}", file=sys.stderr, flush=True)
            self.control.send_multipart(P.error_frames(join.rid, E.INVALID_ARGUMENT, why))
        host = split_endpoint(self.control.getsockopt_string(zmq.LAST_ENDPOINT))[0]
        endpoint = self.link.bind_for(1, f"tcp://{host}:0", peer_public=options.peer_key)
        self.control.send_multipart(P.encode(P.GROUP_WELCOME, join.rid, endpoint=endpoint, layers=list(layers),
                                             options=stage_options))
        self.link.accept_all()
        figures = self.link.measure()
        print(f"meshnet worker: tensor-parallel member 1 linked: a gather {figures.gather_us:.0f} us, "
              f"{figures.bandwidth / 1e6:.0f} MB/s", file=sys.stderr, flush=True)

    def wait_loaded(self, max_payload: int) -> None:
        """Until the follower has loaded its share (its OK): the leader serves no pass before.
        A follower gone meanwhile (its stream closed) is said at once."""
        deadline = time.monotonic() + self.timeout_s
        while not self.control.poll(LOOK_MS):
            if self.lost() or time.monotonic() > deadline:
                raise MeshnetError(E.TP_EXCHANGE, "tensor-parallel member 1 did not load its share: "
                                   f"{self.lost() or f'no word in {self.timeout_s:g} s'}")
        ready = _wait(self.control, self.timeout_s, max_payload, "word from member 1 that it has loaded")
        if ready.type != P.OK:
            raise MeshnetError(ready.get("code", E.TP_EXCHANGE), "tensor-parallel member 1 could not load its share: "
                               f"{ready.get('message', ready.type)}")

    def lost(self) -> str | None:
        """Why the follower is gone (its stream closed, or silent past the keepalive), or None."""
        return self.link.lost()

    def close(self) -> None:
        if self.control is not None:
            self.control.close(linger=0)
        if self.link is not None:
            self.link.close()
        if self.gatekeeper is not None:
            self.gatekeeper.stop()
        self.ctx.term()


def _welcome_options(welcome: P.Message) -> dict:
    options = welcome["options"]
    missing = set(STAGE_OPTIONS) - set(options)
    if missing:
        raise MeshnetError(E.BAD_FIELD, f"the leader's welcome lacks the stage options {sorted(missing)}")
    if not (16 <= options["n_ctx"] <= MAX_CTX and 1 <= options["max_sessions"] <= 256
            and 1 <= options["n_batch"] <= MAX_BATCH):
        raise MeshnetError(E.BAD_FIELD, f"the leader's stage options are out of bounds: {options}")
    return {k: options[k] for k in STAGE_OPTIONS}


def run_follower(options: GroupOptions, keys: KeyPair | None, model_path: str, model_sha256: str | None,
                 n_threads: int, n_embd: int) -> int:
    """Member 1: join the leader, load the share it names, follow its calls. Returns 0 when
    stopped (SIGTERM); raises the reason when the group breaks."""
    if options.size != 2 or options.rank != 1 or not options.leader:
        raise MeshnetError(E.INVALID_ARGUMENT, "a worker follows a group of 2 as member 1, with --tp-leader")
    if (keys is None) != (options.peer_key is None):
        raise MeshnetError(E.BAD_KEY, "a keyed follower needs its leader's public key (--tp-peer-key), and only then")
    stop = threading.Event()

    def setting_up(*_):   # until it follows, a stop ends the set-up at once (the finally below cleans up)
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, setting_up)
    ctx, control, stage, link = zmq.Context(), None, None, None
    try:
        control = _control(ctx, 2 * MAX_BATCH * n_embd * 4)
        if keys is not None:
            security.client(control, keys, options.peer_key)
        control.connect(options.leader)
        control.send_multipart(P.encode(P.GROUP_JOIN, 1, rank=1, size=2, model=model_sha256))
        welcome = _wait(control, options.join_timeout_s, P.MAX_HEADER_BYTES, "welcome from the leader")
        if welcome.type != P.GROUP_WELCOME:
            raise MeshnetError(welcome.get("code", E.INVALID_ARGUMENT), f"the leader refused this member: "
                               f"{welcome.get('message', welcome.type)}")
        stage_options = _welcome_options(welcome)
        layers = tuple(welcome["layers"])
        host, port = split_endpoint(welcome["endpoint"])
        if host in ("0.0.0.0", "::", "*"):   # a leader bound to every interface: the one this member reached
            host = split_endpoint(options.leader)[0]
        link = GroupLink(1, 2, keys, group=group_id(model_sha256, layers))
        link.connect_to(0, f"tcp://{host}:{port}", options.peer_key)
        link.measure()
        try:
            stage = Stage(model_path, layers, tp=(1, 2), tp_link=link.engine_link(), n_threads=n_threads,
                          **stage_options)
        except MeshnetError as e:   # the leader waits for this member's load: it hears why at once
            control.send_multipart(P.error_frames(2, e.code, e.message))
            raise
        control.send_multipart(P.encode(P.OK, 2))
        print(f"meshnet worker: following the leader as tensor-parallel member 1 of 2, layers "
              f"[{layers[0]},{layers[1]})", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        max_payload = 2 * stage_options["n_batch"] * stage.seam_width * 4
        error = follow(stage, control, stop, max_payload, alive=lambda: link.lost() is None)
        if error is not None:
            raise error
        return 0
    finally:
        if stage is not None:
            stage.close()
        if link is not None:
            link.close()
        if control is not None:
            control.close(linger=0)
        ctx.term()
