"""The machine others join: what runs beside a coordinator that workers on other machines
connect to (`meshnet coordinator`, `meshnet serve --coordinator`). Its CURVE keys and the
join key (net/join.py), the holder of the model's bytes (weights/holder.py), the LAN
announcement (net/discovery.py), and the join token and line it prints."""

from __future__ import annotations

import functools
import logging
import os
import socket
from pathlib import Path

from meshnet.net import discovery, join, protocol
from meshnet.net.addresses import same_host_any_port
from meshnet.net.security import KeyPair, is_loopback
from meshnet.weights.holder import Holder
from meshnet.weights.vouch import Voucher

log = logging.getLogger("meshnet.launch.mesh_host")

WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def announce_by_default() -> bool:
    """MESHNET_ANNOUNCE=0 turns the LAN announcement off unless a command asks for it: the
    test suite sets it, so that only tests in network namespaces of their own multicast."""
    return os.environ.get("MESHNET_ANNOUNCE", "1") != "0"


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.partition("://")[2].rpartition(":")
    return host.strip("[]"), int(port)


def reachable_addresses(endpoint: str) -> list[str]:
    """The control endpoints a worker elsewhere can reach for one bound here: the bound
    address itself, or for a wildcard every address of this host's interfaces."""
    host, port = _host_port(endpoint)
    if host not in WILDCARD_HOSTS:
        return [endpoint]
    hosts = discovery.host_addresses(ipv6=False) or ["127.0.0.1"]
    return [f"tcp://{h}:{port}" for h in hosts]


class MeshHost:
    """Keys, the model's holder and the announcement of a coordinator bound at BIND.
    Built before the coordinator (its config takes `coordinator_options`), told the
    coordinator's endpoint once it listens (`started`), closed after it."""

    def __init__(self, bind: str, *, keys: KeyPair | None = None, secure: bool = True,
                 model: tuple[Path, str] | None = None, keys_dir: Path | None = None):
        self.secure = secure
        self.join_key = join.JoinKey(keys_dir) if secure else None
        self.keys = (keys or join.coordinator_keys(keys_dir)) if secure else None
        self.holder: Holder | None = None
        self.announcement: discovery.Announcement | None = None
        self.endpoint: str | None = None
        if model is not None:
            path, sha256 = model
            # the coordinator's own key gets in too: it asks its holder whether it still answers
            self.holder = Holder(path, sha256, same_host_any_port(bind), self.keys,
                                 {self.keys.public} if self.keys else frozenset(),
                                 join_key=self.join_key.public if self.join_key else None)
            self.model_sha256 = sha256
        else:
            self.model_sha256 = None

    def coordinator_options(self, allowed: set[bytes] | None = None) -> dict:
        options = {}
        if self.secure:
            options.update(keys=self.keys, allowed_workers=frozenset(allowed or ()), join_key=self.join_key.public)
        # the coordinator's answer to HOLDERS: this host's holder, when it has the file, and
        # every worker that joined with it
        own = (self.holder.endpoint, self.holder.public_key) if self.holder is not None else None
        options["holders"] = functools.partial(Voucher, options.get("keys"), self.model_sha256 if own else None, own)
        return options

    def started(self, endpoint: str, announce: bool = True) -> None:
        """The coordinator listens at ENDPOINT: announce it on the LAN where a LAN can reach it."""
        self.endpoint = endpoint
        host, port = _host_port(endpoint)
        if not announce or is_loopback(endpoint):
            return
        addresses = discovery.announceable([host if host not in WILDCARD_HOSTS else "0.0.0.0"])
        if not addresses:
            return
        properties = {"key": self.keys.public.decode() if self.keys else "", "v": str(protocol.VERSION),
                      "model": self.model_sha256 or ""}
        try:
            self.announcement = discovery.Announcement(f"meshnet-{socket.gethostname()}-{port}", port, addresses,
                                                       properties)
        except Exception as e:   # discovery is a convenience: the token's addresses still work
            log.warning("not announced on the LAN: %s", e)

    def token(self, with_addresses: bool = True) -> join.Token | None:
        if not self.secure or self.endpoint is None:
            return None
        addresses = reachable_addresses(self.endpoint) if with_addresses else []
        return join.make_token(addresses, self.keys, self.join_key.pair())

    def join_line(self, mem: str = "8G") -> str | None:
        token = self.token()
        return join.join_line(token, mem) if token is not None else None

    def close(self) -> None:
        if self.announcement is not None:
            self.announcement.close()
            self.announcement = None
        if self.holder is not None:
            self.holder.close()
            self.holder = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
