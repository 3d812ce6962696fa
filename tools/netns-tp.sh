#!/usr/bin/env bash
# Tensor parallelism across two hosts on one machine: two network namespaces, A (10.78.0.1)
# and B (10.78.0.2), joined by a link of their own; tools/tp_bench.py runs in A with member 0
# of the group (and the whole model) there and member 1 in B, so every gather crosses the
# link. Prints the bench's figures (whole model, group, members without their exchange).
#   tools/netns-tp.sh [MODEL] [tp_bench options...]     default: qwen2.5-coder-1.5b; root only
# Environment:
#   DELAY=200us  a one-way delay, each direction, put on the link by tools/delay_wire.py
#                between two TAP devices (no netem on these kernels). Unset: a veth pair.
#   PYTHON       the interpreter with meshnet (default: the active or the project's venv).
# Exit status: the bench's; 2 a bad DELAY; 77 no namespaces can be made here (the reason on
# stderr). Whatever it starts is stopped, and the namespaces removed, when it ends
# (tools/netns-lib.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

skip() { echo "netns-tp: cannot build two hosts here: $*" >&2; exit 77; }

if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then py=$VIRTUAL_ENV/bin/python
else py=$root/.venv/bin/python
fi
model=${1:-qwen2.5-coder-1.5b}
shift || true
delay=${DELAY:-}
addr_a=10.78.0.1
addr_b=10.78.0.2

[ "$(id -u)" -eq 0 ] || skip "network namespaces need root (uid $(id -u))"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
if [ -n "$delay" ] && [ ! -c /dev/net/tun ]; then skip "DELAY needs TAP devices and there is no /dev/net/tun"; fi

ns_a=meshnet-tpa-$$
ns_b=meshnet-tpb-$$
link_a=mt$$a
link_b=mt$$b
logs=$(mktemp -d "${TMPDIR:-/tmp}/meshnet-netns-tp.XXXXXX")
SAY_AS=netns-tp
# shellcheck source=netns-lib.sh
. "$root/tools/netns-lib.sh"
make_namespaces

join_namespaces "$addr_a" "$addr_b" "$delay"
echo "netns-tp: $ns_a ($addr_a) and $ns_b ($addr_b) joined by $wire"

${tie[@]+"${tie[@]}"} ip netns exec "$ns_a" "$py" "$root/tools/tp_bench.py" "$model" \
    --hosts "$ns_a:$addr_a,$ns_b:$addr_b" "$@"
