#!/usr/bin/env bash
# One model across two real hosts, over ssh: host A runs the coordinator and the worker
# for the first layers, host B the worker for the rest; the coordinator generates from a
# prompt once the route is whole and prints its JSON (tokens, text, metrics).
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
#   --remote-dir DIR         logs and pid files on the hosts [REMOTE_DIR]; default /tmp
#   --dry-run                print the commands, one per line, and run none
# It installs nothing: a host without meshnet, or without the model (which meshnet would
# otherwise fetch from PyPI), stops the run before anything starts there. The workers and
# the coordinator are stopped (by the pids they recorded) when this script ends, Ctrl-C
# included. SSH (default ssh) is the ssh command; it never asks for a password
# (BatchMode). Exit status: the coordinator's; 2 a bad command line; 3 a host not ready.
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

# meshnet refuses to serve beyond loopback without CURVE keys; handing keys to the hosts
# is not this script's job yet, so the choice of a keyless run on a trusted network is
# the caller's, said out loud
[ "$insecure" = 1 ] || die "the workers and the coordinator would listen on the network without CURVE keys: pass \
--insecure (or INSECURE=1) on a network you trust; this script does not hand out keys yet"
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
from meshnet import models
name = sys.argv[1]
spec = models.MODELS.get(name)
local = models.models_dir() / spec.filename if spec else os.path.expanduser(name)
print(spec.filename if spec else "")
split, n_layer = "", ""
try:
    from meshnet.gguf_layout import read_layout
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
coordinator=tcp://$addr_a:$port

on() {  # on HOST REMOTE-COMMAND: run it there over ssh, or print it
    local cmd=("${ssh[@]}" "$1" "$2")
    if [ "$dry_run" -eq 1 ]; then words "${cmd[@]}"; else "${cmd[@]}"; fi
}
if [ -n "$model_file" ]; then
    model_test="test -f \"\${MESHNET_HOME:-\$HOME/.cache/meshnet}/models\"/$(quote "$model_file")"
else
    model_test="test -f $(quote "$model")"
fi
worker() {  # worker MESHNET RANGE ADDR DATA_PORT LOG PIDFILE: the remote command that starts one
    echo "nohup $(words "$1" worker --coordinator "$coordinator" --model "$model" --layers "$2" \
        --data-bind "tcp://$3:$4" --threads "$threads" --insecure) > $(quote "$5") 2>&1 < /dev/null & echo \$! > $(quote "$6")"
}
stop() {  # the remote command that stops what the pid files name: SIGTERM, then SIGKILL after 10 s
    local f files=()
    for f in "$@"; do files+=("$(quote "$f")"); done
    echo "for f in ${files[*]}; do [ -f \"\$f\" ] || continue; p=\$(cat \"\$f\"); kill \"\$p\" 2>/dev/null;" \
        "i=0; while kill -0 \"\$p\" 2>/dev/null && [ \$i -lt 20 ]; do sleep 0.5; i=\$((i+1)); done;" \
        "kill -0 \"\$p\" 2>/dev/null && kill -9 \"\$p\"; rm -f \"\$f\"; done; true"
}
report() {  # the remote command that shows a worker's memory, CPU time and last words
    echo "ps -o pid=,rss=,time= -p \"\$(cat $(quote "$1"))\" 2>/dev/null; tail -n 20 $(quote "$2") 2>/dev/null; true"
}

if [ "$dry_run" -eq 0 ]; then
    command -v "${ssh[0]}" >/dev/null || not_ready "no '${ssh[0]}' here to reach the hosts"
    echo "two-host: $host_a ($addr_a): coordinator $coordinator and layers $first; $host_b ($addr_b): layers $second; model $model" >&2
fi

# 1. each host has meshnet and the model: nothing is installed behind the user's back
for side in a b; do
    if [ $side = a ]; then host=$host_a exe=$meshnet flag=--meshnet; else host=$host_b exe=$meshnet_b flag=--meshnet-b; fi
    if [ "$dry_run" -eq 1 ]; then
        on "$host" "$(words "$exe" --version)"
        on "$host" "$model_test"
        continue
    fi
    version=$(on "$host" "$(words "$exe" --version)" 2>&1) ||
        not_ready "no meshnet at '$exe' on $host (${version:-no answer}); install it there (\`make\` in a checkout) or give $flag PATH: this script installs nothing"
    on "$host" "$model_test" ||
        not_ready "model '$model' is not on $host; install it there (python -m meshnet.models ensure $model, or copy the file): this script installs nothing"
    echo "two-host: $host: $version, model $model present" >&2
done

# 2. the workers, then the coordinator in the foreground (workers wait for it)
if [ "$dry_run" -eq 0 ]; then
    cleanup() {
        local status=$?
        trap - EXIT INT TERM
        on "$host_a" "$(stop "$pid_c" "$pid_a")" || true
        on "$host_b" "$(stop "$pid_b")" || true
        rm -f "${out:-}"
        exit "$status"
    }
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
fi
on "$host_b" "$(worker "$meshnet_b" "$second" "$addr_b" "$data_port_b" "$log_b" "$pid_b")"
on "$host_a" "$(worker "$meshnet" "$first" "$addr_a" "$data_port" "$log_a" "$pid_a")"
coordinate="echo \$\$ > $(quote "$pid_c"); exec $(words "$meshnet" coordinator --bind "$coordinator" --prompt "$prompt" \
    --max-tokens "$max_tokens" --wait "$wait_s" --json --insecure)"
if [ "$dry_run" -eq 1 ]; then
    on "$host_a" "$coordinate"
    on "$host_a" "$(report "$pid_a" "$log_a")"
    on "$host_b" "$(report "$pid_b" "$log_b")"
    on "$host_a" "$(stop "$pid_c" "$pid_a")"
    on "$host_b" "$(stop "$pid_b")"
    exit 0
fi
out=$(mktemp)
status=0
on "$host_a" "$coordinate" | tee "$out" || status=$?

# 3. each side's numbers: the coordinator's JSON, then each worker's memory, CPU time and log
if [ "$status" -eq 0 ]; then
    "$py" -c '
import json, sys
m = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["metrics"]
def num(key, fmt):
    return fmt.format(m[key]) if m.get(key) is not None else "-"
print("two-host: {} tokens after a {}-token prompt; ttft {} ms, prefill {} tok/s, decode {} tok/s, hop p50 {} us, "
      "p99 {} us".format(m["generated_tokens"], m["prompt_tokens"], num("ttft_ms", "{:.0f}"),
                         num("prefill_tok_s", "{:.1f}"), num("decode_tok_s", "{:.1f}"), num("hop_us_p50", "{:.0f}"),
                         num("hop_us_p99", "{:.0f}")), file=sys.stderr)' "$out" || true
fi
rm -f "$out"
echo "two-host: worker $first on $host_a (pid, RSS KiB, CPU time; its log):" >&2
on "$host_a" "$(report "$pid_a" "$log_a")" >&2 || true
echo "two-host: worker $second on $host_b (pid, RSS KiB, CPU time; its log):" >&2
on "$host_b" "$(report "$pid_b" "$log_b")" >&2 || true
exit "$status"
