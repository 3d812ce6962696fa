# What tools/netns-two-host.sh and tools/netns-join.sh share, sourced by both: the
# bookkeeping of what a run starts (pids, names, the namespaces it made), the cleanup that
# stops all of it and removes the namespaces however the run ends, `say` for its steps,
# `start` for a process in a namespace, `make_namespaces` and `join_namespaces`. The sourcing
# script sets before it: SAY_AS (its name in messages), logs (a private temp directory),
# ns_a, ns_b, link_a, link_b (the names of this run), and defines skip.
pids=()
names=()
made_ns=()

cleanup() {
    local status=$? pid i
    trap - EXIT
    trap : HUP INT TERM   # what this run started is stopped before it ends, however many signals come
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for i in $(seq 50); do  # a worker says goodbye first: give it 5 s
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" -eq 0 ] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    for ns in "${made_ns[@]}"; do
        # anything else still living in the namespace was started by this run
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true   # takes the links inside with it
    done
    ip link del "$link_a" 2>/dev/null || true    # not yet moved, when setting up failed
    case $status in
    0 | 77 | 130) ;;   # passed, skipped or stopped with Ctrl-C: nothing to explain
    *)
        for i in "${!names[@]}"; do
            [ -s "$logs/${names[$i]}.log" ] || continue
            echo "--- last lines of ${names[$i]}:" >&2
            tail -n 15 "$logs/${names[$i]}.log" >&2
        done
        ;;
    esac
    rm -rf "$logs"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

say() { echo "${SAY_AS:-netns}: $* (${SECONDS} s)" >&2; }   # a step, as it happens (stdout ends with the JSON)
# each child dies with this script (its parent), even when nothing here can run: SIGKILL
tie=()
if setpriv --help 2>/dev/null | grep -q -- --pdeathsig; then tie=(setpriv --pdeathsig KILL); fi

start() {  # start NAME NAMESPACE COMMAND...: in the background, its output in NAME.log
    local name=$1 ns=$2
    shift 2
    if [ -n "$ns" ]; then
        ${tie[@]+"${tie[@]}"} ip netns exec "$ns" "$@" > "$logs/$name.log" 2>&1 &
    else
        ${tie[@]+"${tie[@]}"} "$@" > "$logs/$name.log" 2>&1 &
    fi
    pids+=($!)
    names+=("$name")
    say "started $name${ns:+ in $ns} (pid $!)"
}

make_namespaces() {  # the two namespaces, each with its loopback up
    local ns
    for ns in "$ns_a" "$ns_b"; do
        ip netns add "$ns" 2>"$logs/ip.err" || skip "'ip netns add' failed: $(cat "$logs/ip.err")"
        made_ns+=("$ns")
        ip netns exec "$ns" true 2>"$logs/ip.err" || skip "'ip netns exec' failed: $(cat "$logs/ip.err")"
        ip -n "$ns" link set lo up
    done
}

join_namespaces() {  # join_namespaces ADDR_A ADDR_B [DELAY]: the two joined by a veth pair, or with a
                     # DELAY (a unit: 200us, 2ms) by two TAP devices and tools/delay_wire.py; sets
                     # wire (what joins them, in words) and delay_us (0 for the veth pair)
    local addr_a=$1 addr_b=$2 delay=${3:-}
    delay_us=0
    if [ -z "$delay" ]; then
        ip link add "$link_a" type veth peer name "$link_b" 2>"$logs/ip.err" || skip "no veth pair: $(cat "$logs/ip.err")"
        wire="a veth pair"
    else
        start wire "" "$py" "$root/tools/delay_wire.py" --delay "$delay" "$link_a" "$link_b"
        for _ in $(seq 100); do
            grep -q '^ready' "$logs/wire.log" && break
            if ! kill -0 "${pids[-1]}" 2>/dev/null; then
                wait "${pids[-1]}" && status=0 || status=$?
                [ "$status" -eq 77 ] && skip "$(tail -n 1 "$logs/wire.log")"
                exit "$(( status == 2 ? 2 : 1 ))"   # the log explains, on the way out
            fi
            sleep 0.1
        done
        grep -q '^ready' "$logs/wire.log" || { echo "${SAY_AS:-netns}: the delaying wire did not start" >&2; exit 1; }
        delay_us=$(sed -n 's/^ready .* delay_us=\([0-9]*\)$/\1/p' "$logs/wire.log")
        wire="two TAP devices and tools/delay_wire.py ($delay one-way, each direction)"
    fi
    ip link set "$link_a" netns "$ns_a"
    ip link set "$link_b" netns "$ns_b"
    ip -n "$ns_a" addr add "$addr_a/24" dev "$link_a"
    ip -n "$ns_b" addr add "$addr_b/24" dev "$link_b"
    ip -n "$ns_a" link set "$link_a" up
    ip -n "$ns_b" link set "$link_b" up
}
