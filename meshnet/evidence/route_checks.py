"""The acceptance checks of a running route of worker processes (`meshnet accept`):
parity with the whole model, greedy decode, isolation, cancellation, cleanup, and a
worker killed mid-decode."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from meshnet.core import errors
from meshnet.core import numerics as numerics_classes
from meshnet.core.errors import MeshnetError
from meshnet.evidence.prompts import SHORT
from meshnet.launch.local_cluster import LocalCluster

N_TOKENS = 32
STAGE_LOST_BOUND_S = 3.0


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


class RouteChecks:
    """The checks of a running route of worker processes against the whole model's
    reference runs (tokens and logits per prompt of SHORT)."""

    def __init__(self, cluster: LocalCluster, ranges, reference: dict, metrics: dict):
        self.cluster, self.coordinator, self.ranges = cluster, cluster.coordinator, ranges
        self.reference, self.metrics = reference, metrics

    def parity(self):
        tokens, expected = self.reference[SHORT[0]]
        got = self.coordinator.generate(tokens, N_TOKENS, stop_at_eog=False, want_logits=True).result()
        diff = max_diff(got.logits, expected.logits)
        self.metrics["session"] = got.metrics
        return got.tokens == expected.tokens and diff == 0.0, {
            "tokens_equal": got.tokens == expected.tokens, "max_abs_logit_diff": diff,
            "tokens": got.tokens, "whole_model_tokens": expected.tokens}

    def greedy_decode(self):
        tokens, expected = self.reference[SHORT[1]]
        got = self.coordinator.generate(tokens, N_TOKENS, stop_at_eog=False).result()
        return len(got.tokens) == N_TOKENS and got.tokens == expected.tokens, {
            "generated": len(got.tokens), "decode_tok_s": got.metrics["decode_tok_s"],
            "text": self.coordinator.detokenize(got.tokens)}

    def isolation(self):
        sessions = [self.coordinator.generate(self.reference[p][0], N_TOKENS, stop_at_eog=False) for p in SHORT]
        same = [s.result().tokens == self.reference[p][1].tokens for p, s in zip(SHORT, sessions)]
        return all(same), {"sessions": len(SHORT), "each_equals_alone": same}

    def cancellation(self):
        keep = self.coordinator.generate(self.reference[SHORT[2]][0], N_TOKENS, stop_at_eog=False)
        victim = self.coordinator.generate(self.reference[SHORT[3]][0], 500, stop_at_eog=False)
        for i, _ in enumerate(victim):
            if i == 3:
                break
        t0 = time.monotonic()
        victim.cancel()
        code = None
        try:
            victim.result()
        except MeshnetError as e:
            code = e.code
        cancel_ms = (time.monotonic() - t0) * 1000
        other_ok = keep.result().tokens == self.reference[SHORT[2]][1].tokens
        return code == errors.CANCELLED and other_ok, {"error_code": code, "ms_to_cancelled": cancel_ms,
                                                  "other_session_unchanged": other_ok}

    def cleanup(self):
        deadline = time.monotonic() + 5
        while True:
            stats = self.coordinator.stage_stats()
            clean = all(s["n_sessions"] == 0 and s["kv_bytes_used"] == 0 for s in stats)
            if clean or time.monotonic() > deadline:
                return clean, {"stages": [{k: s[k] for k in ("layers", "n_sessions", "kv_bytes_used", "kv_bytes")}
                                          for s in stats]}
            time.sleep(0.05)

    def kill_worker(self):
        victim_range = self.ranges[-1]
        session = self.coordinator.generate(self.reference[SHORT[0]][0], 500, stop_at_eog=False)
        next(iter(session))
        os.kill(self.cluster.processes[victim_range.as_tuple()].pid, signal.SIGKILL)
        t0 = time.monotonic()
        error = None
        try:
            session.result()
        except MeshnetError as e:
            error = e.to_dict()
        seconds = time.monotonic() - t0
        structured = bool(error) and error.get("code") == errors.STAGE_LOST and \
            error.get("stage") == victim_range.label and "elapsed_ms" in error
        self.cluster.spawn_worker(victim_range)
        self.coordinator.wait_for_route(60, n_stages=len(self.ranges))
        again = self.coordinator.generate(self.reference[SHORT[1]][0], N_TOKENS, stop_at_eog=False).result()
        recovered = again.tokens == self.reference[SHORT[1]][1].tokens
        return structured and seconds <= STAGE_LOST_BOUND_S and recovered, {
            "error": error, "seconds_to_error": seconds, "bound_seconds": STAGE_LOST_BOUND_S,
            "new_session_after_replacement_ok": recovered}


def run_route_checks(checks, route: RouteChecks, numerics: str) -> None:
    """Each check through CHECKS (accept's record of them), those the class does not
    promise recorded as such."""
    checks.run("whole_model_parity", f"2 worker processes vs the whole model in one process: prompt + {N_TOKENS} "
               "greedy tokens, same tokens and max |dlogit| == 0", route.parity)
    checks.run("greedy_decode_32", f"{N_TOKENS}-token greedy decode over the workers", route.greedy_decode)
    if numerics == numerics_classes.STOCK:
        # stock kernels change with the rows in a call: sessions batched together may
        # get other tokens than alone (README, Numerics)
        why = "the stock numerics class does not promise a batched session its tokens alone"
        checks.not_promised("four_session_isolation", "4 concurrent sessions each give the tokens they give "
                            "alone", why)
        checks.not_promised("cancellation", "cancel one session mid-decode: 'cancelled' comes back, the other "
                            "is unchanged", why)
    else:
        checks.run("four_session_isolation", "4 concurrent sessions each give the tokens they give alone",
                   route.isolation)
        checks.run("cancellation", "cancel one session mid-decode: 'cancelled' comes back, the other is "
                   "unchanged", route.cancellation)
    checks.run("cleanup", "every stage's KV back to zero after all sessions ended", route.cleanup)
    checks.run("kill_worker", f"kill -9 of the tail mid-decode: structured stage_lost within {STAGE_LOST_BOUND_S} s; "
               "a replacement restores service", route.kill_worker)
