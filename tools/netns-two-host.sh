#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces, A (10.77.0.1) and B (10.77.0.2),
# joined by a link of their own. A runs the coordinator (tools/netns_check.py) and the
# worker for the first layers, B the worker for the rest; every socket is bound to a
# namespace address, so each activation crosses the link. The checker then compares the
# route with the whole model in one process (tokens, logits, 4 concurrent sessions) and
# prints decode tok/s and hop latency next to the whole model's.
#   tools/netns-two-host.sh [MODEL]        default: smollm2; root only
# Environment:
#   DELAY=2ms   a one-way delay, each direction (a ping's round trip grows by 2 x DELAY),
#               put on the link by tools/delay_wire.py between two TAP devices: the
#               kernels this runs on may have no netem, and where one has it the wire
#               is still used, so that the path measured is the one tested. Unset: a
#               plain veth pair.
#   SECURE=1    CURVE on every link, with fresh keys (meshnet keys generate); the checker
#               asserts each link's mechanism. Unset: the workers run with --insecure.
#   PORT        the coordinator's port (default 5555: the namespaces are private).
#   ROUNDS      timed runs of each prompt, whole model and route in turns (default 3).
#   TOKENS      greedy tokens per prompt (default 32).
#   SPECULATE   ngram or ngram:K: the route also decodes with drafts (meshnet run --speculate),
#               checked to give the same tokens, and timed in turns beside the route
#               without them and the whole model, on repetitive prompts as well.
#   PYTHON      the interpreter with meshnet (default: the active or the project's venv).
# Exit status: 0 every check held, 1 one did not (or a process failed), 2 a bad DELAY,
# 77 no namespaces can be made here (not root, no `ip`, no /dev/net/tun for DELAY):
# the reason is on stderr, for a test to report as a skip.
# Whatever it starts is stopped, and the namespaces removed, when it ends: at its end, on
# an error, on SIGTERM, SIGINT or SIGHUP; killed outright (SIGKILL), its processes die with
# it (setpriv --pdeathsig, where util-linux has it) and only the namespaces are left, named
# meshnet-a-PID and meshnet-b-PID after its pid. Each step is said with the seconds since
# the start.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

skip() { echo "netns-two-host: cannot build two hosts here: $*" >&2; exit 77; }

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then py=$VIRTUAL_ENV/bin/python
else py=$root/.venv/bin/python
fi
model=${1:-${MODEL:-}}
port=${PORT:-5555}
delay=${DELAY:-}
addr_a=10.77.0.1
addr_b=10.77.0.2

[ "$(id -u)" -eq 0 ] || skip "network namespaces need root (uid $(id -u))"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
if [ -n "$delay" ] && [ ! -c /dev/net/tun ]; then skip "DELAY needs TAP devices and there is no /dev/net/tun"; fi

# the model's path once, so that every process loads the one file; the split gives each
# stage an even share of the per-token work; where there are two CPUs, each "host" gets
# one for its stage's data path, as on two machines
plan=$("$py" -c '
import os, sys
from meshnet.engine import models
from meshnet.engine.gguf_layout import read_layout
path = models.resolve(sys.argv[1] or None)[0]
print(path)
print(",".join(f"{r.start}:{r.end}" for r in read_layout(path).balanced_ranges(2)))
cpus = sorted(os.sched_getaffinity(0))
print(f"{cpus[0]} {cpus[1]}" if len(cpus) > 1 else "")' "$model") ||
    { echo "netns-two-host: $py could not read the model (PYTHON: an interpreter with meshnet)" >&2; exit 1; }
model_path=$(sed -n 1p <<<"$plan")
layers=$(sed -n 2p <<<"$plan")
cpus=$(sed -n 3p <<<"$plan")
first=${layers%%,*}
second=${layers#*,}

# names unique to this run, so that runs side by side never meet; interface names stay
# within the kernel's 15 characters
ns_a=meshnet-a-$$
ns_b=meshnet-b-$$
link_a=mn$$a
link_b=mn$$b
logs=$(mktemp -d "${TMPDIR:-/tmp}/meshnet-netns.XXXXXX")
SAY_AS=netns
# shellcheck source=netns-lib.sh
. "$root/tools/netns-lib.sh"
make_namespaces

join_namespaces "$addr_a" "$addr_b" "$delay"

coordinator=tcp://$addr_a:$port
echo "netns: $ns_a ($addr_a) and $ns_b ($addr_b) joined by $wire"
echo "netns: $ns_a runs the coordinator ($coordinator) and layers $first; $ns_b layers $second; model $model_path"

cpu_a=() cpu_b=()
if [ -n "$cpus" ]; then cpu_a=(--cpu "${cpus% *}") cpu_b=(--cpu "${cpus#* }"); fi
worker=("$py" -m meshnet.cli.main worker --coordinator "$coordinator" --model "$model_path" --threads 1 --ctx 1024)
check_keys=()
if [ -n "${SECURE:-}" ]; then
    # fresh keys for this run: the coordinator's, one per worker, the workers' public keys allowed
    keys=$logs/keys
    for name in coordinator worker-a worker-b; do
        "$py" -m meshnet.cli.main keys generate "$keys" --name "$name" >/dev/null
    done
    mkdir -p "$keys/allowed" && cp "$keys/worker-a.key" "$keys/worker-b.key" "$keys/allowed/"
    secure_a=(--secret "$keys/worker-a.key_secret" --coordinator-key "$keys/coordinator.key")
    secure_b=(--secret "$keys/worker-b.key_secret" --coordinator-key "$keys/coordinator.key")
    check_keys=(--keys "$keys")
    echo "netns: CURVE on every link (fresh keys in $keys)"
else
    secure_a=(--insecure) secure_b=(--insecure)   # a private pair of namespaces: nobody else can reach them
fi
start "worker $first" "$ns_a" "${worker[@]}" --layers "$first" --data-bind "tcp://$addr_a:0" "${cpu_a[@]}" "${secure_a[@]}"
start "worker $second" "$ns_b" "${worker[@]}" --layers "$second" --data-bind "tcp://$addr_b:0" "${cpu_b[@]}" "${secure_b[@]}"

# the checker's output is ours; the workers reconnect until its coordinator listens
${tie[@]+"${tie[@]}"} ip netns exec "$ns_a" "$py" "$root/tools/netns_check.py" --bind "$coordinator" \
    --model "$model_path" --layers "$layers" --threads 1 --ctx 1024 --peer "$addr_b" --delay-us "${delay_us:-0}" \
    --rounds "${ROUNDS:-3}" --tokens "${TOKENS:-32}" ${SPECULATE:+--speculate "$SPECULATE"} \
    ${check_keys[@]+"${check_keys[@]}"} &
checker=$!
pids+=("$checker")
say "started the checker in $ns_a (pid $checker): the route against the whole model"
while kill -0 "$checker" 2>/dev/null; do
    for i in "${!names[@]}"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "netns-two-host: ${names[$i]} ended before the checks did" >&2
            exit 1
        fi
    done
    sleep 0.2
done
wait "$checker"
say "the checks are done"
