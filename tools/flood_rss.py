#!/usr/bin/env python3
"""RSS of a coordinator before, during and after one peer's huge multipart messages.

A peer process sends one message of N frames of M MiB each (the per-frame limit of
zmq's MAXMSGSIZE does not bound how many frames a message has). The coordinator's RSS
is sampled from /proc while it happens; it must answer `oversized` (or drop a peer whose
frame is past MAXMSGSIZE) and come back to where it was.

    python tools/flood_rss.py                 # 8 x 128 MiB (the probe's 1 GiB), then 16 x 30 MiB
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import zmq

from meshnet.core.metrics import rss_bytes
from meshnet.net import protocol as P
from meshnet.route.coordinator import Coordinator

MIB = 1 << 20


def flood(endpoint: str, frames: int, frame_mib: int, answers) -> None:
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(endpoint)
    blob = b"\1" * (frame_mib * MIB)
    peer.send_multipart([P.encode(P.HEARTBEAT, 1)[0], *[blob] * frames], copy=False)
    answer = P.decode(peer.recv_multipart(), 1 << 20) if peer.poll(20_000) else None
    answers.put(None if answer is None else (answer.type, answer.get("code")))
    peer.close()
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floods", default="8x128,16x30", help="comma-separated FRAMESxMIB")
    args = parser.parse_args()
    with Coordinator() as coordinator:
        print(f"coordinator max payload {coordinator.config.max_payload // MIB} MiB, "
              f"per-frame cap (MAXMSGSIZE) {2 * coordinator.config.max_payload // MIB} MiB")
        for spec in args.floods.split(","):
            frames, frame_mib = (int(x) for x in spec.split("x"))
            before = rss_bytes()
            peak, stop = [before], threading.Event()

            def sample():
                while not stop.is_set():
                    peak[0] = max(peak[0], rss_bytes())
                    time.sleep(0.005)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            answers = multiprocessing.Queue()
            sender = multiprocessing.Process(target=flood, args=(coordinator.endpoint, frames, frame_mib, answers))
            sender.start()
            answer = answers.get(timeout=60)
            sender.join(60)
            time.sleep(0.5)
            stop.set()
            sampler.join()
            after = rss_bytes()
            print(f"{frames} x {frame_mib} MiB = {frames * frame_mib} MiB: answer {answer or 'none (peer dropped)'}; "
                  f"RSS before {before / MIB:.0f} MiB, peak {peak[0] / MIB:.0f} MiB, after {after / MIB:.0f} MiB; "
                  f"loop alive {coordinator.alive()}")


if __name__ == "__main__":
    main()
