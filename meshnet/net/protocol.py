"""The protocol: every message, in one place, on both planes.

Control (coordinator ROUTER <-> worker DEALER): heartbeats, open/release/cancel, health,
text. Data (PUSH -> a peer's bound PULL): activations from stage to stage, the tail's
tokens to the coordinator and each decode step straight back to the head (a ring), so
the coordinator is off the per-token path. A data message names its session and the
session's key, which the coordinator drew at open and gave only to that session's
stages: a data message without it is dropped and counted, never used.

A message is one msgpack header frame, optionally followed by one raw payload frame
(a residual or logits as little-endian f32, never copied into msgpack). Every header
carries the protocol version, the message type and a request id; each type's fields
are checked on receipt (types, ranges, and rows x n_embd x 4 bytes == payload length) before
anything uses them. A bad message becomes a ProtocolError with a stable code that
the receiver sends back as an ERROR message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from meshnet.core import errors as E
from meshnet.net.capability import Capability
from meshnet.core.drafts import MAX_DRAFTS
from meshnet.core.logprobs import MAX_TOP
from meshnet.core.sampling import MAX_GRAMMAR_BYTES, Sampling
from meshnet.net.fields import (BOOL, DICT, FLOAT, INT, LIST, STR, ProtocolError, at_most, block_keys, checked,
                                curve_key, endpoint, is_int, layer_range, mirror_entries, nonneg, positive, sampling,
                                seams, sha256, stage_options, tokens, top_logprobs, u64)

VERSION = 17  # 2: sampling and history in OPEN, TEMPLATE; 3: the stage's device in READY;
              # 4: the text requests' bulk (text, tokens, messages) and their answers in a payload frame;
              # 5: the stage's numerics class in READY; 6: each layer's memory in the cost;
              # 7: prefix reuse (the prompt's block keys in OPEN, the tokens restored in its OK,
              #    the session's block keys in RELEASE); speculation (drafts per round in OPEN and
              #    its OK, verify steps in ACT, each round's drafts and those kept in TOKEN);
              # 8: a grammar in OPEN's sampling, and where in the history its tokens start;
              #    logprobs in OPEN, and each token's in TOKEN; 9: CHAT;
              # 10: weights over the mesh (HOLDERS, MANIFEST, FETCH);
              # 11: OPEN's grammar in its payload frame (bounded apart from the header);
              #     the manifest's per-tensor hashes vouched for by the coordinator;
              # 12: the head's micro-batches (groups) in OPEN; 13: flash attention in READY;
              # 14: flash attention in the invariant class too; 15: the KV cache's types in READY;
              # 16: a model of several files (gguf-split): the manifest's splits, FETCH over their concatenation;
              # 17: a tensor-parallel group's leader and follower: GROUP_JOIN, GROUP_WELCOME, MIRROR

# message types
READY = "ready"            # worker -> coordinator: here I am, with my capability
HEARTBEAT = "heartbeat"    # both ways, on a clock
GOODBYE = "goodbye"        # worker -> coordinator: shutting down, forget me
DISCONNECT = "disconnect"  # coordinator -> worker: I do not know you, announce again
HEALTH = "health"          # coordinator -> worker: stage statistics please
CAPABILITY = "capability"  # coordinator -> worker: your capability again please
OPEN = "open"              # coordinator -> worker: open a session, with its key and next hop
CANCEL = "cancel"          # coordinator -> worker: stop and drop a session
RELEASE = "release"        # coordinator -> worker: free a session's KV
SHUTDOWN = "shutdown"      # coordinator -> worker: exit gracefully
ASSIGN = "assign"          # coordinator -> a worker started with --layers auto: load this range
# the text requests carry their bulk in the payload frame, and so do their answers (OK +
# payload), so that no prompt, however long, meets the header's bound
TOKENIZE = "tokenize"      # coordinator -> worker: UTF-8 text -> token ids (int32), as llama.cpp does for the model
DETOKENIZE = "detokenize"  # coordinator -> worker: token ids (int32) -> UTF-8 text
TEMPLATE = "template"      # coordinator -> worker: chat messages (msgpack) -> the prompt text, by the model's chat template
CHAT = "chat"              # coordinator -> worker: an OpenAI chat request (JSON: messages with tool calls and results,
                           # tools, tool_choice) -> the template's prompt, grammar and tool-call format (JSON),
                           # by llama.cpp's common chat code (engine: meshnet_chat_apply)
# weights over the mesh (meshnet/weights/): a worker without the model file fetches the
# bytes of its range from a holder, each tensor checked against the manifest the coordinator
# vouches for (weights/vouch.py), never one a holder sends
HOLDERS = "holders"        # worker -> coordinator: the model's sha256, who holds its bytes ([endpoint, key]) that
                           # answers, and the manifest the coordinator vouches for (msgpack) in the OK's payload
MANIFEST = "manifest"      # coordinator -> holder: the holder's own manifest, a hint checked by hashing the file
FETCH = "fetch"            # worker, coordinator -> holder: LENGTH bytes of the file at OFFSET, in the OK's payload
OK = "ok"                  # reply with no payload (open, cancel, release, health, capability)
ERROR = "error"            # reply to anything that failed, with a code; unasked, a session's failure
# the data plane
ACT = "act"                # -> a stage: token ids (head) or residual rows of one session, to run
TOOK = "took"              # head, tail -> coordinator: a prompt chunk is taken / done, the next may come
TOKEN = "token"            # tail -> coordinator: the session's next token (+ logits when asked)
# a tensor-parallel group's plane: its leader (the route's stage) -> each follower member, on
# their CURVE link: each engine call that changes the members' state, in the leader's order,
# so that every member runs the same passes (their gathers meet); no answer (a follower that
# fails breaks the group's streams, and the leader's next pass says so)
MIRROR = "mirror"
MIRROR_OPS = ("open", "release", "truncate", "sampling", "forward")
GROUP_JOIN = "group_join"        # follower -> leader, first: its rank, the group's size, its model file's sha256
GROUP_WELCOME = "group_welcome"  # leader -> follower: the stream's endpoint, the layers, the stage's options

MAX_HEADER_BYTES = 64 * 1024
MAX_FETCH_BYTES = 4 << 20   # one FETCH's bytes at most: a fetch's memory is a few of them in flight
# the longest text a text request carries: a prompt of many contexts' worth is refused
# before it is sent (see coordinator.tokenize)
MAX_TEXT_BYTES = 8 << 20


@dataclass
class Message:
    type: str
    rid: int
    fields: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview | None = None

    def __getitem__(self, key: str):
        return self.fields[key]

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


def _messages(v):
    return 0 < len(v) <= 4096 and all(isinstance(m, dict) and set(m) == {"role", "content"}
                                      and all(isinstance(x, str) for x in m.values()) for m in v)


SCHEMAS: dict[str, dict[str, tuple]] = {
    READY: {"capability": (DICT, True, None),    # its fields: capability.FIELDS
            "epoch": (INT, False, u64)},         # one more each time the worker dropped its sessions
    HEARTBEAT: {},
    GOODBYE: {},
    DISCONNECT: {},
    HEALTH: {},
    CAPABILITY: {},
    OPEN: {
        "sid": (INT, True, u64),
        "key": (INT, True, u64),                  # the session's data-plane key
        "stage": (INT, True, lambda v: 0 <= v < 1 << 16),   # this stage's place in the route
        "next": (STR, True, endpoint),            # where this stage's output goes (the tail: the head)
        "reply": (STR, True, endpoint),           # the coordinator's data endpoint
        "prompt_len": (INT, True, positive),
        "max_tokens": (INT, True, positive),
        "stop_at_eog": (BOOL, True, None),
        "logits": (BOOL, False, None),             # the tail sends each token's logits
        "hop_clock": (BOOL, False, None),          # the previous stage shares this host's clock: time the hop
        "gather": (BOOL, False, None),             # the head: gather decode steps (the stages share CPUs)
        "groups": (INT, False, lambda v: 1 <= v <= 1 << 16),   # the head: micro-batches to keep in flight
                                                  # (the route's stages, when they pipeline)
        "next_key": (STR, False, curve_key),      # CURVE routes: the next hop's public key (its data endpoint)
        "prev_key": (STR, False, curve_key),      # ... and the previous stage's, which may push to this one
        "sampling": (DICT, False, sampling),      # the tail: sample with these (meshnet.core.sampling.Sampling) ...
        "history": (LIST, False, tokens),         # ... knowing the tokens so far: the prompt (prompt_len of them)
        "grammar_from": (INT, False, nonneg),     # ... of which the sampling's grammar takes those from here on
                                                  # (a replay's prompt holds tokens generated under it; default prompt_len)
        "prefix": (LIST, False, block_keys),      # the prompt's block keys (core/prefix.py): start from a stored prefix
        "speculate": (INT, False, at_most(MAX_DRAFTS)),   # drafts per round at most (core/drafts.py); the head
                                                  # drafts from the history it is given (the prompt)
        "logprobs": (INT, False, lambda v: 0 <= v <= MAX_TOP),   # the tail: each token's log-probability
                                                  # and those of this many most likely (core/logprobs.py)
    },
    CANCEL: {"sid": (INT, True, u64)},
    RELEASE: {"sid": (INT, True, u64),
              "keep": (LIST, False, block_keys)},        # the session's block keys: store its memory under them
    SHUTDOWN: {},
    ASSIGN: {"layers": (LIST, True, layer_range)},
    TOKENIZE: {"add_special": (BOOL, False, None), "parse_special": (BOOL, False, None),
               "limit": (INT, False, positive)},          # more tokens than this: context_full, none sent back
    DETOKENIZE: {},
    TEMPLATE: {"add_generation_prompt": (BOOL, False, None)},
    CHAT: {},
    HOLDERS: {},
    MANIFEST: {},
    FETCH: {"offset": (INT, True, u64),
            "length": (INT, True, lambda v: 0 < v <= MAX_FETCH_BYTES)},
    OK: {"sid": (INT, False, u64), "info": (DICT, False, None),
         "offset": (INT, False, u64),                      # FETCH's: where its bytes start in the file
         "cached": (INT, False, nonneg),                   # OPEN's: the prompt tokens this stage restored
         "speculate": (INT, False, nonneg)},               # ... and the drafts per round it takes (0: none)
    ERROR: {
        "code": (STR, True, None),
        "message": (STR, True, None),
        "sid": (INT, False, u64),
        "context": (DICT, False, None),
    },
    # the data plane: every message names its session and carries the session's key
    ACT: {
        "sid": (INT, True, u64),
        "key": (INT, True, u64),
        "pos": (INT, True, nonneg),
        "n": (INT, True, positive),
        "tokens": (LIST, False, tokens),          # the head's input; other stages get n x n_embd f32 rows
        "ack": (BOOL, False, None),                # a prompt chunk: the head answers TOOK when it has taken it
        "verify": (BOOL, False, None),             # the last drawn token and drafts (their ids in tokens): the tail
                                                   # keeps the drafts up to the first it would not have drawn
        "ts": (INT, False, u64),                  # the sender's monotonic clock at sending, ns
        "seams": (LIST, False, seams),            # [seam, hop_us, bytes] for each seam this step crossed
    },
    TOOK: {
        "sid": (INT, True, u64),
        "key": (INT, True, u64),
        "pos": (INT, True, nonneg),
        "n": (INT, True, positive),
        "head": (BOOL, False, None),               # the head has taken the chunk (it asked: ack)
        "tail": (BOOL, False, None),               # the tail has finished it (a chunk before the prompt's last)
    },
    TOKEN: {
        "sid": (INT, True, u64),
        "key": (INT, True, u64),
        "pos": (INT, True, nonneg),
        "n": (INT, True, positive),
        "token": (INT, True, nonneg),
        "eog": (BOOL, True, None),                 # the token ends generation
        "piece": ((bytes,), False, None),          # the token's text, for streaming
        "logits_n": (INT, False, positive),       # with a payload of that many f32
        "seams": (LIST, False, seams),            # as in ACT: since the tail's last TOKEN of this session
        "drafted": (INT, False, nonneg),          # a speculating session's decode round: its drafts ...
        "accepted": (INT, False, nonneg),         # ... and those kept (this token and the next ones follow)
        "logprob": (FLOAT, False, lambda v: v <= 0.0),   # a session opened with logprobs: this token's ...
        "top": (LIST, False, top_logprobs),       # ... and the most likely tokens': [token, logprob, piece]
    },
    GROUP_JOIN: {"rank": (INT, True, positive), "size": (INT, True, lambda v: 2 <= v <= 64),
                 "model": (STR, False, sha256)},
    GROUP_WELCOME: {"endpoint": (STR, True, endpoint), "layers": (LIST, True, layer_range),
                    "options": (DICT, True, stage_options)},
    MIRROR: {
        "op": (STR, True, lambda v: v in MIRROR_OPS),
        "sid": (INT, False, u64),                 # open, release, truncate, sampling
        "n_keep": (INT, False, nonneg),           # truncate
        "sampling": (DICT, False, sampling),      # sampling: as OPEN's (its grammar in the payload frame) ...
        "history": (LIST, False, tokens),
        "grammar_from": (INT, False, nonneg),
        "entries": (LIST, False, mirror_entries),  # forward: [sid, pos, n, verify, tokens or None, rows] each;
                                                  # the entries with rows have n residual rows each in the
                                                  # payload frame, in order
        "want_logits": (BOOL, False, None),
    },
}


# What a worker offers in READY. The coordinator routes sessions by these numbers, so
# they are checked as strictly as a header: a missing or mistyped one refuses the worker.
def encode(msg_type: str, rid: int, payload=None, **fields) -> list:
    """Frames for a message: [header] or [header, payload]."""
    header = {"v": VERSION, "type": msg_type, "rid": rid}
    header.update({k: v for k, v in fields.items() if v is not None})
    frames = [msgpack.packb(header, use_bin_type=True)]
    if payload is not None:
        frames.append(payload)
    return frames


def valid_id(value) -> int | None:
    """A request or session id as the protocol allows it (unsigned 64-bit), else None."""
    return value if is_int(value) and u64(value) else None


def error_frames(rid: int | None, code: str, message: str, sid: int | None = None, **context) -> list:
    """An ERROR reply that is always protocol-valid: ids the peer sent that the protocol
    does not allow are left out rather than echoed."""
    return encode(ERROR, valid_id(rid) or 0, code=str(code), message=str(message), sid=valid_id(sid),
                  context=context or None)


def decode(frames: list, max_payload: int) -> Message:
    """Parse and validate one message; raises ProtocolError with a code on any defect.
    Frames are bytes or zmq frames (anything with the buffer protocol)."""
    if not frames or len(frames) > 2:
        raise ProtocolError(E.MALFORMED, f"a message is 1 or 2 frames, got {len(frames)}")
    raw = frames[0]
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(E.OVERSIZED, f"header of {len(raw)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(E.MALFORMED, f"header is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(E.MALFORMED, "header is not a map")
    rid, sid = valid_id(header.get("rid")), valid_id(header.get("sid"))
    if not is_int(header.get("v")) or header["v"] != VERSION:  # True and 1.0 are not 1 here
        raise ProtocolError(E.BAD_VERSION, f"protocol version {header.get('v')!r} is not {VERSION}", rid, sid)
    if rid is None:
        raise ProtocolError(E.BAD_FIELD, "rid must be an unsigned 64-bit integer", None, sid)
    msg_type = header.get("type")
    schema = SCHEMAS.get(msg_type) if isinstance(msg_type, str) else None
    if schema is None:
        raise ProtocolError(E.UNKNOWN_TYPE, f"unknown message type {msg_type!r}", rid, sid)

    body = {k: v for k, v in header.items() if k not in ("v", "type", "rid")}
    try:
        fields = checked(schema, body, msg_type, rid, sid)
        if msg_type == READY:
            fields["capability"] = Capability.parse(fields["capability"], rid)
    except ProtocolError as e:
        e.msg_type = msg_type
        raise

    payload = None
    if len(frames) == 2:
        payload = frames[1]
        if len(payload) > max_payload:
            raise ProtocolError(E.OVERSIZED, f"payload of {len(payload)} bytes is over the {max_payload}-byte limit", rid, sid)
    return Message(msg_type, rid, fields, payload)


def recv_frames(sock, max_frames: int, max_bytes: int) -> tuple[list, str | None]:
    """One whole message from a socket that poll() said is readable, as (frames, None),
    or ([first frame], why) when it has more frames or bytes than any valid message. zmq's
    MAXMSGSIZE bounds each frame, not their number: an over-long message's frames are
    received one at a time and let go at once, never gathered, and never copied into
    Python objects (they stay zmq frames; the payload is passed on as a view)."""
    frames, total, why = [], 0, None
    while True:
        frame = sock.recv(copy=False)
        total += len(frame)
        if why is None:
            if len(frames) == max_frames:
                why = f"a message has at most {max_frames} frames here"
            elif total > max_bytes:
                why = f"a message has at most {max_bytes} bytes here"
            else:
                frames.append(frame)
        if not frame.more:
            break
    if why is not None:
        return frames[:1], why  # the first frame alone: a ROUTER's peer identity, to answer
    return frames, None


def text_payload(msg: Message) -> str:
    """A text request's text: its payload, UTF-8, at most MAX_TEXT_BYTES."""
    data = _bulk(msg)
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: the text is not UTF-8 (byte {e.start})", msg.rid) from None


def tokens_payload(msg: Message, n_vocab: int) -> list[int]:
    """A payload of token ids: little-endian int32, each below n_vocab."""
    data = _bulk(msg)
    if len(data) % 4:
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: {len(data)} bytes are not whole int32 token ids", msg.rid)
    tokens = np.frombuffer(data, dtype="<i4")
    if len(tokens) and not (0 <= int(tokens.min()) and int(tokens.max()) < n_vocab):
        raise ProtocolError(E.BAD_TOKEN, f"{msg.type}: a token id is outside the vocabulary of {n_vocab}", msg.rid)
    return tokens.tolist()


def messages_payload(msg: Message) -> list[dict]:
    """A TEMPLATE's chat messages: a msgpack list of {"role": text, "content": text}."""
    try:
        messages = msgpack.unpackb(bytes(_bulk(msg)), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: the messages are not valid msgpack: {type(e).__name__}",
                            msg.rid) from None
    if not isinstance(messages, list) or not _messages(messages):
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: the messages are not a list of 1 to 4096 "
                            "{'role': text, 'content': text}", msg.rid)
    return messages


def chat_payload(msg: Message) -> dict:
    """A CHAT's request: a JSON object whose messages are a list of 1 to 4096 objects with a
    role (the engine checks the rest, as llama-server's parser does)."""
    try:
        request = json.loads(text_payload(msg))
    except ValueError as e:
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: the request is not JSON: {e}", msg.rid) from None
    messages = request.get("messages") if isinstance(request, dict) else None
    if not (isinstance(messages, list) and 0 < len(messages) <= 4096
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: the request is not {{\"messages\": [1 to 4096 messages "
                            "with a role], ...}", msg.rid)
    return request


def open_grammar(sampling: Sampling | None) -> tuple[dict | None, bytes | None]:
    """OPEN's sampling for the wire, and its grammar apart, as OPEN's payload frame: a grammar
    may be as long as MAX_GRAMMAR_BYTES, far past what a header holds."""
    if sampling is None:
        return None, None
    wire = sampling.to_wire()
    grammar = wire.pop("grammar", None)
    return wire, grammar.encode() if grammar else None


def open_sampling(msg: Message) -> Sampling | None:
    """An OPEN's sampling with its grammar (the payload frame) back in it."""
    wire = msg.get("sampling")
    if msg.payload is None:
        return None if wire is None else Sampling.from_wire(wire)
    if wire is None or "grammar" in wire:
        raise ProtocolError(E.BAD_FIELD, "open: a grammar frame goes with a sampling that has no grammar field",
                            msg.rid, msg.get("sid"))
    if len(msg.payload) > MAX_GRAMMAR_BYTES:
        raise ProtocolError(E.OVERSIZED, f"open: a grammar of {len(msg.payload)} bytes is over the "
                            f"{MAX_GRAMMAR_BYTES}-byte limit", msg.rid, msg.get("sid"))
    try:
        grammar = bytes(msg.payload).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(E.BAD_PAYLOAD, f"open: the grammar is not UTF-8 (byte {e.start})", msg.rid,
                            msg.get("sid")) from None
    return Sampling.from_wire(dict(wire, grammar=grammar))


def tokens_frame(tokens) -> memoryview:
    return np.ascontiguousarray(tokens, dtype="<i4").data


def _bulk(msg: Message):
    if msg.payload is None:
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: its bulk comes as a payload frame", msg.rid)
    if len(msg.payload) > MAX_TEXT_BYTES:
        raise ProtocolError(E.OVERSIZED, f"{msg.type}: a payload of {len(msg.payload)} bytes is over the "
                            f"{MAX_TEXT_BYTES}-byte limit of a text request", msg.rid)
    return msg.payload


def f32_payload(array: np.ndarray):
    """Residual rows or logits as a raw little-endian f32 frame, without a copy when the
    array already is contiguous f32."""
    return np.ascontiguousarray(array, dtype="<f4").data


def residual_from(msg: Message, width: int) -> np.ndarray:
    """The residual rows of an ACT, checked: n rows of WIDTH (the stage's seam_width: n_embd,
    or more where state beside the residual crosses) little-endian f32, exactly."""
    n = msg["n"]
    # a verify step's rows carry their token ids beside them: the tail checks its drafts
    if msg.payload is None or (msg.get("tokens") is not None and not msg.get("verify")):
        raise ProtocolError(E.BAD_PAYLOAD, f"{msg.type}: this stage takes {n} residual rows as a payload frame, "
                            "not token ids", msg.rid, msg.get("sid"))
    size = len(msg.payload)
    if size != n * width * 4:
        got = size / (4 * n)
        raise ProtocolError(E.BAD_WIDTH if got.is_integer() else E.BAD_PAYLOAD,
                            f"{msg.type}: a payload of {size} bytes is not {n} rows x {width} x f32 "
                            f"({n * width * 4} bytes)", msg.rid, msg.get("sid"))
    return np.frombuffer(msg.payload, dtype="<f4").reshape(n, width)
