"""Drafted tokens for speculative decoding, with no model: the tokens that followed the
latest earlier occurrence of the session's last few tokens, in its prompt or its own
output (prompt lookup; llama.cpp's ngram-simple). Text that repeats what came before (code
edited in place, a summary quoting its source, a list, a refrain) drafts well; other text
drafts nothing, and the round is a plain decode step.

The route verifies a round's drafts in one pass and keeps those equal to what it would
have drawn itself, so a draft costs rows, never a different token. How many to draft is
what pays best at the odds of a draft being kept: a round of k drafts each kept with
probability p (while the ones before it were) gives (1 - p^(k+1)) / (1 - p) tokens for the
price of 1 + c * k one-token rounds, c a drafted row's price against a round's. The odds
are those of the match, the longer the likelier (measured over the prompts meshnet checks
on, SmolLM2: a continuation was drawn 53% of the time after 2 tokens matched, 74% after 4,
92% after 8 to 11, 98% after 16 or more), held below the rate drafts were kept lately: a
text may repeat its words and not their order. The head
learns c from the rounds it times (each round from one step's arrival to the next's, a
straight line through round time against drafts), since a round's fixed part is the
network's as much as the compute's: across a slow link a row costs less of a round.
Where drafting never pays, the head drafts nothing, and tries one draft again now and then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet.core import errors as E
from meshnet.core.errors import MeshnetError

MAX_DRAFTS = 32   # drafts a round may carry: past a few, a round's rows cost more than its odds of keeping them pay
NGRAM_DRAFTS = 8  # --speculate ngram's drafts a round at most
NGRAM_MAX = 4     # the longest suffix matched: the longer the match, the likelier its continuation
NGRAM_MIN = 2     # one token alone matches too much to draft from
MATCH_MAX = 32    # tokens matched before the n-gram, counted backwards, at most
KEPT_SLACK = 0.25  # the odds of a long match may be over the rate kept lately by this much
# a drafted row's price against a one-token round's: measured on the CPU engine (the invariant
# class computes each row as alone), SmolLM2 at one thread a stage: 19 ms a token, 6 ms a row more
ROW_COST = 0.3    # (c's start, until the rounds timed say otherwise)
ROW_COST_RANGE = (0.02, 1.0)
TIMED_DECAY = 0.95   # the weight of earlier rounds' times against the last one's
SPREAD_MIN = 1.0     # the rounds' spread in drafts (variance x rounds' weight) that the slope is taken from
KEPT_DECAY = 0.8  # the weight of what earlier rounds kept, against the last round's
PROBE_EVERY = 8   # rounds of no drafts before one draft is tried again


def parse_speculate(text: str) -> int:
    """--speculate: ngram (NGRAM_DRAFTS drafts a round at most), ngram:K, or off (0)."""
    if text == "off":
        return 0
    kind, _, k = text.partition(":")
    if kind == "draft":
        raise MeshnetError(E.INVALID_ARGUMENT, "--speculate draft:MODEL: a draft model is not built yet; "
                           "--speculate ngram drafts from the session's own tokens")
    if kind != "ngram" or (k and not (k.isdigit() and 1 <= int(k) <= MAX_DRAFTS)):
        raise MeshnetError(E.INVALID_ARGUMENT, f"--speculate {text}: ngram, ngram:K (K drafts a round at most, "
                           f"1..{MAX_DRAFTS}) or off")
    return int(k) if k else NGRAM_DRAFTS


def best_length(p: float, max_drafts: int, row_cost: float = ROW_COST) -> int:
    """The drafts a round that pay best when each is kept with probability P (0: none pays)."""
    best_k, best = 0, 1.0
    for k in range(1, max_drafts + 1):
        gain = (1 - p ** (k + 1)) / (1 - p) / (1 + row_cost * k) if p < 1 else (k + 1) / (1 + row_cost * k)
        if gain > best:
            best_k, best = k, gain
    return best_k


@dataclass
class NgramProposer:
    max_drafts: int
    tokens: list[int] = field(default_factory=list)   # the session's tokens, each by its position
    kept_weight: float = 3.0      # drafts kept lately, decayed; the start expects 3 of 4 kept
    refused_weight: float = 1.0   # ... rounds cut by a refused draft
    idle: int = 0                 # rounds without drafts since the last
    # decayed sums over timed rounds (weight, drafts, seconds, drafts^2, drafts x seconds)
    _timed: list[float] = field(default_factory=lambda: [0.0] * 5)
    # n-gram -> the position of the token that followed its latest occurrence
    _next: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def keep_rate(self) -> float:
        return self.kept_weight / (self.kept_weight + self.refused_weight)

    @property
    def row_cost(self) -> float:
        """A drafted row's price against a one-token round's: the slope of round time over
        drafts against its intercept, once the rounds timed drafted more than one length."""
        w, k, t, kk, kt = self._timed
        if w <= 0:
            return ROW_COST
        mean_k, mean_t = k / w, t / w
        var_k = kk / w - mean_k ** 2
        # (nearly) one length drafted: the slope is not known. Prose drafts one or none, a
        # round in a few drafting: spread enough to learn from, where the start's guess is
        # what lets a drafted row cost more than it pays
        if var_k * w < SPREAD_MIN:
            return ROW_COST
        slope = (kt / w - mean_k * mean_t) / var_k
        base = mean_t - slope * mean_k
        if base <= 0:
            return ROW_COST
        low, high = ROW_COST_RANGE
        return min(high, max(low, slope / base))

    @property
    def length(self) -> int:
        """Drafts to offer next round, after a match as likely as the rate kept lately."""
        return best_length(self.keep_rate, self.max_drafts, self.row_cost)

    def odds(self, matched: int) -> float:
        """A draft's odds of being kept after MATCHED tokens matched an earlier occurrence."""
        return min(1 - 1 / (matched + 1), self.keep_rate + KEPT_SLACK)

    def timed(self, drafts: int, seconds: float) -> None:
        """A round of DRAFTS drafts took SECONDS, from its step's arrival at the head to the next's."""
        self._timed = [v * TIMED_DECAY for v in self._timed]
        for i, v in enumerate((1.0, drafts, seconds, drafts * drafts, drafts * seconds)):
            self._timed[i] += v

    def extend(self, tokens) -> None:
        """The session's next tokens, as fed to the route."""
        for token in tokens:
            i = len(self.tokens)
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if i >= n:
                    self._next[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(token)

    def propose(self, limit: int) -> list[int]:
        """Up to LIMIT drafts to follow the tokens so far, as many as pay at the match's odds."""
        found = self._match()
        k = min(limit, best_length(self.odds(found[0]), self.max_drafts, self.row_cost)) if found else 0
        if k <= 0:
            self.idle += limit > 0
            if found is None or limit <= 0 or self.idle < PROBE_EVERY:
                return []
            k = 1   # a probe: the text may have turned repetitive
        self.idle = 0
        matched, at = found
        # past the end, the continuation repeats with the period it showed
        period, drafts = len(self.tokens) - at, []
        for i in range(k):
            j = at + i
            while j >= len(self.tokens):
                j -= period
            drafts.append(self.tokens[j])
        return drafts

    def _match(self) -> tuple[int, int] | None:
        """(tokens matched, the position after the earlier occurrence) for the longest
        n-gram ending the tokens that occurred before, or None."""
        tokens = self.tokens
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(tokens) <= n:
                continue
            at = self._next.get(tuple(tokens[-n:]))
            if at is not None:
                matched = n
                while matched < MATCH_MAX and at - matched - 1 >= 0 and tokens[at - matched - 1] == tokens[-matched - 1]:
                    matched += 1
                return matched, at
        return None

    def kept(self, offered: int, accepted: int) -> None:
        """A round offered OFFERED drafts and the route kept ACCEPTED of them."""
        if offered == 0:
            return
        self.kept_weight = self.kept_weight * KEPT_DECAY + accepted
        self.refused_weight = self.refused_weight * KEPT_DECAY + (1 if accepted < offered else 0)
