"""What a fetch of weights over the mesh costs on this machine, on loopback: a holder and a
fetcher of the whole model in one process, with and without CURVE, for a few request sizes
and windows (medians of 3), and the sha256 rate every fetched byte pays. The figures that
bound the fetch on a link faster than these (tools/netns-join.sh times it against a plain
TCP copy).
    python tools/fetch_bench.py [MODEL]        default: smollm2"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time

import meshnet.weights.fetch as fetch
from meshnet.core.layers import LayerRange
from meshnet.engine import models
from meshnet.net import join
from meshnet.weights.holder import Holder


def main(argv: list[str]) -> int:
    path, sha256 = models.resolve(argv[0] if argv else None)
    with tempfile.TemporaryDirectory(prefix="meshnet-fetch-bench-") as tmp:
        coordinator = join.coordinator_keys(os.path.join(tmp, "keys"))
        joining = join.JoinKey(os.path.join(tmp, "keys"))
        keys = join.make_token([], coordinator, joining.pair()).keys
        for curve in (True, False):
            with Holder(path, sha256, "tcp://127.0.0.1:0", coordinator if curve else None,
                        join_key=joining.public) as holder:
                spans = holder.manifest.spans_for(LayerRange(0, holder.manifest.n_layer))
                for chunk, window in ((1 << 20, 8), (4 << 20, 4), (4 << 20, 8)):
                    fetch.CHUNK, fetch.WINDOW = chunk, window
                    rates = []
                    for i in range(3):
                        f = fetch.Fetch(holder.manifest, [fetch.HolderAddress(holder.endpoint, coordinator.public
                                                                              if curve else None)],
                                        keys if curve else None, path=os.path.join(tmp, f"copy-{curve}-{chunk}-{window}-{i}", path.name))
                        began = time.perf_counter()
                        f.run(spans)
                        rates.append(f.fetched_bytes / (time.perf_counter() - began) / 1e6)
                    print(f"curve={curve} chunk={chunk >> 20}MiB window={window}: median "
                          f"{statistics.median(rates):.0f} MB/s", flush=True)
    block = bytes(100 << 20)
    rates = []
    for _ in range(3):
        began = time.perf_counter()
        hashlib.sha256(block).hexdigest()
        rates.append(len(block) / (time.perf_counter() - began) / 1e6)
    print(f"sha256 of 100 MiB, one core: {statistics.median(rates):.0f} MB/s (median of 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
