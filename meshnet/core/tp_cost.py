"""When a tensor-parallel group pays: the per-token time of a group against the whole model.

Pure arithmetic on the model's shape (read from the GGUF) and measured figures. A decoded
token costs a member the read of its share of the weights (decode on a CPU is bound by
memory reads) plus its exchange: at each gather (four a layer, one for the logits) one
message to every other member and one from each, which costs a gather's fixed time (the
link's latency, the member's work and system calls) and its bytes at the rate the link and
the member's sealing take them. Both are measured through the engine's own gather when a
group links (engine/tp_link.py measure). A group pays when that sum is under the whole
model's time; the break-even time of a gather says how slow a link may be before it does not.

    member_ms + gathers x gather_us / 1000 + sent_bytes / bandwidth

Nothing here opens a file or a socket (tests/unit/test_tp_cost.py gives plain numbers;
tools/tp_bench.py and `meshnet plan --tp` feed it measured ones).
"""

from __future__ import annotations

from dataclasses import dataclass

GATHERS_PER_LAYER = 4   # the attention heads' output, its projection, the FFN activation, the FFN output
FLOAT_BYTES = 4
HEADER_BYTES, TAG_BYTES = 32, 16   # before each message's rows, and after them when sealed (engine_c/tp_link.cpp)


@dataclass(frozen=True)
class GroupShape:
    """What a group of MEMBERS exchanges for one decoded token of a model."""

    members: int
    gathers: int          # per token, every member
    sent_bytes: int       # per token, by each member (to all its peers)
    member_share: float   # the part of the whole model's per-token reads a member does


def group_shape(members: int, n_layer: int, n_embd: int, attn_width: int, n_ff: int, n_vocab: int,
                layer_weights: int, output_weights: int, replicated_weights: int = 0, sealed: bool = True) -> GroupShape:
    """The shape of a group over N_LAYER layers: ATTN_WIDTH is the attention heads' output
    width (heads x value length), N_VOCAB the logits' (0 for a group without the output
    layer: no gather for them), LAYER_WEIGHTS the per-token weights of its layers,
    OUTPUT_WEIGHTS the output matrix's, REPLICATED_WEIGHTS those every member reads whole
    (a single KV head's projections); SEALED: rows sealed (a tag each message)."""
    if members < 2:
        raise ValueError("a group has two members at least")
    widths = n_layer * (attn_width + n_embd + n_ff + n_embd) + n_vocab
    gathers = GATHERS_PER_LAYER * n_layer + (1 if n_vocab else 0)
    per_message = HEADER_BYTES + (TAG_BYTES if sealed else 0)
    sent = (members - 1) * (FLOAT_BYTES * widths // members + gathers * per_message)
    whole = layer_weights + output_weights
    share = ((whole - replicated_weights) / members + replicated_weights) / whole if whole else 1 / members
    return GroupShape(members, gathers, sent, share)


@dataclass(frozen=True)
class LinkCost:
    """A group's exchange, as measured: a gather of a few values (microseconds), and bytes a
    member sends per second in a large one."""

    gather_us: float
    bandwidth: float


def exchange_ms(shape: GroupShape, link: LinkCost) -> float:
    """A token's exchange on the link."""
    return shape.gathers * link.gather_us / 1e3 + shape.sent_bytes / link.bandwidth * 1e3


def group_ms(member_ms: float, shape: GroupShape, link: LinkCost) -> float:
    """A token's time for the group, whose members each compute in MEMBER_MS."""
    return member_ms + exchange_ms(shape, link)


def member_ms_from_whole(whole_ms: float, shape: GroupShape) -> float:
    """A member's compute on a host of its own, from the whole model's time on one like it:
    its share of the reads (no other member shares its memory bus)."""
    return whole_ms * shape.member_share


def break_even_gather_us(whole_ms: float, member_ms: float, shape: GroupShape, bandwidth: float) -> float:
    """The time of a small gather at which the group is as slow as the whole model, at that
    bandwidth (negative: it never pays, even on a link with no latency)."""
    room_ms = whole_ms - member_ms - shape.sent_bytes / bandwidth * 1e3
    return room_ms * 1e3 / shape.gathers
