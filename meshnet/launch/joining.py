"""A machine joining a mesh (`meshnet worker --join TOKEN`): the coordinator found (the
token's addresses, or mDNS), the token checked by the coordinator itself, and the model:
the file given, which this worker then serves to the others too, or else the model's
header fetched now and its layers' bytes once the coordinator assigns them, each checked
against the manifest the coordinator vouches for. A worker that joins before any holder
does (or while the coordinator still hashes a holder's copy) waits for one, saying so, for
a bounded time. Without a token nothing tells the coordinator's word from any other host's,
so such a worker fetches no model bytes unless told --insecure."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError
from meshnet.core.planner import format_size
from meshnet.engine import models
from meshnet.net import discovery, join
from meshnet.net.addresses import same_host_any_port
from meshnet.net.security import KeyPair
from meshnet.route.config import MIN_FETCH_RATE
from meshnet.weights.fetch import Fetch, MeshModel, holders_of
from meshnet.weights.holder import Holder
from meshnet.weights.manifest import MAX_FILE_BYTES

DISCOVER_S = 10.0   # how long a worker looks for its coordinator on the LAN
PROBE_S = 3.0       # ... and waits on the addresses a token names, when it names several
ANSWER_S = 15.0     # ... or the one it names
# how long a worker without the file waits for a holder the coordinator vouches for (a
# holder that joins at the same moment, or a coordinator hashing a holder's copy: the wait
# starts again each time that hashing advances, up to a ceiling of this wait and the time
# the file takes to hash at MIN_FETCH_RATE, the pace the coordinator holds a holder to)
HOLDER_WAIT_S = 120.0
HOLDER_POLL_S = 0.5


@dataclass
class Joined:
    coordinator: str
    keys: KeyPair | None
    coordinator_key: bytes | None
    fetch: Fetch | None     # without the model file: what brings its bytes
    holder: Holder | None   # with it: where this worker serves its bytes to the others
    model: tuple | None = None   # (path, sha256) of the model this worker loads: the file, or the fetched one


def ask_first(endpoints, keys: KeyPair | None, coordinator_key: bytes | None):
    """The first of ENDPOINTS whose coordinator answers HOLDERS, and its answer (a token
    names each address of the coordinator's host; some are on networks this machine is
    not on): all asked at once (join.first_answer). A refused token is final."""
    timeout = PROBE_S if len(endpoints) > 1 else ANSWER_S
    return join.first_answer(endpoints, lambda endpoint: holders_of(endpoint, keys, coordinator_key, timeout=timeout))


def join_mesh(token_text: str | None, coordinator: str | None, discover: bool, model: str | None, data_bind: str,
              echo: Callable[[str], None] = print, holder_wait: float = HOLDER_WAIT_S, insecure: bool = False) -> Joined:
    token = join.parse_token(token_text) if token_text is not None else None
    if token is None and model is None and not insecure:
        # a manifest is the coordinator's word on every byte fetched: unauthenticated, any host
        # on the LAN that answers mDNS (or the address) could give its own
        raise MeshnetError(E.FETCH_FAILED, "without a join token this worker cannot tell its coordinator's word on "
                           "the model's bytes from any other host's, and fetches none: give the token (--join, "
                           "MESHNET_JOIN or --join-file), or --model (a copy of the model), or --insecure to fetch "
                           "unauthenticated")
    keys = token.keys if token else None
    coordinator_key = token.coordinator_key if token else None
    if coordinator is not None:
        candidates = [coordinator]
    elif token is not None and token.addresses and not discover:
        candidates = list(token.addresses)
    else:
        found = discovery.find(coordinator_key.decode() if coordinator_key else None, timeout=DISCOVER_S)
        candidates = list(found.endpoints)
        echo(f"meshnet worker: found the coordinator {found.name} on the LAN at {', '.join(candidates)}")
    coordinator, offered = ask_first(candidates, keys, coordinator_key)
    if model is not None:
        path, file_sha256 = models.resolve(model)
        holder = None
        if keys is not None:
            # the mesh's members fetch from it as from the coordinator: the join key admits them
            holder = Holder(path, file_sha256, same_host_any_port(data_bind), keys, {coordinator_key},
                            join_key=lambda: keys.public)
        return Joined(coordinator, keys, coordinator_key, None, holder, (path, file_sha256))

    def ask() -> MeshModel:
        return holders_of(coordinator, keys, coordinator_key)
    offered = wait_for_holders(coordinator, offered, ask, holder_wait, echo)
    manifest = offered.manifest
    fetch = Fetch(manifest, offered.holders, keys, coordinator, refresh=lambda: ask().holders)
    fetch.run(manifest.headers())   # the model's metadata and tensor infos: every split's, as the engine reads them
    echo(f"meshnet worker: model {manifest.filename} ({manifest.sha256[:12]}) from the mesh, {len(offered.holders)} "
         f"holder(s): only the bytes of the layers the coordinator assigns are fetched, into {fetch.path}")
    return Joined(coordinator, keys, coordinator_key, fetch, None, (fetch.path, manifest.sha256))


def wait_for_holders(coordinator: str, offered: MeshModel, ask: Callable[[], MeshModel], wait: float,
                     echo: Callable[[str], None]) -> MeshModel:
    """OFFERED once it names a holder and a manifest the coordinator vouches for, asking again
    (ASK) every HOLDER_POLL_S; FETCH_FAILED, saying why, when none comes within WAIT seconds
    (again from each step of the coordinator's hashing, up to the ceiling it sets)."""
    began = time.monotonic()
    deadline, ceiling = began + wait, None
    said, progress = None, None
    while offered.manifest is None or not offered.holders:
        if offered.checking is not None and ceiling is None:
            ceiling = began + wait + min(max(offered.checking[1], 0), MAX_FILE_BYTES) / MIN_FETCH_RATE
        if offered.checking is not None and offered.checking != progress:
            progress = offered.checking
            deadline = min(time.monotonic() + wait, ceiling)   # the hashing advanced
        if offered.checking is not None:
            saying = (f"meshnet worker: the coordinator is hashing a holder's copy of model {offered.sha256[:12]} "
                      f"before it vouches for its bytes; waiting, at most {ceiling - began:.0f} s in all")
        else:
            saying = (f"meshnet worker: no holder of the model's bytes yet (the coordinator at {coordinator} lists "
                      f"none that answers with bytes it vouches for): waiting up to {wait:.0f} s for one")
        if offered.why:
            saying += f"; the coordinator refused or gave up on: {offered.why}"
        if saying != said:
            echo(saying)
            said = saying
        if time.monotonic() >= deadline:
            why = f" ({offered.why})" if offered.why else ""
            within = (f"within {time.monotonic() - began:.0f} s (a worker waits for the coordinator's hashing at most "
                      f"{wait:.0f} s more than the {format_size(progress[1])} file takes at "
                      f"{MIN_FETCH_RATE / (1 << 20):g} MiB/s)" if deadline == ceiling else f"within {wait:.0f} s")
            raise MeshnetError(E.FETCH_FAILED, f"no holder of the model's bytes that the coordinator at {coordinator} "
                               f"vouches for appeared {within}{why}: give this worker --model (a copy of the model), "
                               "or start the coordinator with --model")
        time.sleep(min(HOLDER_POLL_S, max(0.0, deadline - time.monotonic())))
        offered = ask()
    return offered
