"""What a worker offers in READY, parsed once on receipt into a typed Capability: the
coordinator routes sessions and plans ranges by these numbers, so they are checked as
strictly as a message header, and a missing or mistyped one refuses the worker."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshnet.core import errors as E
from meshnet.core import kv_cache, numerics
from meshnet.core.planner import ModelCost
from meshnet.net.fields import (BOOL, DICT, INT, LIST, MAX_BATCH, MAX_CTX, MAX_EMBD, MAX_LAYERS, MAX_SESSIONS,
                                MAX_VOCAB, STR, ProtocolError, at_most, byte_count, checked, endpoint,
                                layer_range, nonneg, peer_endpoint, per_layer_counts, positive, sha256, short_text, u64)

# the wire form, as fields.checked reads it: (python types, required, extra check or None)
FIELDS: dict[str, tuple] = {
    "worker_id": (STR, True, short_text),       # the same for every connection of one worker process
    "model_sha256": (STR, True, sha256),
    "arch": (STR, True, short_text),
    "layers": (LIST, False, layer_range),       # absent: --layers auto, waiting for the coordinator's plan
    "loading": (LIST, False, layer_range),      # --layers START:END, loading them: offered once loaded
    "n_layer": (INT, True, at_most(MAX_LAYERS)),
    "n_embd": (INT, True, at_most(MAX_EMBD)),
    "n_vocab": (INT, True, at_most(MAX_VOCAB)),
    "engine_pin": (STR, True, short_text),
    "backend": (STR, True, short_text),         # "CPU" or "CUDA": part of the compatibility class
    "device": (STR, False, short_text),         # the processor the layers run on, by name (once it holds layers)
    "wire_dtype": (STR, True, lambda v: v == "f32"),
    "numerics": (STR, True, lambda v: v in numerics.CLASSES),   # part of the compatibility class
    "flash_attn": (BOOL, False, None),          # flash attention: part of the class too
    "kv_type": (STR, False, kv_cache.is_canonical),   # the KV cache's types, absent for f16: the class too
    "max_sessions": (INT, True, at_most(MAX_SESSIONS)),
    "n_ctx": (INT, True, at_most(MAX_CTX)),
    "kv_pool": (INT, False, lambda v: 0 <= v <= MAX_CTX * MAX_SESSIONS),   # cells of its sessions' shared KV pool
    "kv_pool_floor": (INT, False, lambda v: 0 <= v <= MAX_CTX * MAX_SESSIONS),   # ... as small as it may be to fit --mem
    "n_batch": (INT, True, at_most(MAX_BATCH)),
    "admitted_bytes": (INT, True, u64),
    "data_endpoint": (STR, False, endpoint),    # the PULL socket its inputs come to (once it holds layers)
    "mem_bytes": (INT, False, u64),             # the memory it admits (--mem): what the planner may give it
    "cost": (DICT, False, None),                # the model's per-layer bytes (COST_FIELDS), to plan without the file
    "clock_id": (STR, True, short_text),        # host and boot: equal ids share one monotonic clock
    "n_threads": (INT, False, positive),        # the engine's compute threads
    "n_cpus": (INT, False, positive),           # the CPUs this process may run on
    "pid": (INT, False, positive),
    "max_token_bytes": (INT, False, at_most(1 << 16)),   # the head: the longest text one token stands for
    "weights": (STR, False, peer_endpoint),     # it serves its model file's bytes here (weights/holder.py)
    "fetches": (BOOL, False, None),             # it holds no model file: it fetches its range's bytes when assigned
}

# a worker's model, as the planner counts it (planner.ModelCost)
COST_FIELDS: dict[str, tuple] = {
    "n_layer": (INT, True, at_most(MAX_LAYERS)),
    "layer_bytes": (LIST, True, per_layer_counts),
    "input_bytes": (INT, True, byte_count),
    "output_bytes": (INT, True, byte_count),
    "shared_bytes": (INT, True, byte_count),
    "tied_embeddings": (BOOL, True, None),
    "token_embd_bytes": (INT, True, byte_count),
    "kv_bytes_per_cell": (INT, True, byte_count),
    "n_embd": (INT, True, at_most(MAX_EMBD)),
    "n_ff": (INT, True, nonneg),
    "n_head": (INT, True, nonneg),
    "n_vocab": (INT, True, at_most(MAX_VOCAB)),
    # per layer (planner.ModelCost): absent when the worker could not read them
    "layer_kv_bytes": (LIST, False, per_layer_counts),
    "layer_window": (LIST, False, per_layer_counts),
    "layer_state_bytes": (LIST, False, per_layer_counts),
}


def _checked_wire(capability: dict, rid: int | None = None) -> dict:
    """A READY's capability, checked field by field and for consistency: a worker holds
    a range (and serves it on its data endpoint), or waits for one within its memory."""
    fields = checked(FIELDS, capability, "ready: capability", rid, None)
    where = "ready: capability"
    if "layers" in fields and "loading" in fields:
        raise ProtocolError(E.BAD_FIELD, f"{where}: a worker holds its 'layers' or is 'loading' them, not both", rid)
    if "loading" in fields:
        if fields["loading"][1] > fields["n_layer"]:
            raise ProtocolError(E.BAD_FIELD, f"{where}: loading {fields['loading']} is outside a model of "
                                f"{fields['n_layer']} layers", rid)
    elif "layers" in fields:
        if fields["layers"][1] > fields["n_layer"]:
            raise ProtocolError(E.BAD_FIELD, f"{where}: layers {fields['layers']} are outside a model of "
                                f"{fields['n_layer']} layers", rid)
        if "data_endpoint" not in fields:
            raise ProtocolError(E.BAD_FIELD, f"{where}: a worker that holds layers gives its 'data_endpoint'", rid)
    elif "mem_bytes" not in fields or "cost" not in fields:
        raise ProtocolError(E.BAD_FIELD, f"{where}: a worker without layers gives its 'mem_bytes' and the model's "
                            "'cost' to be planned for", rid)
    if "cost" in fields:
        fields["cost"] = checked(COST_FIELDS, fields["cost"], f"{where}: cost", rid, None)
        per_layer = [fields["cost"][k] for k in ("layer_kv_bytes", "layer_window", "layer_state_bytes") if k in fields["cost"]]
        if fields["cost"]["n_layer"] != fields["n_layer"] or len(fields["cost"]["layer_bytes"]) != fields["n_layer"] \
                or any(len(v) != fields["n_layer"] for v in per_layer) or len(per_layer) not in (0, 3):
            raise ProtocolError(E.BAD_FIELD, f"{where}: cost: its layers disagree with n_layer {fields['n_layer']}", rid)
        for name in ("n_embd", "n_vocab"):
            if fields["cost"][name] != fields[name]:
                raise ProtocolError(E.BAD_FIELD, f"{where}: cost: its {name} disagrees with {name} {fields[name]}", rid)
    return fields


@dataclass(frozen=True)
class Capability:
    """A worker's capability as the coordinator reads it. A worker holds a range (layers,
    served on data_endpoint), is loading the range it was started for (loading), or,
    started with --layers auto, waits for one within mem_bytes, announcing the model's
    cost to be planned for."""
    worker_id: str            # the same for every connection of one worker process
    model_sha256: str
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    engine_pin: str
    backend: str              # "CPU" or "CUDA": part of the compatibility class
    wire_dtype: str
    numerics: str             # part of the compatibility class
    max_sessions: int
    n_ctx: int
    n_batch: int
    admitted_bytes: int
    clock_id: str             # host and boot: equal ids share one monotonic clock
    layers: tuple[int, int] | None = None
    device: str | None = None
    data_endpoint: str | None = None
    mem_bytes: int | None = None
    cost: ModelCost | None = None
    n_threads: int | None = None
    n_cpus: int | None = None
    pid: int | None = None
    max_token_bytes: int | None = None
    loading: tuple[int, int] | None = None
    weights: str | None = None
    fetches: bool | None = None
    kv_pool: int = 0
    kv_pool_floor: int = 0
    flash_attn: bool = False  # part of the compatibility class
    kv_type: str = kv_cache.DEFAULT   # so is this

    @classmethod
    def parse(cls, wire: dict, rid: int | None = None) -> "Capability":
        """From a READY's capability map; ProtocolError(bad_field) says what is wrong."""
        fields = _checked_wire(wire, rid)
        for name in ("layers", "loading"):
            if name in fields:
                fields[name] = tuple(fields[name])
        if "cost" in fields:
            fields["cost"] = ModelCost.from_dict(fields["cost"])
        return cls(**fields)

    @property
    def holds_layers(self) -> bool:
        return self.layers is not None

    def to_wire(self) -> dict:
        """The map a worker sends (and `meshnet status` shows): the fields that are set."""
        wire = {k: v for k, v in asdict(self).items() if v is not None and k != "cost"}
        for name in ("kv_pool", "kv_pool_floor", "flash_attn"):
            if not getattr(self, name):
                del wire[name]   # (none: as a worker without one sends it)
        if self.kv_type == kv_cache.DEFAULT:
            del wire["kv_type"]
        for name in ("layers", "loading"):
            if getattr(self, name) is not None:
                wire[name] = list(getattr(self, name))
        if self.cost is not None:
            wire["cost"] = self.cost.to_dict()
        return wire
