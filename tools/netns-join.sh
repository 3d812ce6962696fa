#!/usr/bin/env bash
# Join a machine in one command, shown on one machine: two network namespaces, A (10.77.0.1)
# and B (10.77.0.2), joined by a veth pair. A is the host others join (tools/netns_join_check.py):
# a coordinator with the mesh's keys, the holder of the model's bytes and its mDNS
# announcement, and its own worker for the first half of the layers (as `meshnet serve --mem`
# starts it). B has meshnet and no model file (MESHNET_HOME an empty directory) and runs
#   meshnet worker --join-file TOKEN_FILE --discover --mem 8G
# with the token printed without addresses: it finds A on the link by mDNS, fetches only
# the bytes of the layers it is assigned, over CURVE, and serves them. The checker compares
# the route with the whole model in one process (tokens and logits), checks every link's
# mechanism and B's disk use against its share; then this script times B's fetch against a
# plain copy of as many bytes of the model, A to B, as cat makes it (dd bs=128K into bash's
# /dev/tcp/B/PORT; the median of 3).
#   tools/netns-join.sh [MODEL]        default: smollm2; root only
# Environment:
#   RATE=1gbit  a tc tbf rate limit on both ends of the link (unset: a plain veth pair)
#   PORT        the coordinator's port (default 5555: the namespaces are private)
#   TOKENS      greedy tokens per prompt (default 32)
#   WAIT        seconds the checker waits for the route, and for each generation (default 600)
#   PYTHON      the interpreter with meshnet (default: the active or the project's venv)
# The last line on stdout is one JSON object: the checker's report and fetch_MBps, cat_MBps,
# fetch_to_cat (fetch_rate_ok: at least 0.8; reported, not a condition of ok), discovery.
# ok only when the route spans both hosts, parity holds with a max |logit diff| of 0,
# every link is CURVE, B's disk use is at most 1.05 x its share, and B discovered A.
# Exit status: 0 ok, 1 a check failed (or a process did), 77 no namespaces can be made
# here (not root, no `ip`, no `tc` for RATE): the reason is on stderr, for a test to skip.
# Whatever it starts is stopped, and the namespaces removed, when it ends: at its end, on
# an error, on SIGTERM, SIGINT or SIGHUP; killed outright (SIGKILL), its processes die with
# it (setpriv --pdeathsig, where util-linux has it) and only the namespaces are left, named
# meshnet-a-PID and meshnet-b-PID after its pid. Each step is said with the seconds since
# the start.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

skip() { echo "netns-join: cannot build two hosts here: $*" >&2; exit 77; }

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then py=$VIRTUAL_ENV/bin/python
else py=$root/.venv/bin/python
fi
model=${1:-${MODEL:-}}
port=${PORT:-5555}
rate=${RATE:-}
addr_a=10.77.0.1
addr_b=10.77.0.2
rounds=3   # plain transfers timed; the median is compared

[ "$(id -u)" -eq 0 ] || skip "network namespaces need root (uid $(id -u))"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
if [ -n "$rate" ]; then command -v tc >/dev/null || skip "RATE needs 'tc' (iproute2)"; fi

# the model's path once (where this machine keeps it): A's processes run with a MESHNET_HOME
# of their own, fresh keys included
model_path=$("$py" -c '
import sys
from meshnet.engine import models
print(models.resolve(sys.argv[1] or None)[0])' "$model") ||
    { echo "netns-join: $py could not find the model (PYTHON: an interpreter with meshnet)" >&2; exit 1; }

# names unique to this run, so that runs side by side never meet; interface names stay
# within the kernel's 15 characters
ns_a=meshnet-a-$$
ns_b=meshnet-b-$$
link_a=mn$$a
link_b=mn$$b
logs=$(mktemp -d "${TMPDIR:-/tmp}/meshnet-netns-join.XXXXXX")
a_home=$logs/a-home   # A's keys and hashes
b_home=$logs/b-home   # B's: empty, no model file
mkdir -p "$a_home" "$b_home"
SAY_AS=netns-join
# shellcheck source=netns-lib.sh
. "$root/tools/netns-lib.sh"
make_namespaces
join_namespaces "$addr_a" "$addr_b"
# a real host's default route covers multicast (mDNS); these hosts have none
ip -n "$ns_a" route add 224.0.0.0/4 dev "$link_a"
ip -n "$ns_b" route add 224.0.0.0/4 dev "$link_b"
if [ -n "$rate" ]; then
    for side in "$ns_a $link_a" "$ns_b $link_b"; do
        set -- $side
        tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst "${BURST:-256kb}" latency 50ms 2>"$logs/tc.err" ||
            { echo "netns-join: tc cannot limit the link to RATE=$rate: $(cat "$logs/tc.err")" >&2; exit 2; }
    done
    wire="a veth pair, each end limited to $rate (tc tbf)"
fi
coordinator=tcp://$addr_a:$port
say "$ns_a ($addr_a) and $ns_b ($addr_b) joined by $wire; model $model_path"

# A: the coordinator, its holder and announcement, and its worker (the checker spawns it);
# the checker's progress is on stderr, its report in checker.json
${tie[@]+"${tie[@]}"} ip netns exec "$ns_a" env MESHNET_HOME="$a_home" MESHNET_ANNOUNCE=1 \
    "$py" "$root/tools/netns_join_check.py" --bind "$coordinator" --model "$model_path" --peer "$addr_b" \
    --b-home "$b_home" --token-file "$logs/token" --token-addr-file "$logs/token-with-addresses" \
    --worker-log "$logs/worker A.log" --tokens "${TOKENS:-32}" --wait "${WAIT:-600}" > "$logs/checker.json" &
checker=$!
pids+=("$checker")
names+=("worker A")   # its log, shown on a failure (the checker's lines are on stderr already)
say "started the checker in $ns_a (pid $checker): coordinator $coordinator, A's worker"

while [ ! -s "$logs/token" ]; do
    if ! kill -0 "$checker" 2>/dev/null; then
        echo "netns-join: the checker ended before it wrote the join token" >&2
        exit 1
    fi
    sleep 0.2
done
token=$(cat "$logs/token")
say "the join token (no addresses: B looks for A on the link) is ${#token} characters"

# B: meshnet and no model file; it finds A by mDNS and fetches its layers' bytes
# (the token from its file: on a command line every user of the host could read it)
start "worker B" "$ns_b" env MESHNET_HOME="$b_home" "$py" -m meshnet.cli.main worker --join-file "$logs/token" --discover \
    --mem 8G --data-bind "tcp://$addr_b:0"
worker_b=${pids[-1]}
# and what `meshnet status --discover` lists from B meanwhile
start "status B" "$ns_b" env MESHNET_HOME="$b_home" "$py" -m meshnet.cli.main status --discover --json --timeout 5

while kill -0 "$checker" 2>/dev/null; do
    if ! kill -0 "$worker_b" 2>/dev/null; then
        echo "netns-join: worker B ended before the checks did" >&2
        exit 1
    fi
    sleep 0.2
done
wait "$checker" && checked=0 || checked=$?
say "the checks are done (status $checked)"
[ -s "$logs/checker.json" ] || { echo "netns-join: the checker gave no report" >&2; exit 1; }

# discovery: B's worker found A on the link, at A's address
found=$(grep -m1 "found the coordinator .* on the LAN at" "$logs/worker B.log" || true)
discovered=false
if [[ "$found" == *"$coordinator"* ]]; then discovered=true; fi
say "discovery: ${found:-B never said it found the coordinator on the LAN}"

# B's fetch: "fetched layers [A,B): N bytes (...) in S s; ..."
fetched=$(sed -n 's/^meshnet worker: fetched layers \(\[[0-9]*,[0-9]*)\): \([0-9]*\) bytes (.*) in \([0-9.]*\) s;.*$/\1 \2 \3/p' \
    "$logs/worker B.log" | head -n 1)
cat_seconds=()
if [ -n "$fetched" ]; then
    read -r fetch_range fetch_bytes fetch_line_s <<<"$fetched"
    say "B fetched $fetch_range: $fetch_bytes bytes in $fetch_line_s s (its own line)"
    # as many bytes of the model by plain TCP, A to B, as cat copies (128 KiB writes: `head -c`
    # writes 8 KiB at a time, 10 times slower than cat over this link on a small VM); a
    # receiver in B reads to EOF, timing from the first byte
    start receiver "$ns_b" "$py" -u -c '
import socket, sys, time
listener = socket.socket()
listener.bind((sys.argv[1], 0))
listener.listen(1)
print("port", listener.getsockname()[1], flush=True)
buf = bytearray(1 << 20)
for _ in range(int(sys.argv[2])):
    conn, _ = listener.accept()
    n, first = 0, None
    while k := conn.recv_into(buf):
        if first is None:
            first = time.perf_counter()
        n += k
    print("received", n, time.perf_counter() - (first or time.perf_counter()), flush=True)
    conn.close()' "$addr_b" "$rounds"
    for _ in $(seq 100); do grep -q '^port ' "$logs/receiver.log" && break; sleep 0.1; done
    cat_port=$(sed -n 's/^port //p' "$logs/receiver.log")
    [ -n "$cat_port" ] || { echo "netns-join: the receiver in $ns_b did not listen" >&2; exit 1; }
    for i in $(seq "$rounds"); do
        ip netns exec "$ns_a" bash -c 'dd if="$2" bs=128K iflag=count_bytes count="$1" status=none > "/dev/tcp/$3/$4"' \
            _ "$fetch_bytes" "$model_path" "$addr_b" "$cat_port"
        for _ in $(seq 300); do [ "$(grep -c '^received ' "$logs/receiver.log")" -ge "$i" ] && break; sleep 0.1; done
        line=$(grep '^received ' "$logs/receiver.log" | sed -n "${i}p")
        [ -n "$line" ] || { echo "netns-join: transfer $i was not received" >&2; exit 1; }
        read -r _ got seconds <<<"$line"
        [ "$got" -eq "$fetch_bytes" ] || { echo "netns-join: transfer $i: $got bytes of $fetch_bytes" >&2; exit 1; }
        cat_seconds+=("$seconds")
    done
    say "the first $fetch_bytes bytes of the model, cat-like (dd bs=128K) > /dev/tcp/$addr_b: ${cat_seconds[*]} s"
else
    fetch_range="" fetch_bytes=0 fetch_line_s=0
    say "B's worker never said it fetched its layers"
fi

listed=false
if grep -q "\"$coordinator\"" "$logs/status B.log" 2>/dev/null; then listed=true; fi
say "meshnet status --discover in $ns_b: $(tail -n 1 "$logs/status B.log" 2>/dev/null)"

"$py" - "$logs/checker.json" "$discovered,$listed" "$fetch_range" "$fetch_bytes" "$fetch_line_s" "$rate" \
    ${cat_seconds[@]+"${cat_seconds[@]}"} <<'EOF'
import json, statistics, sys

path, discovered, fetch_range, fetch_bytes, fetch_line_s, rate, *cat = sys.argv[1:]
report = json.loads(open(path).read().strip().splitlines()[-1])
fetch_bytes, fetch_line_s = int(fetch_bytes), float(fetch_line_s)
discovered, listed = discovered.split(",")
report.update(discovery=discovered == "true", status_discover=listed == "true", rate=rate or None,
              fetch_range=fetch_range or None,
              fetch_bytes=fetch_bytes, fetch_line_s=fetch_line_s)
# the fetch's bytes and seconds as B's worker says them (to the millisecond)
report["fetch_s"] = fetch_line_s
report["fetch_MBps"] = fetch_bytes / fetch_line_s / 1e6 if fetch_bytes and fetch_line_s > 0 else 0.0
cat = [float(s) for s in cat]
report["cat_s"] = cat
report["cat_MBps"] = fetch_bytes / statistics.median(cat) / 1e6 if cat and statistics.median(cat) > 0 else 0.0
report["fetch_to_cat"] = report["fetch_MBps"] / report["cat_MBps"] if report["cat_MBps"] else None
report["fetch_rate_ok"] = report["fetch_to_cat"] is not None and report["fetch_to_cat"] >= 0.8
report["checker_ok"] = report["ok"]
report["ok"] = bool(report["ok"] and report["discovery"] and report["status_discover"])
print(f"netns-join: B fetched {fetch_bytes} bytes at {report['fetch_MBps']:.1f} MB/s, a plain TCP copy of as many ran at {report['cat_MBps']:.1f} MB/s (median of "
      f"{len(cat)}): {report['fetch_to_cat'] or 0:.3f} (target 0.8); B's disk "
      f"{report.get('b_disk_bytes')} bytes for a share of {report.get('b_share_bytes')}: "
      f"{report.get('disk_ratio') or 0:.4f}", file=sys.stderr)
print(json.dumps(report))
sys.exit(0 if report["ok"] else 1)
EOF
