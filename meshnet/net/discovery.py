"""A coordinator found on the LAN without anyone typing its address: it announces itself by
mDNS/DNS-SD (RFC 6762/6763, through python-zeroconf) and workers browse for it.

Every host on the link reads what an announcement carries, so it carries public data only
(the coordinator's CURVE public key, the protocol version, the model's sha256): the
properties are the caller's, sent as given, never a secret key or a session token."""

from __future__ import annotations

import ipaddress
import queue
import time
from dataclasses import dataclass, field

import ifaddr   # zeroconf's own dependency, and what it lists interfaces with
from zeroconf import (InterfaceChoice, IPVersion, NonUniqueNameException, ServiceBrowser, ServiceInfo,
                      ServiceStateChange, Zeroconf)

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError

SERVICE_TYPE = "_meshnet._tcp.local."
WILDCARDS = ("0.0.0.0", "::")
# a service seen near the end of a browse still gets this long to give its details, so a
# browse ends at most this much past its timeout
RESOLVE_MS = 1000


@dataclass(frozen=True)
class Found:
    name: str
    addresses: tuple[str, ...]
    port: int
    properties: dict[str, str] = field(hash=False)   # a dict: hashing a Found hashes the rest

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(f"tcp://[{a}]:{self.port}" if ":" in a else f"tcp://{a}:{self.port}" for a in self.addresses)


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False   # not an address at all: Announcement says so


def announceable(addresses: list[str]) -> list[str]:
    """ADDRESSES less the loopback ones, which no other host could use: empty when there is
    nothing worth announcing."""
    return [a for a in addresses if not _is_loopback(a)]


def host_addresses(ipv6: bool) -> list[str]:
    """What a coordinator bound to every interface is reached on. IPv6 link-local addresses
    are left out: without their scope, which is this host's own, they reach nothing."""
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4:
                found.append(ip.ip)
            elif ipv6 and not ipaddress.ip_address(ip.ip[0]).is_link_local:
                found.append(ip.ip[0])
    return announceable(list(dict.fromkeys(found)))


def _zeroconf(interfaces, ip_version=None) -> Zeroconf:
    try:
        return Zeroconf(interfaces=interfaces, ip_version=ip_version)
    except (OSError, RuntimeError) as e:   # RuntimeError: no interface of that IP version
        raise MeshnetError(E.UNREACHABLE, f"cannot use multicast DNS on {interfaces}: {e}") from e


class Announcement:
    """NAME (a DNS-SD instance name) at PORT on ADDRESSES, with PROPERTIES in its TXT
    record, on the LAN until closed; only on the interfaces of ADDRESSES, all of them for
    0.0.0.0 or ::."""

    def __init__(self, name: str, port: int, addresses: list[str], properties: dict[str, str]):
        usable = announceable(addresses)
        if not usable:
            raise MeshnetError(E.BAD_ADDRESS, f"{addresses} are loopback addresses only: no other host could reach "
                               "them, so there is nothing to announce on the LAN")
        for address in usable:
            if address not in WILDCARDS:
                try:
                    ipaddress.ip_address(address)
                except ValueError:
                    raise MeshnetError(E.BAD_ADDRESS, f"{address!r} is not an IP address to announce") from None
        if "::" in usable:
            interfaces, ip_version, advertised = InterfaceChoice.All, IPVersion.All, host_addresses(ipv6=True)
        elif "0.0.0.0" in usable:
            interfaces, ip_version, advertised = InterfaceChoice.All, IPVersion.V4Only, host_addresses(ipv6=False)
        else:
            interfaces, ip_version, advertised = usable, None, usable   # zeroconf tells v4 from v6 itself
        if not advertised:
            raise MeshnetError(E.BAD_ADDRESS, f"this host has no address but loopback ones to announce for {addresses}")
        self.info = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port, properties=dict(properties),
                                parsed_addresses=advertised)
        self._zc = _zeroconf(interfaces, ip_version)
        try:
            self._zc.register_service(self.info)
        except NonUniqueNameException:
            self._zc.close()
            raise MeshnetError(E.ADDRESS_IN_USE, f"another host on the LAN already announces {name!r}: "
                               "give this one another name") from None
        except BaseException:
            self._zc.close()
            raise

    def close(self) -> None:
        if self._zc is None:
            return
        zc, self._zc = self._zc, None
        try:
            zc.unregister_service(self.info)   # goodbye: browsers forget it now, not at its TTL
        finally:
            zc.close()

    def __enter__(self) -> Announcement:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _found(info: ServiceInfo) -> Found:
    suffix = "." + SERVICE_TYPE
    name = info.name[:-len(suffix)] if info.name.endswith(suffix) else info.name
    # a key without a value (a DNS-SD boolean attribute) reads as ""
    properties = {k: v or "" for k, v in info.decoded_properties.items()}
    return Found(name, tuple(info.parsed_addresses()), info.port, properties)


def _sightings(timeout: float, interfaces: list[str] | None):
    """Each service seen within TIMEOUT s, as soon as its details are known (again when they
    change)."""
    names: queue.Queue[str] = queue.Queue()

    def seen(zeroconf, service_type, name, state_change):
        if state_change is not ServiceStateChange.Removed:
            names.put(name)   # resolved below: zeroconf's own thread must not block

    zc = _zeroconf(interfaces if interfaces else InterfaceChoice.All)
    browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[seen])
    try:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                name = names.get(timeout=left)
            except queue.Empty:
                break
            info = zc.get_service_info(SERVICE_TYPE, name, timeout=RESOLVE_MS)
            if info is not None and info.port is not None:   # gone meanwhile, or never answered
                yield _found(info)
    finally:
        browser.cancel()
        zc.close()


def browse(timeout: float = 3.0, interfaces: list[str] | None = None) -> list[Found]:
    """Every meshnet service that announced itself within TIMEOUT s, by name (on every
    interface, or those of the addresses INTERFACES)."""
    latest = {found.name: found for found in _sightings(timeout, interfaces)}
    return [latest[name] for name in sorted(latest)]


def find(public_key: str | None, timeout: float = 5.0, interfaces: list[str] | None = None) -> Found:
    """The coordinator whose CURVE public key (properties["key"]) is PUBLIC_KEY, as soon as
    it is seen; with None, the only one seen within TIMEOUT s."""
    seen: dict[str, Found] = {}
    sightings = _sightings(timeout, interfaces)
    try:
        for found in sightings:
            if public_key is not None and found.properties.get("key") == public_key:
                return found
            seen[found.name] = found
    finally:
        sightings.close()   # stops browsing now, not whenever the generator is collected
    others = ", ".join(f"{f.name} ({' '.join(f.endpoints)})" for _, f in sorted(seen.items()))
    if public_key is None and len({f.properties.get("key") for f in seen.values()}) == 1:
        return seen[min(seen)]
    if public_key is None and seen:
        raise MeshnetError(E.BAD_ADDRESS, f"several meshnet coordinators announced themselves on the LAN: {others}: "
                           "give the address or the public key of one")
    which = "meshnet coordinator" if public_key is None else f"meshnet coordinator with public key {public_key}"
    also = f" (other coordinators were seen: {others})" if seen else ""
    raise MeshnetError(E.UNREACHABLE, f"no {which} announced itself on the LAN within {timeout:g} s{also}: give its "
                       "address, or check that multicast (UDP 5353) passes between the hosts")
