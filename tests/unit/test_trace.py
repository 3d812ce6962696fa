"""The per-token timeline's table (core/trace.py), from spans written as plain data."""

from meshnet.core import trace

US = 1000   # ns


def stage(where, tokens, offset_us, forward_us, pid=1, tail=False):
    """A stage's spans for decode tokens at positions TOKENS of session 7, each token's
    receive starting at OFFSET_US plus 1000 us per position. The tail's send_next is the
    head's next step: it carries the next position (as the stage loop records it)."""
    spans = []
    for pos in tokens:
        t = (offset_us + 1000 * pos) * US
        for name, us in (("receive", 10), ("decode", 20), ("wait", 5), ("forward", forward_us), ("send_next", 15)):
            spans.append([name, 7, pos + (tail and name == "send_next"), 1, t, t + us * US, 100 + pid, pid])
            t += us * US
    return {"where": where, "pid": pid, "spans": spans}


def test_the_table_gives_each_span_s_median_the_hops_between_them_and_what_is_left():
    head = stage("[0,2)", range(10, 20), 0, 400, pid=1)
    tail = stage("[2,4)", range(10, 20), 500, 400, pid=2, tail=True)   # 450 us of head spans, then a 50 us hop
    # the coordinator hears each token 20 us after the tail's send, one per 1000 us
    coordinator = {"where": "coordinator", "pid": 3,
                   "spans": [["coordinator", 7, pos, 1, (970 + 1000 * pos) * US, (1000 + 1000 * pos) * US, 9, 0]
                             for pos in range(10, 20)]}
    table = trace.decode_table([head, tail, coordinator], ["[0,2)", "[2,4)"])
    rows = {(r["where"], r["span"]): r for r in table["rows"]}
    assert rows[("[0,2)", "forward")]["us"] == 400 and rows[("[0,2)", "forward")]["n"] == 10
    assert rows[("[2,4)", "hop in (from [0,2))")]["us"] == 50
    # the head's step at pos p+1 is received 1000 - 500 - 450 = 50 us after the tail sent it
    assert rows[("[0,2)", "hop in (from [2,4))")]["us"] == 50
    assert rows[("coordinator", "coordinator")]["us"] == 30
    assert table["period_us"] == 1000
    assert table["critical_us"] == 2 * (450 + 50)
    assert table["unexplained_us"] == 0
    assert rows[("[0,2)", "forward")]["mean_us"] == rows[("[0,2)", "forward")]["p90_us"] == 400
    assert table["critical_mean_us"] == table["period_mean_us"] == 1000 and table["unexplained_mean_us"] == 0
    assert table["forward_cpus"] == {"[0,2)": [1], "[2,4)": [2]}
    text = trace.format_table(table)
    assert "unexplained: 0 us" in text and "[2,4)" in text


def test_a_rare_long_wait_moves_the_mean_and_not_the_median():
    head = stage("[0,2)", range(10, 20), 0, 400, pid=1)
    tail = stage("[2,4)", range(10, 20), 500, 400, pid=2, tail=True)
    for span in tail["spans"]:   # one token of ten: the tail's receive comes 2,000 us late
        if span[2] == 15 and span[0] != "send_next":
            span[4] += 2000 * US
            span[5] += 2000 * US
    table = trace.decode_table([head, tail, {"where": "coordinator", "pid": 3, "spans": []}], ["[0,2)", "[2,4)"])
    hop = next(r for r in table["rows"] if r["where"] == "[2,4)" and r["span"].startswith("hop in"))
    assert hop["us"] == 50 and hop["mean_us"] == 50 + 2000 / 10 and hop["p90_us"] == 2050
    assert "mean us" in trace.format_table(table)


def test_prompt_chunks_stay_out_of_the_decode_table_and_a_picture_draws_every_span():
    head = stage("[0,2)", range(3), 0, 100)
    head["spans"].append(["forward", 7, 0, 24, 0, 99_000 * US, 101, 1])   # a 24-row prompt chunk
    table = trace.decode_table([head, {"where": "coordinator", "pid": 3, "spans": []}], ["[0,2)"])
    rows = {(r["where"], r["span"]): r for r in table["rows"]}
    assert rows[("[0,2)", "forward")]["us"] == 100 and table["period_us"] is None
    picture = trace.svg([head])
    assert picture.count("<rect") == 3 * 5 + len(trace.COLOURS)


def test_a_timeline_keeps_its_last_spans_only():
    timeline = trace.Timeline("[0,2)", kept=3)
    for pos in range(5):
        timeline.span("forward", 1, pos, 1, pos, pos + 1)
    spans = timeline.to_dict()["spans"]
    assert [s[2] for s in spans] == [2, 3, 4]
