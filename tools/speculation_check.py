#!/usr/bin/env python3
"""Speculation gives the tokens decoding one at a time gives: every prompt of meshnet
accept, the class check's (prose, code, a question, SQL) and the repetitive ones, greedy
and seeded, through one local route of worker processes with drafts and without, in turns.
Prints each prompt's verdict and what the drafts kept; exit status 0 only when every
prompt's tokens were the same.
    python tools/speculation_check.py [--model smollm2] [--tokens 64] [--speculate ngram]
"""

import argparse
import sys

from meshnet.core.drafts import parse_speculate
from meshnet.core.sampling import Sampling
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
from meshnet.evidence.prompts import CLASS_CHECK, REPETITIVE, SHORT
from meshnet.launch.local_cluster import LocalCluster

SEEDED = Sampling(temperature=0.8, top_k=40, top_p=0.95, repeat_penalty=1.1, seed=1234)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculate", default="ngram")
    args = parser.parse_args()
    drafts = parse_speculate(args.speculate)
    path, _ = models.resolve(args.model)
    ranges = read_layout(path).balanced_ranges(2)
    prompts = [("accept", p) for p in SHORT] + [("class", p) for p in CLASS_CHECK] + \
              [("repetitive", p) for p in REPETITIVE]
    same_everywhere, kept, drafted = True, 0, 0
    with LocalCluster(path, ranges, threads=args.threads, n_ctx=1024, max_sessions=2, prefix_cache_mib=0) as cluster:
        coordinator = cluster.coordinator
        print(f"{'set':<11} {'sampling':<8} {'same':<5} {'kept/drafted':>12} {'tokens/round':>12}  prompt")
        for kind, text in prompts:
            tokens = coordinator.tokenize(text)
            for name, sampling in (("greedy", None), ("seeded", SEEDED)):
                plain = coordinator.generate(tokens, args.tokens, sampling=sampling, stop_at_eog=False,
                                             speculate=0).result(300)
                spec = coordinator.generate(tokens, args.tokens, sampling=sampling, stop_at_eog=False,
                                            speculate=drafts).result(300)
                same = spec.tokens == plain.tokens
                same_everywhere &= same
                s = spec.metrics["speculation"]
                kept, drafted = kept + s["accepted"], drafted + s["drafted"]
                print(f"{kind:<11} {name:<8} {str(same):<5} {s['accepted']:>5}/{s['drafted']:<6} "
                      f"{s['tokens_per_round']:>12.2f}  {text[:40]!r}")
    print(f"{len(prompts)} prompts x greedy and seeded x {args.tokens} tokens, {args.speculate}: identical with "
          f"drafts and without: {same_everywhere}; {kept} of {drafted} drafts kept")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
