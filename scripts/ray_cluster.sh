#!/usr/bin/env bash
# A Ray cluster for kvroll's rollout workers (kvroll_mode: ray). A single machine needs none of this: the trainer
# starts a local cluster itself. For several nodes:
#
#   scripts/ray_cluster.sh head [--port 6379] [--num-gpus N] [ray start flags...]   # on the head node
#   scripts/ray_cluster.sh worker HEAD_IP:6379 [--num-gpus N] [ray start flags...]  # on every other node
#   scripts/ray_cluster.sh submit [--address http://127.0.0.1:8265] -- kvroll train --config FILE.yaml ...
#   scripts/ray_cluster.sh status        # nodes and resources (CPUs, GPUs) of the cluster this node belongs to
#   scripts/ray_cluster.sh stop          # stops the Ray processes of this node (`ray stop`: all of them, any cluster's)
#
# The trainer joins with kvroll_ray_address: auto (on a cluster node) or HEAD_IP:6379 (token authentication is on:
# other machines need the head's ~/.ray/auth_token, or RAY_AUTH_TOKEN). Ray's dashboard (and the job server `submit`
# talks to) binds to 127.0.0.1 unless DASHBOARD_HOST is set (e.g. DASHBOARD_HOST=0.0.0.0 to reach it from other
# machines; it has no access control beyond Ray's token). `submit` needs Ray's job server:
# pip install "ray[default]" (kvroll's extra: pip install -e ".[cluster]").
# RAY=path/to/ray picks the ray executable (default: .venv/bin/ray when present, else ray on PATH).
# READY_TIMEOUT_S (60): how long `head` waits for its node to be up; CONNECT_TIMEOUT_S (60): how long `worker` waits
# for the head to answer on its port before `ray start`.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
RAY="${RAY:-$( [ -x "$here/.venv/bin/ray" ] && echo "$here/.venv/bin/ray" || echo ray )}"
DASHBOARD_HOST="${DASHBOARD_HOST:-127.0.0.1}"
# Ray 2.60 turns token authentication on at `ray start` (the token in ~/.ray/auth_token); its CLI clients must
# say so to send it.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
cmd="${1:-}"; shift || true
case "$cmd" in
  -h|--help|help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
  head|worker|submit|status|stop) ;;
  *) echo "ray_cluster.sh: unknown command '$cmd'; use head, worker, submit, status or stop" >&2; usage >&2; exit 2 ;;
esac
command -v "$RAY" >/dev/null 2>&1 || { echo "ray_cluster.sh: '$RAY' not found; run ./run setup or pip install ray" >&2; exit 1; }
# take_flag NAME EXAMPLE ARGS...: the value of --NAME VALUE or --NAME=VALUE anywhere in ARGS (the last one wins) in
# $value, the other arguments in the array rest; --NAME without a value is a usage error
take_flag() {
  local name="$1" example="$2"; shift 2
  value=""; rest=()
  while [ $# -gt 0 ]; do
    case "$1" in
      "--$name"|"--$name="*)
        if [ "$1" = "--$name" ]; then
          if [ $# -ge 2 ] && [ "${2#-}" = "$2" ]; then value="$2"; shift; else value=""; fi
        else
          value="${1#*=}"
        fi
        shift
        [ -n "$value" ] || { echo "ray_cluster.sh $cmd: --$name needs a value, e.g. --$name $example" >&2; exit 2; } ;;
      *) rest+=("$1"); shift ;;
    esac
  done
}
is_port() { [[ "$1" =~ ^[0-9]+$ ]] && (( 10#$1 >= 1 && 10#$1 <= 65535 )); }
# check_counts ARGS...: --num-gpus / --num-cpus N (or =N) must be a whole number >= 0, as `ray start` takes them
# (it refuses other words itself, but a negative count crashed it after its GCS server had started, left running)
check_counts() {
  local prev="" arg flag val
  for arg in "$@" ""; do
    flag=""; case "$prev" in --num-gpus|--num-cpus) flag="$prev"; val="$arg" ;; esac
    case "$arg" in --num-gpus=*|--num-cpus=*) flag="${arg%%=*}"; val="${arg#*=}" ;; esac
    if [ -n "$flag" ] && ! [[ "$val" =~ ^[0-9]+$ ]]; then
      echo "ray_cluster.sh $cmd: $flag ${val:-(missing)} is not a whole number >= 0 (e.g. $flag 4)" >&2; exit 2
    fi
    prev="$arg"
  done
}
case "$cmd" in
  head)
    take_flag port 6379 "$@"
    port="${value:-6379}"
    is_port "$port" || {
      echo "ray_cluster.sh head: --port $port is not a port number 1-65535 (e.g. 6379)" >&2; exit 2; }
    set -- ${rest[@]+"${rest[@]}"}
    check_counts "$@"
    # a token for this cluster (Ray makes one only when RAY_AUTH_MODE is unset); copy ~/.ray/auth_token to the
    # other nodes, or set RAY_AUTH_TOKEN there, before they join
    [ -n "${RAY_AUTH_TOKEN:-}" ] || [ "$RAY_AUTH_MODE" != token ] || "$RAY" get-auth-token --generate >/dev/null
    "$RAY" start --head --port="$port" --dashboard-host="$DASHBOARD_HOST" --disable-usage-stats "$@"
    # `ray start` returns before the autoscaler reports the node (a `status` at once says "No cluster status"):
    # wait up to READY_TIMEOUT_S (60) seconds for it, so what follows this script sees the cluster
    # (it exits 0 while saying so, hence the grep)
    # (the whole output read before matching: `status | grep -q` under pipefail failed when grep stopped early)
    ready() { local out; out="$("$RAY" status 2>/dev/null)" || return 1; [[ "$out" == *Resources* ]]; }
    # (a deadline, not a count of tries: each `ray status` itself takes a second or two)
    ready_end=$((SECONDS + ${READY_TIMEOUT_S:-60})); up=0
    while :; do ready && { up=1; break; }; [ "$SECONDS" -lt "$ready_end" ] || break; sleep 1; done
    [ "$up" = 1 ] || echo "kvroll: warning: the head started but 'ray status' reports no resources within" \
      "${READY_TIMEOUT_S:-60}s (run scripts/ray_cluster.sh status to see why)" >&2
    ip="$("$RAY" get-head-ip 2>/dev/null || true)"
    ip="${ip:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
    echo "kvroll: Ray head up. Other nodes: scripts/ray_cluster.sh worker ${ip:-HEAD_IP}:$port"
    echo "kvroll: trainers here: kvroll_ray_address: auto; elsewhere: kvroll_ray_address: ${ip:-HEAD_IP}:$port"
    [ "$RAY_AUTH_MODE" != token ] || echo "kvroll: token authentication is on: other machines need this node's" \
      "~/.ray/auth_token (copy it, or share the home directory) or RAY_AUTH_TOKEN set to it" ;;
  worker)
    [ $# -ge 1 ] || { echo "ray_cluster.sh worker: give the head's address, e.g. worker 10.0.0.1:6379" >&2; exit 2; }
    case "$1" in -*) echo "ray_cluster.sh worker: give the head's address first, e.g. worker 10.0.0.1:6379 $1" >&2
      exit 2 ;; esac
    address="$1"; shift
    check_counts "$@"
    host="${address%:*}"; port="${address##*:}"; [ "$port" != "$address" ] || port=6379
    host="${host#[}"; host="${host%]}"  # an IPv6 head, [::1]:6379 as Ray writes it: /dev/tcp takes it bare
    [ -n "$host" ] && is_port "$port" || {
      echo "ray_cluster.sh worker: '$address' is not HOST:PORT with a port 1-65535 (e.g. worker 10.0.0.1:6379)" >&2
      exit 2; }
    # the token first (a missing one is refused at once, not after the head's reachability wait below)
    [ "$RAY_AUTH_MODE" != token ] || [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ] || {
      echo "ray_cluster.sh worker: token authentication is on but this node has no token: copy the head's" \
        "~/.ray/auth_token here or set RAY_AUTH_TOKEN" >&2; exit 1; }
    # `ray start` retries an unreachable head for many minutes, printing only GCS warnings: check it first, retrying
    # until CONNECT_TIMEOUT_S (a refused connection returns at once; a head started beside its workers may listen late)
    answers() {
      local end=$((SECONDS + ${CONNECT_TIMEOUT_S:-60}))
      until timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$host" "$port" 2>/dev/null; do
        [ "$SECONDS" -lt "$end" ] || return 1; sleep 1
      done
    }
    answers || {
      echo "ray_cluster.sh worker: the head $host:$port does not answer within ${CONNECT_TIMEOUT_S:-60}s; check the" \
        "address the head printed ('scripts/ray_cluster.sh worker HEAD_IP:PORT'), that the head is up and that the" \
        "port is open between the nodes" >&2; exit 1; }
    "$RAY" start --address="$address" --disable-usage-stats "$@" ;;
  submit)
    address="http://127.0.0.1:8265"
    if [ "${1:-}" = "--address" ]; then
      [ $# -ge 2 ] && [ "${2#-}" = "$2" ] || { echo "ray_cluster.sh submit: --address needs a value, e.g. --address http://127.0.0.1:8265" >&2; exit 2; }
      address="$2"; shift 2
    fi
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || { echo "ray_cluster.sh submit: give the command after --, e.g. submit -- kvroll train --config configs/grpo_smollm2_ray.yaml" >&2; exit 2; }
    "$RAY" job submit --address="$address" --working-dir="$here" -- "$@" ;;
  status)
    "$RAY" status "$@" ;;
  stop)
    "$RAY" stop "$@" ;;
esac
