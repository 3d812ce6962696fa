"""What a tensor-parallel group would give on machines like this one: the cost model
(core/tp_cost.py) fed with figures measured here: the whole model's time a token, and the
exchange of a group linked over loopback (the least a real link costs). Printed by
`meshnet plan --tp N` and `meshnet bench`; tools/tp_bench.py checks the model against
measured groups."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zmq

from meshnet.core import tp_cost
from meshnet.engine.gguf_layout import ModelLayout
from meshnet.engine.tp_link import LinkFigures
from meshnet.net.security import KeyPair

# the architectures patches 0019 and 0020 split (llama_model_set_tensor_parallel); the others are refused
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")
# links people put machines on, in bytes a second: at each, the slowest gather that still pays
LINKS = {"1 GbE": 117e6, "2.5 GbE": 294e6, "10 GbE": 1.17e9}


def shape_of(layout: ModelLayout, members: int) -> tp_cost.GroupShape:
    return tp_cost.group_shape(members, layout.n_layer, layout.n_embd, layout.attn_width, layout.n_ff,
                               layout.n_vocab, sum(layout.layer_weights), layout.output_weights)


def loopback_link(members: int = 2) -> LinkFigures:
    """A group of MEMBERS linked over loopback in this process, sealed as always, measured
    by the engine's own gathers (each member on a thread of its own); the slowest member's
    figures."""
    from meshnet.stage.tp_group import GroupLink

    keys = [KeyPair(*zmq.curve_keypair()) for _ in range(members)]
    links = [GroupLink(rank, members, keys[rank]) for rank in range(members)]
    try:
        endpoints = {(low, high): links[low].bind_for(high, peer_public=keys[high].public)
                     for low in range(members) for high in range(low + 1, members)}

        def link(rank: int):
            for low in range(rank):
                links[rank].connect_to(low, endpoints[(low, rank)], keys[low].public)
            return links[rank].measure()

        with ThreadPoolExecutor(members) as pool:
            figures = list(pool.map(link, range(members)))
        return LinkFigures(max(f.gather_us for f in figures), min(f.bandwidth for f in figures))
    finally:
        for each in links:
            each.close()


def whole_model_ms(path: str, n_threads: int | None = None, tokens: int = 8) -> float:
    """The whole model's median time a decoded token here (a short greedy run)."""
    from meshnet.engine.binding import Entry, Stage

    options = {"n_ctx": 256, "max_sessions": 1}
    if n_threads:
        options["n_threads"] = n_threads
    with Stage(path, **options) as stage:
        stage.open_session(1)
        out = stage.forward([Entry(1, 0, tokens=np.arange(1, 9, dtype=np.int32))])
        times = []
        for pos in range(8, 8 + tokens):
            began = time.perf_counter()
            out = stage.forward([Entry(1, pos, tokens=np.array([int(out.token[0])], dtype=np.int32))])
            times.append((time.perf_counter() - began) * 1e3)
    return float(np.median(times))


def estimate(layout: ModelLayout, members: int, whole_ms: float, link: LinkFigures) -> dict:
    """The group on hosts like this one, each member on its own (its own memory bus): its
    exchange, its time a token at the measured link, and the slowest gather that pays at
    common link speeds."""
    shape = shape_of(layout, members)
    member_ms = tp_cost.member_ms_from_whole(whole_ms, shape)
    cost = tp_cost.LinkCost(link.gather_us, link.bandwidth)
    group_ms = tp_cost.group_ms(member_ms, shape, cost)
    return {
        "members": members, "gathers_per_token": shape.gathers, "sent_bytes_per_token": shape.sent_bytes,
        "member_share": shape.member_share, "whole_ms": whole_ms, "member_ms": member_ms,
        "loopback_gather_us": link.gather_us, "loopback_bandwidth": link.bandwidth,
        "group_ms_loopback": group_ms, "speedup_loopback": whole_ms / group_ms,
        "break_even_gather_us": {name: tp_cost.break_even_gather_us(whole_ms, member_ms, shape, rate)
                                 for name, rate in LINKS.items()},
    }


def section(layout: ModelLayout, whole_decode_tok_s: list[float] | None, members: int = 2) -> dict:
    """`meshnet bench`'s tensor-parallel part: the cost model at its measured whole-model
    decode rate, where the model's architecture can be split (else nothing)."""
    if layout.arch not in ARCHITECTURES or not whole_decode_tok_s:
        return {}
    whole_ms = 1e3 / statistics.median(whole_decode_tok_s)
    return {"tensor_parallel": estimate(layout, members, whole_ms, loopback_link(members))}


def describe(e: dict) -> list[str]:
    lines = [f"a tensor-parallel group of {e['members']}: {e['gathers_per_token']} gathers a token, "
             f"{e['sent_bytes_per_token'] / 1e3:.0f} kB sent by each member; each reads "
             f"{e['member_share']:.0%} of the weights a token",
             f"  measured here: the whole model {e['whole_ms']:.1f} ms a token; a gather over loopback "
             f"{e['loopback_gather_us']:.0f} us, {e['loopback_bandwidth'] / 1e6:.0f} MB/s",
             f"  members on hosts like this one, each its own: {e['member_ms']:.1f} ms of compute; at loopback's "
             f"exchange {e['group_ms_loopback']:.1f} ms a token ({e['speedup_loopback']:.2f}x the whole model)"]
    for name, at in e["break_even_gather_us"].items():
        lines.append(f"  over {name}: pays while a gather takes under {at:.0f} us" if at > 0
                     else f"  over {name}: never pays (the rows alone take longer than the compute saved)")
    return lines
