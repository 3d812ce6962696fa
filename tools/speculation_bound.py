#!/usr/bin/env python3
"""What speculation can pay on this machine, and what bounds it: the price of a drafted
row measured on the engine, and the draft proposer replayed over the tokens the model
really gives, beside an oracle that drafts exactly the tokens that will be kept.

1. The model's greedy tokens for each prompt, from the whole model in one process (the
   invariant class: a route gives the same ones).
2. A round's time through a 2-stage split of the model with k drafted rows, k = 0..8, at
   one thread a stage: the head's forward and the tail's verify, median of repeats. With
   --link-us (the one-way links a round crosses, summed: 2 x 2,000 us for
   tools/netns-two-host.sh at DELAY=2ms), a round's fixed part grows by it.
3. The rounds replayed with meshnet's proposer (core/drafts.py, learning the row's price
   from the replayed rounds as the head does from timed ones), and with the oracle: the
   same n-gram candidates, cut to what the model will draw. Each round's price is the one
   measured in 2. The oracle's speed-up bounds what any draft length policy can get from
   these candidates.
   --prompts prose replays over text that does not repeat, where drafting must not cost.
    python tools/speculation_bound.py [--model smollm2] [--tokens 64] [--link-us 4000] [--prompts prose]
"""

import argparse
import statistics
import sys
import time

import numpy as np

from meshnet.core.drafts import NGRAM_DRAFTS, NgramProposer
from meshnet.engine import models
from meshnet.engine.binding import Entry, Stage
from meshnet.engine.gguf_layout import read_layout
from meshnet.evidence.prompts import PROMPT_SETS

MAX_K = NGRAM_DRAFTS
REPEATS = 9


def greedy(whole: Stage, prompt: list[int], n: int) -> list[int]:
    whole.open_session(1)
    try:
        out = whole.forward([Entry(1, 0, tokens=np.array(prompt))], want_logits=False)
        tokens = [int(out.token[0])]
        while len(tokens) < n:
            out = whole.forward([Entry(1, len(prompt) + len(tokens) - 1, tokens=np.array(tokens[-1:]))],
                                want_logits=False)
            tokens.append(int(out.token[0]))
        return tokens
    finally:
        whole.release_session(1)


def round_seconds(head: Stage, tail: Stage, context: list[int]) -> list[float]:
    """Seconds of compute for a round of k drafted rows, k = 0..MAX_K, after CONTEXT."""
    for stage in (head, tail):
        stage.open_session(1)
    try:
        residual = head.forward([Entry(1, 0, tokens=np.array(context))]).residual
        tail.forward([Entry(1, 0, residual=residual)], want_logits=False)
        pos, seconds = len(context), []
        for k in range(MAX_K + 1):
            rows = np.array(context[-(k + 1):], dtype=np.int32)
            times = []
            for _ in range(REPEATS):
                began = time.perf_counter()
                residual = head.forward([Entry(1, pos, tokens=rows)]).residual
                tail.forward([Entry(1, pos, residual=residual, tokens=rows, verify=k > 0)], want_logits=False)
                times.append(time.perf_counter() - began)
                head.truncate_session(1, pos)
                tail.truncate_session(1, pos)
            seconds.append(statistics.median(times))
        return seconds
    finally:
        for stage in (head, tail):
            stage.release_session(1)


class Oracle(NgramProposer):
    """The proposer's longest candidates, cut to the tokens the model will draw."""

    def __init__(self, max_drafts: int, future: list[int], prompt_len: int):
        super().__init__(max_drafts)
        self.future, self.prompt_len = future, prompt_len

    def odds(self, matched: int) -> float:
        return 1.0   # the longest drafts the candidates give, cut below

    def propose(self, limit: int) -> list[int]:
        drafts = super().propose(limit)
        at = len(self.tokens) - self.prompt_len
        kept = 0
        while kept < len(drafts) and drafts[kept] == self.future[at + kept]:
            kept += 1
        return drafts[:kept]


def replay(proposer: NgramProposer, prompt: list[int], tokens: list[int], price: list[float]) -> tuple:
    """Seconds to decode TOKENS[1:] with PROPOSER's drafts, drafts offered and kept, rounds."""
    proposer.extend(prompt + tokens[:1])
    at, seconds, offered, kept, rounds = 1, 0.0, 0, 0, 0
    while at < len(tokens):
        drafts = proposer.propose(len(tokens) - at - 1)
        accepted = 0
        while accepted < len(drafts) and tokens[at + accepted] == drafts[accepted]:
            accepted += 1
        proposer.extend(tokens[at:at + accepted + 1])
        proposer.kept(len(drafts), accepted)
        proposer.timed(len(drafts), price[len(drafts)])
        seconds += price[len(drafts)]
        offered, kept, rounds, at = offered + len(drafts), kept + accepted, rounds + 1, at + accepted + 1
    return seconds, offered, kept, rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--link-us", type=float, default=0.0, help="one-way link time a round crosses, summed")
    parser.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="repetitive")
    args = parser.parse_args()
    texts = PROMPT_SETS[args.prompts]
    path, _ = models.resolve(args.model)
    first, second = read_layout(path).balanced_ranges(2)
    with Stage(path, None, n_ctx=1024, max_sessions=1, n_threads=1) as whole:
        prompts = [whole.tokenize(text) for text in texts]
        outputs = [greedy(whole, p, args.tokens) for p in prompts]
    with Stage(path, (first.start, first.end), n_ctx=1024, max_sessions=1, n_threads=1) as head, \
            Stage(path, (second.start, second.end), n_ctx=1024, max_sessions=1, n_threads=1) as tail:
        compute = round_seconds(head, tail, prompts[0] + outputs[0])
    price = [s + args.link_us / 1e6 for s in compute]
    row = statistics.median(b - a for a, b in zip(price, price[1:]))
    print("round, k drafted rows (ms): " + " ".join(f"{k}:{s * 1e3:.1f}" for k, s in enumerate(price)))
    print(f"a drafted row: {row * 1e3:.2f} ms, {row / price[0]:.3f} of a round of none "
          f"(the link's {args.link_us:.0f} us in the round)")
    totals = {"proposer": [0.0, 0, 0, 0], "oracle": [0.0, 0, 0, 0]}
    plain_total = 0.0
    print(f"{'prompt':<28} {'proposer':>16} {'oracle':>16}")
    for text, prompt, tokens in zip(texts, prompts, outputs):
        plain = price[0] * (len(tokens) - 1)
        plain_total += plain
        cells = []
        for name, proposer in (("proposer", NgramProposer(MAX_K)), ("oracle", Oracle(MAX_K, tokens, len(prompt)))):
            result = replay(proposer, prompt, tokens, price)
            totals[name] = [t + r for t, r in zip(totals[name], result)]
            cells.append(f"{plain / result[0]:.3f}x {result[2]:>3}/{result[1]:<3}")
        print(f"{text[:26]!r:<28} {cells[0]:>16} {cells[1]:>16}")
    for name, (seconds, offered, kept, rounds) in totals.items():
        print(f"{name:<9} {plain_total / seconds:.3f}x of decoding without drafts; {kept} of {offered} drafts kept, "
              f"{(kept + rounds) / rounds:.2f} tokens a round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
