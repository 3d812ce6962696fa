#!/usr/bin/env python3
"""Measure what `meshnet run` does when one of its worker processes dies or freezes.

Each trial starts `python -m meshnet.cli.main run --max-tokens N --prompt P`, picks one of its
worker children (children by the parent pid in /proc/*/stat, as tests/system/test_cli.py does)
and, at a seeded random moment, sends it SIGKILL ("kill") or SIGSTOP ("stop"). The
moment is either early, a random 0..--early-max seconds after the child appears (so
often before the route forms), or late, a random 0..--late-max seconds after the first
bytes of generated text (mid-generation; the echo of the prompt does not count). Per trial it records:

- the time from the signal to `meshnet run` exiting, its exit status and the code word
  of its `error: [code] ...` line (or that it ended normally: the signal came too late);
- a hang: no exit within --timeout seconds (then it is killed, with its children);
- orphans: worker children still alive 2 s after `meshnet run` exited (then they get
  SIGCONT and SIGKILL, after being counted).

It prints a line per trial and a summary: p50/max seconds to the error for kill and for
stop (early and late apart), hangs, orphans, exit statuses and error codes.

    python tools/kill_loop.py                      # 30 kills, 10 stops, seed 1
    python tools/kill_loop.py --threads 1 --trials-kill 5 --trials-stop 2 --timeout 150

A measuring tool for the record, not a test: it passes no judgement beyond the numbers.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshnet.launch.local_cluster import children_of as cluster_children_of

ERROR_LINE = re.compile(r"^error: \[([^\]]+)\] ?(.*)$", re.MULTILINE)
POLL_S = 0.02      # how often the moment to signal is looked for


@dataclass
class Trial:
    index: int
    how: str                      # kill | stop
    when: str                     # early (after the child appears) | late (after the first generated text)
    delay_s: float                # after the child appeared / after the first generated text
    victim: str = "-"             # the victim's --layers
    signalled: bool = False
    output_before_signal: bool = False     # generated text had come: the route had formed
    seconds_to_exit: float | None = None   # from the signal (from the start when no signal was sent)
    returncode: int | None = None
    code: str | None = None       # from `error: [code] message`
    message: str = ""
    hang: bool = False
    orphans: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def outcome(self) -> str:
        if self.hang:
            return "HANG"
        if self.returncode == 0:
            return "completed"
        return self.code or f"exit {self.returncode}"


def children_of(pid: int) -> list[int]:
    # the kernel's own list, per thread of the parent: cheap enough to read every few ms
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if tasks:
        found = set()
        for task in tasks:
            try:
                found.update(int(p) for p in task.read_text().split())
            except OSError:
                pass
        return sorted(found)
    return cluster_children_of(pid)  # without CONFIG_PROC_CHILDREN: every process's parent pid


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def is_worker(pid: int) -> bool:
    # between fork and exec a child still shows its parent's command line: wait for the worker's own
    args = cmdline(pid)
    return "meshnet.cli.main" in args and "worker" in args


def layers_of(pid: int) -> str:
    args = cmdline(pid)
    return args[args.index("--layers") + 1] if "--layers" in args else "?"


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Output(threading.Thread):
    """Drains one pipe so the child never blocks on it; notes when more than `after`
    bytes had come (stdout: the prompt is echoed at once, the first token comes later)."""

    def __init__(self, pipe, after: int = 0):
        super().__init__(daemon=True)
        self.pipe, self.after, self.data, self.first_at = pipe, after, bytearray(), None

    def run(self):
        while chunk := os.read(self.pipe.fileno(), 65536):
            self.data += chunk
            if self.first_at is None and len(self.data) > self.after:
                self.first_at = time.monotonic()


def run_trial(trial: Trial, rng: random.Random, args) -> Trial:
    command = [sys.executable, "-m", "meshnet.cli.main", "run", "--max-tokens", str(args.max_tokens), "--prompt", args.prompt]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    if args.model:
        command += ["--model", args.model]
    t_start = time.monotonic()
    run = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = Output(run.stdout, after=len(args.prompt.encode())), Output(run.stderr)
    out.start()
    err.start()
    seen: set[int] = set()

    def look():
        seen.update(p for p in children_of(run.pid) if is_worker(p))

    t_signal = None
    try:
        # the moment: early = some time after a worker appears; late = some time after the first generated text
        anchor = None
        while run.poll() is None and time.monotonic() - t_start < args.timeout:
            look()
            if trial.when == "early" and seen:
                anchor = time.monotonic()
                break
            if trial.when == "late" and out.first_at is not None:
                anchor = out.first_at
                break
            time.sleep(POLL_S)
        if anchor is not None:
            fire_at = anchor + trial.delay_s
            while run.poll() is None and time.monotonic() < fire_at:
                look()
                time.sleep(POLL_S)
            look()
            candidates = sorted(p for p in seen if alive(p))
            if run.poll() is None and candidates:
                victim = rng.choice(candidates)
                trial.victim = layers_of(victim)
                trial.output_before_signal = out.first_at is not None
                signal_quietly(victim, signal.SIGKILL if trial.how == "kill" else signal.SIGSTOP)
                t_signal = time.monotonic()
                trial.signalled = True
            else:
                trial.note = "ended before the signal"
        else:
            trial.note = "no worker appeared" if trial.when == "early" else "no generated text came"

        # the outcome: an exit within the bound, or a hang
        deadline = (t_signal or t_start) + args.timeout
        while run.poll() is None and time.monotonic() < deadline:
            look()  # the children are known by now: this only guards against a late one
            try:
                run.wait(timeout=min(0.25, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        if run.poll() is None:
            trial.hang = True
            run.kill()
            run.wait()
        trial.seconds_to_exit = time.monotonic() - (t_signal or t_start)
        trial.returncode = run.returncode
        out.join(5)
        err.join(5)
        codes = ERROR_LINE.findall(err.data.decode(errors="replace"))
        trial.code, trial.message = codes[-1] if codes else (None, "")
        if trial.returncode not in (0, None) and not codes:
            tail = err.data.decode(errors="replace").strip().splitlines()[-1:] or [""]
            trial.note = (trial.note + " " if trial.note else "") + f"last stderr line: {tail[0][:120]}"

        # orphans: a worker child of ours that outlived `meshnet run` by 2 s
        time.sleep(2.0)
        trial.orphans = sorted(p for p in seen if alive(p) and is_worker(p))
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in seen:  # counted already: now make sure nothing of ours is left, stopped or not
            if alive(pid) and is_worker(pid):
                signal_quietly(pid, signal.SIGCONT)
                signal_quietly(pid, signal.SIGKILL)
    return trial


def describe(t: Trial) -> str:
    seconds = f"{t.seconds_to_exit:6.2f}s" if t.seconds_to_exit is not None else "     - "
    return (f"#{t.index:<3} {t.how:<4} {t.when:<5} +{t.delay_s:4.2f}s victim {t.victim:<6} "
            f"{'generating' if t.output_before_signal else 'no-text   '} -> {seconds} rc={t.returncode!s:<4} "
            f"{t.outcome:<20} orphans={len(t.orphans)}" + (f"  ({t.note})" if t.note else "")
            + (f"  | {t.message[:100]}" if t.message else ""))


def summarize(trials: list[Trial]) -> str:
    lines = ["", "summary"]
    for how in ("kill", "stop"):
        mine = [t for t in trials if t.how == how]
        if not mine:
            continue
        # by what was going on when the signal came: no text yet (often no route yet), or generating
        phases = {"no-text": lambda t: not t.output_before_signal, "generating": lambda t: t.output_before_signal,
                  "all": lambda t: True}
        for when, belongs in phases.items():
            group = [t for t in mine if belongs(t)]
            if not group:
                continue
            errors = [t.seconds_to_exit for t in group if t.signalled and not t.hang and t.returncode not in (0, None)]
            timing = (f"p50 {statistics.median(errors):.2f}s max {max(errors):.2f}s over {len(errors)} errors"
                      if errors else "no errors")
            lines.append(
                f"  {how:<4} {when:<10} n={len(group):<3} time to error: {timing}; "
                f"completed={sum(t.returncode == 0 for t in group)} hangs={sum(t.hang for t in group)} "
                f"orphans={sum(len(t.orphans) for t in group if not t.hang)}"
                f"{'' if not any(t.hang and t.orphans for t in group) else f' (+{sum(len(t.orphans) for t in group if t.hang)} after killing hung runs)'} "
                f"not-signalled={sum(not t.signalled for t in group)}")
    codes = collections.Counter(t.outcome for t in trials)
    statuses = collections.Counter(t.returncode for t in trials)
    lines.append(f"  outcomes: {dict(codes.most_common())}")
    lines.append(f"  exit statuses: {dict(statuses.most_common())}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials-kill", type=int, default=30)
    parser.add_argument("--trials-stop", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="passed to meshnet run (e.g. 1)")
    parser.add_argument("--model", default=None, help="passed to meshnet run")
    parser.add_argument("--max-tokens", type=int, default=400)
    # counting goes on to --max-tokens without an end-of-generation token: the kill lands mid-generation
    parser.add_argument("--prompt", default="1, 2, 3, 4, 5, 6,")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds after the signal before a run that has not exited counts as a hang")
    parser.add_argument("--early-share", type=float, default=0.4, help="share of trials signalled early")
    parser.add_argument("--early-max", type=float, default=1.5, help="early: up to this long after the child appears")
    parser.add_argument("--late-max", type=float, default=4.0, help="late: up to this long after the first generated text")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    plan = [("kill", i) for i in range(args.trials_kill)] + [("stop", i) for i in range(args.trials_stop)]
    rng.shuffle(plan)  # kills and stops interleaved, so that machine noise falls on both
    trials = []
    print(f"kill_loop: {args.trials_kill} kill + {args.trials_stop} stop trials, seed {args.seed}, "
          f"threads {args.threads if args.threads is not None else 'default'}, timeout {args.timeout:.0f}s", flush=True)
    for index, (how, _) in enumerate(plan, 1):
        early = rng.random() < args.early_share
        trial = Trial(index, how, "early" if early else "late",
                      round(rng.uniform(0, args.early_max if early else args.late_max), 2))
        run_trial(trial, random.Random(rng.randrange(1 << 32)), args)
        trials.append(trial)
        print(describe(trial), flush=True)
    print(summarize(trials), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
