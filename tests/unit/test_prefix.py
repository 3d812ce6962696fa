"""Prefix reuse as pure logic: the chain keys of token blocks, a stage's byte-capped LRU
store of ended sessions' memory (plain bytes stand for the engine's), a generation that
starts after a cached prefix, and the coordinator's table choosing the prefix every stage
of a route holds (fake capabilities, named as such: no socket, process or engine)."""

from __future__ import annotations

import pytest

from meshnet.core.generation import FeedHead, Generation, StopRule
from meshnet.core.prefix import BLOCK, block_keys, reusable_keys
from meshnet.engine.binding import LayerMemory
from meshnet.route.events import Request
from meshnet.route.requests import RequestKind
from meshnet.route.tracker import compat_class_of
from meshnet.stage.prefix_store import PrefixStore, store_capacity, store_refusal

from test_sessions import Mesh, of, pushed

SALT = "class-a"


def test_a_block_s_key_names_every_token_before_it_and_the_class():
    a = list(range(100))
    b = a[:40] + [999] + a[41:]          # differs in block 2
    keys_a, keys_b = block_keys(a, SALT), block_keys(b, SALT)
    assert len(keys_a) == 100 // BLOCK
    assert keys_a[:2] == keys_b[:2] and all(x != y for x, y in zip(keys_a[2:], keys_b[2:]))
    assert block_keys(a, "class-b")[0] != keys_a[0]   # another model or numerics class shares nothing
    assert block_keys(a[:BLOCK - 1], SALT) == []


def test_a_new_session_may_reuse_all_but_its_last_prompt_token():
    prompt = list(range(2 * BLOCK))
    assert len(reusable_keys(prompt, SALT)) == 1          # the block ending at the last token must be fed
    assert len(reusable_keys(prompt + [7], SALT)) == 2


def memory(n: int) -> bytes:
    return bytes(n)


def test_the_store_finds_the_longest_prefix_it_holds():
    store = PrefixStore(1 << 20)
    tokens = list(range(5 * BLOCK))
    keys = block_keys(tokens, SALT)
    assert store.put(keys[:3], memory(300))
    assert store.find(keys) == (store.find(keys[:3])[0], 3)                   # 3 of the 5 blocks
    stored, n_blocks = store.find(keys[:2])
    assert n_blocks == 2 and stored.n_tokens == 3 * BLOCK                      # cut back from 3 blocks
    assert store.find(block_keys(list(range(1, 80)), SALT)) is None            # another start
    assert store.counters["hits"] == 3 and store.counters["misses"] == 1


def test_the_store_drops_the_least_recently_used_past_its_cap_and_counts_it():
    store = PrefixStore(1000)
    keys = [block_keys([s] * BLOCK, SALT) for s in range(3)]
    store.put(keys[0], memory(400))
    store.put(keys[1], memory(400))
    store.find(keys[0])                        # used: keys[1] is now the oldest
    store.put(keys[2], memory(400))
    assert store.find(keys[1]) is None and store.find(keys[0]) and store.find(keys[2])
    assert store.bytes == 800 and store.counters["evictions"] == 1
    assert not store.put(keys[1], memory(1001)) and store.counters["too_large"] == 1


def test_a_longer_session_replaces_the_entry_it_extends_and_a_shorter_one_only_refreshes():
    store = PrefixStore(1 << 20)
    keys = block_keys(list(range(4 * BLOCK)), SALT)
    store.put(keys[:2], memory(200))
    store.put(keys, memory(400))
    assert len(store) == 1 and store.bytes == 400 and store.counters["superseded"] == 1
    assert store.refresh(keys[:3]) and store.put(keys[:1], memory(100)) and store.bytes == 400


def test_a_stage_keeps_a_store_only_where_a_restored_prefix_gives_the_same_tokens():
    attention, recurrent = LayerMemory(1024, 0, 0), LayerMemory(0, 0, 4096)
    assert store_refusal(64, "invariant", [attention, attention]) is None
    assert store_refusal(0, "invariant", [attention]) == "--prefix-cache 0"
    assert "stock numerics class" in store_refusal(64, "stock", [attention])
    assert "recurrent state" in store_refusal(64, "invariant", [attention, recurrent])


def test_within_mem_the_store_gets_what_the_stage_leaves_of_it():
    from meshnet.core.planner import OVERHEAD

    assert store_capacity(256, None, 1 << 30) == 256 << 20
    assert store_capacity(256, (300 << 20) + OVERHEAD, 200 << 20) == 100 << 20
    assert store_capacity(256, 100 << 20, 200 << 20) == 0


def test_a_generation_fed_from_a_cached_prefix_feeds_only_the_rest():
    gen = Generation(list(range(40)), StopRule(4), chunk=16)
    assert gen.opened(cached=32) == [FeedHead(32, tuple(range(32, 40)), prompt=True)]
    assert gen.cached == 32 and gen.metrics([(0, 4)], 0)["cached_tokens"] == 32
    with pytest.raises(Exception):
        Generation([1, 2], StopRule(1), chunk=4).opened(cached=2)   # the last prompt token is always fed


@pytest.fixture
def mesh():
    m = Mesh()
    m.head, m.tail = m.add("head", 0, 2), m.add("tail", 2, 4)
    return m


PROMPT = tuple(range(3 * BLOCK + 5))


def test_the_route_starts_from_the_shortest_prefix_its_stages_restored(mesh):
    effects = mesh.table.open(1, Generation(list(PROMPT), StopRule(2), 64, tail_feeds_head=True), want_logits=False)
    prefixes = [e.fields["prefix"] for e in of(effects, Request)]
    assert prefixes[0] == prefixes[1] and len(prefixes[0]) == 3     # the prompt's whole blocks, to both stages
    assert mesh.table.opened(1, cached=3 * BLOCK) == []
    first = mesh.table.opened(1, cached=BLOCK)                      # the tail holds one block only
    assert pushed(first) == [(BLOCK, list(PROMPT[BLOCK:]))]
    assert mesh.table.counters["prefix_hits"] == 1 and mesh.table.counters["prefix_hit_tokens"] == BLOCK


def test_a_stage_without_the_prefix_makes_it_a_full_prefill(mesh):
    mesh.table.open(1, Generation(list(PROMPT), StopRule(2), 64, tail_feeds_head=True), want_logits=False)
    mesh.table.opened(1, cached=2 * BLOCK)
    assert pushed(mesh.table.opened(1, cached=0)) == [(0, list(PROMPT))]
    assert mesh.table.counters["prefix_misses"] == 1


def test_a_completed_session_asks_its_stages_to_keep_the_blocks_of_the_tokens_it_fed_and_a_failed_one_does_not(mesh):
    mesh.table.open(1, Generation(list(PROMPT), StopRule(2), 64, tail_feeds_head=True), want_logits=False)
    mesh.confirm()
    mesh.token(0, len(PROMPT), 100)
    effects = mesh.token(len(PROMPT), 1, 101)
    keep = [e.fields.get("keep") for e in of(effects, Request) if e.kind is RequestKind.RELEASE]
    assert keep[0] == keep[1] == block_keys(list(PROMPT) + [100], f"{compat_class_of(mesh.head.capability)}\0")
    mesh.table.open(2, Generation(list(PROMPT), StopRule(2), 64, tail_feeds_head=True), want_logits=False)
    mesh.confirm(2)
    effects = mesh.table.cancel(2)
    assert all("keep" not in e.fields for e in of(effects, Request))


def test_sessions_of_other_scopes_name_the_same_prompt_by_other_keys(mesh):
    def named(sid, scope):
        effects = mesh.table.open(sid, Generation(list(PROMPT), StopRule(2), 64, tail_feeds_head=True),
                                  want_logits=False, scope=scope)
        return next(e.fields["prefix"] for e in of(effects, Request))
    alice = named(1, "alice")
    assert len(alice) == 3 and named(2, "alice") == alice   # one client's sessions find what it kept
    assert not set(named(3, "mallory")) & set(alice)          # another's never do, not even the first block
    assert not set(named(4, "")) & set(alice)


def test_the_stock_class_reuses_no_prefix():
    m = Mesh()
    m.add("head", 0, 2, numerics="stock"), m.add("tail", 2, 4, numerics="stock")
    effects = m.table.open(1, Generation(list(PROMPT), StopRule(2), 64, tail_feeds_head=True), want_logits=False)
    assert all(e.fields.get("prefix") is None for e in of(effects, Request))
