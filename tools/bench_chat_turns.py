#!/usr/bin/env python3
"""Time to first token per turn of a chat through `meshnet serve`, with the prefix cache
and without it, side by side: two servers (two local stages each) answer the same
conversation in turns, greedy, and each repeat opens with a system prompt neither has
seen. Prints each turn's prompt and cached tokens, the median TTFT of each server and
their ratio, turn N against turn 1, and whether the answers were the same. Plain
figures, no pass/fail.
    python tools/bench_chat_turns.py [--turns 10] [--repeats 3] [--max-tokens 32] [--json FILE]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import start_server  # noqa: E402  (a tool beside this one)

# the nonce first: no repeat's first turn finds any of its prompt stored by an earlier one
SYSTEM = ("Session {nonce}. You are a patient assistant for a small team that plans weekend trips by train across "
          "Europe. You answer in two or three plain sentences, name one concrete place or train where it helps, "
          "never use lists, and never ask a question back. The team likes quiet towns, local food, short walks and "
          "early trains; they travel light, carry one bag each, and prefer to book a day ahead.")
QUESTIONS = ["Where should we go first from Paris?", "What should we eat there?", "Is there a short walk nearby?",
             "Which train takes us onward?", "Where do we sleep that night?", "What if it rains?",
             "Is there a market on Sunday?", "How early should we leave?", "What do we bring back?",
             "How do we get home?", "What did we forget?", "Where next time?"]


def one_turn(client, model, messages, max_tokens):
    start, first, text, usage = time.perf_counter(), None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return {"ttft_ms": ((first or time.perf_counter()) - start) * 1e3, "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": details.cached_tokens if details else 0}


def conversation(client, model, nonce, turns, max_tokens):
    messages, out = [{"role": "system", "content": SYSTEM.format(nonce=nonce)}], []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        turn = one_turn(client, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": turn["text"]})
        out.append(turn)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--turns", type=int, default=10, choices=range(1, len(QUESTIONS) + 1), metavar="N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most")
    parser.add_argument("--prefix-cache", type=int, default=256, help="MiB per stage of the cached server")
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args()
    args.clients = 1
    configs = {"cache": ["--prefix-cache", str(args.prefix_cache)], "off": ["--prefix-cache", "0"]}
    servers = {}
    try:
        for name, extra in configs.items():
            servers[name] = start_server(args, extra)
        clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
                   for name, (_, url) in servers.items()}
        model = clients["off"].models.list().data[0].id
        for client in clients.values():
            one_turn(client, model, [{"role": "user", "content": "Hello."}], 4)   # warm-up
        runs = {name: [] for name in configs}
        for repeat in range(args.repeats):
            nonce = os.urandom(4).hex()
            for name in (("cache", "off") if repeat % 2 == 0 else ("off", "cache")):
                runs[name].append(conversation(clients[name], model, nonce, args.turns, args.max_tokens))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(60)

    same = all(a["text"] == b["text"] for ca, co in zip(runs["cache"], runs["off"]) for a, b in zip(ca, co))
    rows = []
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} {'ttft off ms':>11} {'ttft cache ms':>13} {'cache/off':>9}")
    for t in range(args.turns):
        off = statistics.median(run[t]["ttft_ms"] for run in runs["off"])
        cache = statistics.median(run[t]["ttft_ms"] for run in runs["cache"])
        row = {"turn": t + 1, "prompt_tokens": runs["cache"][0][t]["prompt_tokens"],
               "cached_tokens": statistics.median(run[t]["cached_tokens"] for run in runs["cache"]),
               "ttft_off_ms": off, "ttft_cache_ms": cache}
        rows.append(row)
        print(f"{t + 1:>4} {row['prompt_tokens']:>6} {row['cached_tokens']:>6.0f} {off:>11.0f} {cache:>13.0f} "
              f"{cache / off:>9.2f}")
    last = rows[-1]
    summary = {"turn_last_over_first_off": last["ttft_off_ms"] / rows[0]["ttft_off_ms"],
               "turn_last_over_first_cache": last["ttft_cache_ms"] / rows[0]["ttft_cache_ms"],
               "answers_identical": same, "repeats": args.repeats, "max_tokens": args.max_tokens}
    print(f"turn {args.turns} / turn 1 TTFT: off {summary['turn_last_over_first_off']:.2f}x, "
          f"cache {summary['turn_last_over_first_cache']:.2f}x; answers identical with and without the cache: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
