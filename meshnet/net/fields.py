"""The checks a message's fields pass on receipt: python types, bounds, and one schema
checked field by field. Shared by the protocol's messages (protocol.py) and the
capability a worker announces (capability.py)."""

from __future__ import annotations

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.logprobs import MAX_TOP
from meshnet.core.prefix import MAX_BLOCKS
from meshnet.core.sampling import Sampling

# what a capability may claim: far above any real model (the largest have under 200
# layers), and low enough that no claim makes the coordinator's planning or routing
# costly (both are linear in the layers)
MAX_LAYERS = 4096
MAX_EMBD = 1 << 16
MAX_VOCAB = 1 << 22
MAX_CTX = 1 << 24
MAX_BATCH = 1 << 16
MAX_SESSIONS = 1 << 12
U64_MAX = (1 << 64) - 1


class ProtocolError(MeshnetError):
    """A message that cannot be used; rid is set when the sender's request id was readable,
    msg_type when its type was."""

    msg_type: str | None = None

    def __init__(self, code: str, message: str, rid: int | None = None, sid: int | None = None):
        super().__init__(code, message)
        self.rid = rid
        self.sid = sid


# field checks: (python types, required, extra check or None)
def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # bool is an int subclass: never accept it as one


def u64(v):
    return 0 <= v <= U64_MAX


def nonneg(v):
    return 0 <= v < 1 << 31


def positive(v):
    return 0 < v < 1 << 31


def tokens(v):
    return all(is_int(t) and -(1 << 31) <= t < 1 << 31 for t in v)


MAX_MIRROR_ENTRIES = 4096      # a forward pass's entries: far more than any stage's sessions
MAX_MIRROR_ROWS = 1 << 16      # an entry's rows: more than any batch the engine takes


def mirror_entries(v):
    """A MIRROR forward's entries: [sid, pos, n, verify, tokens or None, rows]: n >= 1 rows
    from position pos (both within the engine's int32), tokens n ids, rows whether n
    residual rows come in the payload (required without tokens)."""
    return 0 < len(v) <= MAX_MIRROR_ENTRIES and all(
        isinstance(e, list) and len(e) == 6 and is_int(e[0]) and u64(e[0]) and is_int(e[1]) and 0 <= e[1] < 1 << 31
        and is_int(e[2]) and 1 <= e[2] <= MAX_MIRROR_ROWS and isinstance(e[3], bool)
        and (e[4] is None or (isinstance(e[4], list) and len(e[4]) == e[2] and tokens(e[4])))
        and isinstance(e[5], bool) and (e[5] or e[4] is not None)
        for e in v)


# what a group's leader tells its follower of the stage it is to load (stage/tp_member.py)
_STAGE_OPTIONS = {"n_ctx": int, "max_sessions": int, "n_batch": int, "pool_cells": int, "numerics": str,
                  "flash_attn": bool, "kv_type": str}


def stage_options(v):
    return all(k in _STAGE_OPTIONS and type(x) is _STAGE_OPTIONS[k] and (not isinstance(x, int) or 0 <= x < 1 << 31)
               for k, x in v.items())


def block_keys(v):
    return len(v) <= MAX_BLOCKS and all(is_int(k) and 0 <= k <= U64_MAX for k in v)


def layer_range(v):
    return len(v) == 2 and all(is_int(d) and 0 <= d <= MAX_LAYERS for d in v) and v[0] < v[1]


def at_most(limit):
    return lambda v: 0 < v <= limit


def seams(v):
    return len(v) <= 4096 and all(isinstance(s, (list, tuple)) and len(s) == 3 and all(is_int(x) for x in s)
                                  and 0 <= s[0] < 1 << 20 and -1 <= s[1] < 1 << 40 and 0 <= s[2] < 1 << 40 for s in v)


def top_logprobs(v):
    return len(v) <= MAX_TOP and all(
        isinstance(t, (list, tuple)) and len(t) == 3 and is_int(t[0]) and 0 <= t[0] < MAX_VOCAB
        and isinstance(t[1], float) and t[1] <= 0.0 and isinstance(t[2], bytes) and len(t[2]) <= 256 for t in v)


def sampling(v):
    try:
        Sampling.from_wire(v)
        return True
    except MeshnetError:
        return False



def endpoint(v):
    return 0 < len(v) <= 256 and "://" in v


def peer_endpoint(v):
    """tcp://HOST:PORT that a peer connects to and prints: libzmq raises at connect on
    anything else (a space in the host, a transport it does not know, a bind address), and
    a control character would forge the log lines it is printed in. HOST is a name, an IPv4
    address or a bracketed IPv6 one, with its zone (a wildcard, 0.0.0.0 or [::], is reached
    at the coordinator's host: addresses.reachable)."""
    if not 0 < len(v) <= 256 or not v.startswith("tcp://"):
        return False
    host, colon, port = v[len("tcp://"):].rpartition(":")
    if not colon or not port.isascii() or not port.isdigit() or len(port) > 5 or not 0 < int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        return len(host) > 2 and all(c in _IPV6 for c in host[1:-1])
    return bool(host) and all(c in _HOST for c in host)


_HOST = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_")
_IPV6 = _HOST | frozenset(":%")


def sha256(v):
    return len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def curve_key(v):
    return len(v) == 40 and all(c in _Z85 for c in v)


_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def short_text(v):
    return 0 < len(v) <= 256



INT, STR, BOOL, LIST, DICT = (int,), (str,), (bool,), (list, tuple), (dict,)
FLOAT = (float,)


def checked(schema: dict, values: dict, where: str, rid, sid) -> dict:
    fields = {}
    for name, (types, required, check) in schema.items():
        if name not in values:
            if required:
                raise ProtocolError(E.BAD_FIELD, f"{where}: field '{name}' is required", rid, sid)
            continue
        value = values[name]
        if isinstance(value, bool) and bool not in types:
            value = None  # bool is an int subclass: never accept it as one
        if value is None or not isinstance(value, types) or (check and not check(value)):
            raise ProtocolError(E.BAD_FIELD, f"{where}: field '{name}' has a bad value {values[name]!r:.80}", rid, sid)
        fields[name] = value
    unknown = set(values) - set(schema)
    if unknown:
        raise ProtocolError(E.BAD_FIELD, f"{where}: unknown field(s) {sorted(map(str, unknown))[:8]}", rid, sid)
    return fields


def byte_count(v):
    return 0 <= v < 1 << 48


def per_layer_counts(v):
    return len(v) <= MAX_LAYERS and all(is_int(b) and byte_count(b) for b in v)
