"""Fakes for the unit tests of pure logic (named as such): a clock a test moves by hand,
and the capability a worker would announce (parsed as a READY's is)."""

from __future__ import annotations

from meshnet.net.capability import Capability

N_LAYER = 4


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fake_wire_capability(worker_id: str, start: int, end: int, n_ctx: int = 256, n_batch: int = 64,
                         numerics: str = "invariant") -> dict:
    return {"worker_id": worker_id, "model_sha256": "ab" * 32, "engine_pin": "pin", "backend": "CPU",
            "wire_dtype": "f32", "numerics": numerics, "layers": [start, end], "n_layer": N_LAYER, "n_embd": 8,
            "n_vocab": 32, "arch": "llama", "n_ctx": n_ctx, "n_batch": n_batch, "max_sessions": 4,
            "admitted_bytes": 1 << 20, "data_endpoint": f"tcp://10.0.0.1:{7000 + len(worker_id) * 10 + start}",
            "clock_id": worker_id}


def fake_capability(worker_id: str, start: int, end: int, **options) -> Capability:
    return Capability.parse(fake_wire_capability(worker_id, start, end, **options))
