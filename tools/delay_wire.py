#!/usr/bin/env python3
"""A wire with a fixed one-way delay between two TAP devices: every Ethernet frame sent
into one comes out of the other DELAY later, in the order it went in, each direction on
its own (so a ping's round trip takes 2 x DELAY more). It stands in for netem (`tc qdisc
... netem delay`), which some kernels, the CI's among them, do not have.

    delay_wire.py --delay 2ms TAP_A TAP_B

It creates both devices in the current network namespace and prints one line,
`ready TAP_A TAP_B delay_us=N`, once they exist; move them with `ip link set TAP netns
NS`, the open file descriptors go on forwarding. The devices vanish when this process
ends (SIGTERM, Ctrl-C). DELAY takes a unit: 2ms, 500us, 0.01s (or 0). Exit status 2:
a bad DELAY; 77: no TAP devices can be made here."""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import os
import re
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000       # bare Ethernet frames, no packet-information prefix
MAX_FRAME = 65536
READ_BATCH = 64          # frames taken from one side before the other gets a turn
MAX_IN_FLIGHT = 10_000   # frames per direction on the wire; beyond that it drops, as a full link would
UNITS_US = {"s": 1_000_000, "ms": 1000, "us": 1}


def parse_delay(text: str) -> int:
    """'2ms' -> 2000 (microseconds). A unit is required: a bare number would be a guess
    between netem's units and ours."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(s|ms|us)?\s*", text)
    if match is None or (match[2] is None and float(match[1]) != 0):
        raise ValueError(f"DELAY {text!r} is not a delay such as 2ms, 500us or 0.01s")
    return round(float(match[1]) * UNITS_US[match[2] or "us"])


def open_tap(name: str) -> int:
    if not 0 < len(name.encode()) < 16:   # the kernel's IFNAMSIZ, its NUL included
        raise OSError(errno.EINVAL, f"{name!r} is not a network interface name (1 to 15 bytes)")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def forward(a: int, b: int, delay_s: float) -> None:
    # one FIFO per outgoing side: a constant delay keeps the release times in arrival
    # order, so the head of each queue is always the next frame due
    outgoing = {a: collections.deque(), b: collections.deque()}
    peer = {a: b, b: a}
    while True:
        now = time.monotonic()
        for fd, queue in outgoing.items():
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                try:
                    os.write(fd, frame)
                except OSError:
                    pass  # the device is down or full: the frame is lost, as on a wire
        due = [queue[0][0] for queue in outgoing.values() if queue]
        timeout = max(0.0, min(due) - now) if due else None
        readable, _, _ = select.select([a, b], [], [], timeout)
        arrived = time.monotonic()
        for fd in readable:
            queue = outgoing[peer[fd]]
            for _ in range(READ_BATCH):
                try:
                    frame = os.read(fd, MAX_FRAME)
                except OSError as e:
                    if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                        break
                    raise
                if len(queue) < MAX_IN_FLIGHT:
                    queue.append((arrived + delay_s, frame))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", required=True, help="one-way delay, each direction: 2ms, 500us, 0.01s")
    parser.add_argument("tap_a")
    parser.add_argument("tap_b")
    args = parser.parse_args(argv)
    try:
        delay_us = parse_delay(args.delay)
    except ValueError as e:
        print(f"delay_wire: {e}", file=sys.stderr)
        return 2
    try:
        a = open_tap(args.tap_a)
        b = open_tap(args.tap_b)
    except OSError as e:
        print(f"delay_wire: cannot create TAP devices {args.tap_a}, {args.tap_b}: {e.strerror}", file=sys.stderr)
        return 77   # as tools/netns-two-host.sh says "cannot be done here"
    print(f"ready {args.tap_a} {args.tap_b} delay_us={delay_us}", flush=True)
    try:
        forward(a, b, delay_us / 1e6)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
