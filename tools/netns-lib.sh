# What tools/netns-two-host.sh and tools/netns-join.sh share, sourced by both: the
# bookkeeping of what a run starts (pids, names, the namespaces it made), the cleanup that
# stops all of it and removes the namespaces however the run ends, `say` for its steps,
# `start` for a process in a namespace, and `make_namespaces`. The sourcing script sets
# before it: SAY_AS (its name in messages), logs (a private temp directory), ns_a, ns_b,
# link_a (the names of this run), and defines skip.
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
