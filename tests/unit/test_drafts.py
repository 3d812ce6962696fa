"""The n-gram proposer as pure logic: plain token lists in, drafts out."""

from meshnet.core.drafts import PROBE_EVERY, NgramProposer, best_length


def test_it_drafts_what_followed_the_latest_earlier_occurrence_of_the_last_tokens():
    proposer = NgramProposer(max_drafts=4, kept_weight=100.0)   # drafts kept so far: as many as it may
    passage = list(range(1, 13))
    proposer.extend(passage + [40, 41, 1, 2] + passage)    # 12 tokens matched: a likely continuation
    assert proposer.propose(8) == [40, 41, 1, 2]
    assert proposer.propose(2) == [40, 41]          # no more than the caller can use


def test_a_longer_match_drafts_more_and_the_rate_kept_lately_holds_its_odds_down():
    short = NgramProposer(max_drafts=8, kept_weight=100.0)
    short.extend([7, 1, 2, 3, 4, 5, 6, 8, 2, 3])          # [2, 3] matched, [8, 2, 3] not
    long = NgramProposer(max_drafts=8, kept_weight=100.0)
    long.extend(list(range(20)) + [1, 2, 3, 4, 5, 6] + list(range(20)))
    assert 0 < len(short.propose(8)) < len(long.propose(8)) == 8
    doubted = NgramProposer(max_drafts=8, kept_weight=1.0, refused_weight=3.0)   # 1 in 4 kept lately
    doubted.extend(list(range(20)) + [1, 2, 3, 4, 5, 6] + list(range(20)))
    assert doubted.odds(20) == 0.25 + 0.25 and len(doubted.propose(8)) < 8


def test_the_longest_matching_suffix_wins_and_a_period_repeats_past_the_end():
    proposer = NgramProposer(max_drafts=6)
    proposer.extend([1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3])   # [2, 3] last came before 7, [1, 2, 3] before 9
    assert proposer.propose(1) == [9]
    periodic = NgramProposer(max_drafts=5, kept_weight=100.0)
    periodic.extend([4, 5] * 8 + [4])
    assert periodic.propose(5) == [5, 4, 5, 4, 5]


def test_nothing_to_match_drafts_nothing():
    proposer = NgramProposer(max_drafts=4)
    proposer.extend([1, 2, 3, 4, 5])
    assert proposer.propose(4) == []


def test_the_draft_length_is_what_pays_best_at_the_rate_drafts_were_kept():
    assert best_length(0.95, 8) == 8 and best_length(0.7, 8) == 2 and best_length(0.3, 8) == 0
    proposer = NgramProposer(max_drafts=8)
    start = proposer.length
    for _ in range(6):
        proposer.kept(proposer.length, proposer.length)    # every draft kept: more each round
    assert proposer.length == 8 > start
    refused = NgramProposer(max_drafts=8)
    for _ in range(6):
        refused.kept(max(refused.length, 1), 0)            # the first refused, round after round
    assert refused.length == 0


def test_a_proposer_that_stopped_drafting_tries_one_draft_again_now_and_then():
    proposer = NgramProposer(max_drafts=8, kept_weight=0.0, refused_weight=5.0)
    proposer.extend([1, 2, 3, 1, 2])
    offered = [proposer.propose(8) for _ in range(PROBE_EVERY)]
    assert offered[:-1] == [[]] * (PROBE_EVERY - 1) and offered[-1] == [3]
    proposer.kept(1, 1)
    proposer.kept(0, 0)                                   # a round with no drafts says nothing
    assert proposer.kept_weight == 1.0 and proposer.idle == 0


def test_the_table_asks_the_head_to_draft_from_the_prompt_and_counts_each_round():
    from meshnet.core.generation import Generation, StopRule
    from meshnet.net import protocol as P
    from meshnet.route.events import Done, Request

    from test_sessions import Mesh, caller, of

    mesh = Mesh()
    mesh.add("head", 0, 2), mesh.add("tail", 2, 4)
    mesh.table.speculate = 4
    prompt = list(range(12))
    opens = of(mesh.table.open(1, Generation(prompt, StopRule(5), 64, tail_feeds_head=True), want_logits=False), Request)
    assert [o.fields["speculate"] for o in opens] == [4, 4]
    assert opens[0].fields["history"] == prompt and opens[1].fields["history"] is None
    mesh.table.opened(1, drafts=4)
    mesh.table.opened(1)
    key = mesh.key()

    def token(pos, t, **counts):
        return mesh.table.token(P.Message(P.TOKEN, 0, {"sid": 1, "key": key, "pos": pos, "n": 1, "token": t,
                                                       "eog": False, **counts}))
    token(11, 100)                            # the prefill's token
    token(12, 101, drafted=3, accepted=2)     # a round of 3 drafts that kept 2: three tokens
    token(13, 102)
    token(14, 103)
    done = [e for e in caller(token(15, 104, drafted=2, accepted=0)) if isinstance(e, Done)]
    spec = done[0].metrics["speculation"]
    assert (spec["rounds"], spec["drafted"], spec["accepted"]) == (2, 5, 2)
    assert spec["acceptance_rate"] == 0.4 and spec["tokens_per_round"] == 2.0
    assert mesh.table.counters["speculation_accepted"] == 2


def test_a_session_that_ships_its_logits_or_runs_the_stock_class_decodes_a_token_at_a_time():
    from meshnet.core.generation import Generation, StopRule
    from meshnet.route.events import Request

    from test_sessions import Mesh, of

    for numerics, want_logits in (("invariant", True), ("stock", False)):
        mesh = Mesh()
        mesh.add("head", 0, 2, numerics=numerics), mesh.add("tail", 2, 4, numerics=numerics)
        mesh.table.speculate = 4
        opens = of(mesh.table.open(1, Generation(list(range(12)), StopRule(5), 64, tail_feeds_head=True),
                                   want_logits=want_logits), Request)
        assert all(o.fields.get("speculate") is None for o in opens)


def test_the_speculate_option_reads_ngram_a_count_or_off_and_says_what_else_it_takes():
    import pytest

    from meshnet.core.drafts import NGRAM_DRAFTS, parse_speculate
    from meshnet.core.errors import MeshnetError

    assert parse_speculate("off") == 0 and parse_speculate("ngram") == NGRAM_DRAFTS and parse_speculate("ngram:3") == 3
    for bad in ("ngram:0", "ngram:x", "lookahead", "draft:qwen"):
        with pytest.raises(MeshnetError) as refused:
            parse_speculate(bad)
        assert "--speculate" in refused.value.message


def test_the_price_of_a_drafted_row_is_learnt_from_the_rounds_timed():
    from meshnet.core.drafts import ROW_COST

    proposer = NgramProposer(max_drafts=8)
    assert proposer.row_cost == ROW_COST                  # nothing timed yet
    for _ in range(4):
        proposer.timed(2, 0.030)
    assert proposer.row_cost == ROW_COST                  # one length only: no slope to see
    for k in (0, 1, 2, 3, 4) * 4:                         # a slow link: 25 ms a round, 2 ms a row
        proposer.timed(k, 0.025 + 0.002 * k)
    assert abs(proposer.row_cost - 0.08) < 0.01
    fast = NgramProposer(max_drafts=8, kept_weight=3.5, refused_weight=1.0)
    for k in (0, 1, 2, 3, 4) * 4:                         # loopback: 20 ms a round, 6 ms a row
        fast.timed(k, 0.020 + 0.006 * k)
    assert fast.length < NgramProposer(max_drafts=8, kept_weight=3.5, refused_weight=1.0,
                                       _timed=proposer._timed).length


def test_the_price_is_learnt_from_prose_s_rounds_of_one_draft_or_none():
    # text that does not repeat drafts one token a round in a few: enough spread to see that
    # a row costs 0.6 of a round here (loopback, one thread a stage), above the start's guess
    from meshnet.core.drafts import ROW_COST

    proposer = NgramProposer(max_drafts=8)
    proposer.timed(1, 0.024)
    assert proposer.row_cost == ROW_COST                  # one round: no spread yet
    for k in (0, 0, 0, 1) * 5:
        proposer.timed(k, 0.015 + 0.009 * k)
    assert abs(proposer.row_cost - 0.6) < 0.01
