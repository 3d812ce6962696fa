"""A tensor-parallel group behind one route stage: the leader member runs the stage as any
worker does, and every engine call that changes its state goes, in the same order, to each
follower member (protocol MIRROR), which makes the same call on its own share of the layers.
So the members open, drop and trim the same sessions and run the same forward passes with
the same entries, and their gathers meet (engine_c/tp_link.cpp); only the leader's output
goes on.

Nothing comes back on this link. A call the leader refuses is not sent, except a forward
pass, which goes first (the followers start it while the leader does): one that fails on
both before its first gather (an unknown session, a full context) is let go by the follower
too. A follower that cannot follow (a call that fails on it alone, a message it cannot read
or one missing in the sequence) stops, which closes its streams, and the leader's next pass
fails with tp_exchange, saying so; a leader that cannot send to a follower refuses every
later call. A pass is not aborted half way (its members would stop at different gathers):
a cancelled session's pass runs to its end. Prefix memory is not kept for a group (a
member's memory is its own share).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np
import zmq

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.engine.binding import Entry, Output, Stage
from meshnet.net import protocol as P
from meshnet.net.fields import ProtocolError

log = logging.getLogger("meshnet.stage.tp_mirror")

POLL_MS = 100   # a follower's wait for the next call, between looks at its stop flag


class GroupStage:
    """The leader's Stage, as StageLoop uses it, with its state-changing calls mirrored to
    FOLLOWERS (PAIR sockets, one per follower; sends never block: a follower that lets its
    queue fill is lost, and the leader's next pass says so)."""

    def __init__(self, stage: Stage, followers: Sequence[zmq.Socket]):
        self.stage, self.followers = stage, list(followers)
        self._rid = 0
        self.broken: str | None = None   # why the followers are out of step, once they are

    def __getattr__(self, name):   # what does not change the members' state: the leader's own
        return getattr(self.stage, name)

    def _live(self) -> None:
        if self.broken:
            raise MeshnetError(E.TP_EXCHANGE, self.broken)

    def _send(self, op: str, payload=None, **fields) -> None:
        self._rid += 1
        frames = P.encode(P.MIRROR, self._rid, payload, op=op, **fields)
        if len(frames[0]) > P.MAX_HEADER_BYTES:   # (a forward's tokens; sent before the leader's own call)
            self._rid -= 1
            raise MeshnetError(E.INVALID_ARGUMENT, f"a pass of {len(frames[0])} header bytes is more than a group "
                               f"mirrors ({P.MAX_HEADER_BYTES}): fewer tokens a pass")
        for rank, sock in enumerate(self.followers, start=1):
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:
                # this follower misses the call and the others may have it: none can be trusted
                self.broken = (f"follower {rank} of the group could not take the leader's {op} ({e.strerror}): "
                               "the group is out of step")
                raise MeshnetError(E.TP_EXCHANGE, self.broken) from None

    def open_session(self, session_id: int) -> None:
        self._live()
        self.stage.open_session(session_id)
        self._send("open", sid=session_id)

    def release_session(self, session_id: int) -> None:
        self._live()
        self.stage.release_session(session_id)
        self._send("release", sid=session_id)

    def truncate_session(self, session_id: int, n_keep: int) -> None:
        self._live()
        self.stage.truncate_session(session_id, n_keep)
        self._send("truncate", sid=session_id, n_keep=n_keep)

    def set_sampling(self, session_id: int, sampling: Sampling | None, history: Sequence[int] = (),
                     grammar_from: int | None = None) -> None:
        self._live()
        self.stage.set_sampling(session_id, sampling, history, grammar_from)
        wire, grammar = P.open_grammar(sampling)
        self._send("sampling", grammar, sid=session_id, sampling=wire, history=[int(t) for t in history],
                   grammar_from=grammar_from)

    def forward(self, entries: Sequence[Entry], want_logits: bool = True) -> Output:
        # the followers start the pass first: the leader's first gather waits for them
        self._live()
        wire, rows = [], []
        for e in entries:
            tokens = None if e.tokens is None else [int(t) for t in np.asarray(e.tokens).reshape(-1)]
            wire.append([e.session_id, e.pos, e.n_tokens, bool(e.verify), tokens, e.residual is not None])
            if e.residual is not None:
                rows.append(np.ascontiguousarray(e.residual, dtype="<f4"))
        payload = np.concatenate(rows).data if rows else None
        self._send("forward", payload, entries=wire, want_logits=want_logits)
        try:
            return self.stage.forward(entries, want_logits)
        except MeshnetError as e:
            if e.code == E.TP_EXCHANGE:
                self.broken = e.message   # the streams may be out of step: the group is done
            raise

    def save_session(self, session_id: int) -> bytes:
        raise MeshnetError(E.INVALID_ARGUMENT, "a tensor-parallel group keeps no prefix memory (each member's is its "
                           "own share)")

    def restore_session(self, session_id: int, memory: bytes, n_tokens: int) -> None:
        self.save_session(session_id)

    def abort(self) -> None:
        """Not done in a group: the members would stop at different gathers."""


def _entries(msg: P.Message, width: int) -> list[Entry]:
    """A MIRROR forward's entries, their rows checked against this member's seam width."""
    rows = sum(n for _, _, n, _, _, has_rows in msg["entries"] if has_rows)
    size = 0 if msg.payload is None else len(msg.payload)
    if size != rows * width * 4:
        raise ProtocolError(E.BAD_PAYLOAD, f"mirror: a forward's payload of {size} bytes is not its {rows} rows x "
                            f"{width} x f32", msg.rid)
    data = np.frombuffer(msg.payload, dtype="<f4").reshape(rows, width) if rows else None
    out, at = [], 0
    for sid, pos, n, verify, tokens, has_rows in msg["entries"]:
        residual = None
        if has_rows:
            residual, at = data[at:at + n], at + n
        out.append(Entry(sid, pos, tokens=None if tokens is None else np.array(tokens, dtype=np.int32),
                         residual=residual, verify=verify))
    return out


def apply(stage: Stage, msg: P.Message) -> None:
    """One mirrored call on this member's stage."""
    op = msg["op"]
    needs = {"open": ("sid",), "release": ("sid",), "truncate": ("sid", "n_keep"), "sampling": ("sid",),
             "forward": ("entries",)}[op]
    missing = [f for f in needs if msg.get(f) is None]
    if missing:
        raise ProtocolError(E.BAD_FIELD, f"mirror {op}: missing {', '.join(missing)}", msg.rid)
    if op == "open":
        stage.open_session(msg["sid"])
    elif op == "release":
        stage.release_session(msg["sid"])
    elif op == "truncate":
        stage.truncate_session(msg["sid"], msg["n_keep"])
    elif op == "sampling":
        sampling = P.open_sampling(msg) if msg.get("sampling") is not None else None
        stage.set_sampling(msg["sid"], sampling, msg.get("history") or (), msg.get("grammar_from"))
    else:
        entries = _entries(msg, stage.seam_width)
        try:
            stage.forward(entries, bool(msg.get("want_logits", True)))
        except MeshnetError as e:
            if e.code == E.TP_EXCHANGE:
                raise
            # refused before its first gather, as the leader's same call was (the same state
            # and entries): nothing of it was kept, so the members are still in step
            log.info("a mirrored pass failed here as on the leader: %s", e)


def follow(stage: Stage, sock: zmq.Socket, stop: threading.Event, max_payload: int,
           alive=lambda: True) -> MeshnetError | None:
    """A follower member: the leader's calls on SOCK, made on STAGE in order, until STOP is
    set (None) or one cannot be followed (the error, after which the group is broken: the
    caller closes the member's streams). ALIVE, asked while no call comes: whether the
    leader still is (its stream open)."""
    last = 0
    while not stop.is_set():
        if not sock.poll(POLL_MS):
            if not alive():
                return MeshnetError(E.TP_EXCHANGE, "the group's leader is gone (its stream closed)")
            continue
        frames, why = P.recv_frames(sock, 2, max_payload + P.MAX_HEADER_BYTES)
        try:
            if why is not None:
                raise ProtocolError(E.OVERSIZED, f"mirror: {why}", None)
            msg = P.decode(frames, max_payload)
            if msg.type != P.MIRROR:
                raise ProtocolError(E.UNKNOWN_TYPE, f"a follower takes mirror messages, not {msg.type}", msg.rid)
            if msg.rid != last + 1:
                raise ProtocolError(E.BAD_FIELD, f"mirror: call {msg.rid} after call {last}: the calls between "
                                    "are missing", msg.rid)
            last = msg.rid
            apply(stage, msg)
        except MeshnetError as e:   # (a ProtocolError among them: a message it cannot read)
            log.error("this member cannot follow the group's leader: %s", e)
            return e
        except Exception as e:   # what the checks above should have caught: still a reason, not a dead thread
            log.exception("this member failed on the leader's call")
            return MeshnetError(E.INTERNAL, f"a follower failed on the leader's call: {type(e).__name__}: {e}")
    return None
