#!/usr/bin/env bash
# failover.sh: how long a psd cluster is out of service when a shard is killed, and how many
# committed steps it loses (README "Running a cluster": today the cluster restores its newest
# common checkpoint once every shard is back).
#
# A cluster of 3 real psd processes on 127.0.0.1 trains the example model with 3 workers
# (psd_logreg_worker); every few seconds one shard is killed with SIGKILL — the chief and a
# non-chief in turn — and started again after --restart-ms. For each kill it prints the
# kill-to-serving time (from the kill to the chief's "running at epoch" log line) and the steps
# lost (the highest step the surviving shards hold right after the kill minus the checkpoint step
# the cluster restored: what the workers recompute; n/a when no survivor answered right after the
# kill), then min/median/max of each per victim (the median of an even count: the mean of the two
# middle values).
#
# Usage: bench/failover.sh [options]
#   --kills N          kills of each kind (chief, non-chief; default 5)
#   --restart-ms MS    how long a killed shard stays down (default 200)
#   --every-steps S    --checkpoint-every-steps (default 20)
#   --mode M           sync (default), async or ssp
#   --shared-dir       every shard checkpoints into one directory (one host); default: one each
#   --replicas N       --replicas-per-shard (default 1; 2: the cluster restores the live copies the
#                      next shard keeps, not a checkpoint)
#   --build DIR        where psd, psd_logreg_worker and psd_admin are (default: build)
# Exit status: 0 when every kill was recovered from, 1 otherwise.
set -u -o pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kills=5 restart_ms=200 every=20 mode=sync build="$repo_root/build" shared=0 replicas=1
while [ $# -gt 0 ]; do
  case "$1" in
    --kills) kills=$2; shift 2 ;;
    --restart-ms) restart_ms=$2; shift 2 ;;
    --every-steps) every=$2; shift 2 ;;
    --mode) mode=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --shared-dir) shared=1; shift ;;
    --replicas) replicas=$2; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "failover.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
psd="$build/server/psd" worker="$build/client/psd_logreg_worker" admin="$build/client/psd_admin"
for b in "$psd" "$worker" "$admin"; do
  [ -x "$b" ] || { echo "failover.sh: $b is missing: build first (cmake --build $build)" >&2; exit 1; }
done
source "$repo_root/tests/e2e/cluster_lib.sh"
begin_e2e
reserve_cluster 3
log_ms() { date -d "$(echo "$1" | cut -c 1-23)" +%s%3N; }

flags=(--cluster "$cluster" --mode "$mode" -R 3 -N 3 --init-tokens 0 --learning-rate 0.3
  --checkpoint-every-steps "$every" --summary-interval-s 0 --replicas-per-shard "$replicas")
declare -A shard_pid
start_shard() {  # $1: index, $2: log name
  # Each shard its own checkpoint directory, as on separate hosts (unless --shared-dir).
  local dir="$run/ckpt-$1"
  [ "$shared" = 1 ] && dir="$run/ckpt"
  timeout 900 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" "${flags[@]}" --shard-index "$1" --listen-fd 3 \
    --checkpoint-dir "$dir" 2> "$run/$2.log" &
  shard_pid[$1]=$!
  pids+=($!)
}
for k in 0 1 2; do start_shard "$k" "s$k-0"; done
for w in 0 1 2; do
  timeout 900 "$worker" --cluster "$cluster" --worker-name "w$w" --shard "$w" --steps 100000000 --slow-ms 5 \
    --print-every 0 --retry-s 120 > "$run/w$w.log" 2>&1 &
  pids+=($!)
done
# The global step the cluster serves at, or nothing while it does not serve.
serving_step() {
  "$admin" --cluster "$cluster" status 2> /dev/null | sed -n 's/^global step *\([0-9]*\)$/\1/p'
}
# The highest step the shards other than $1 hold (asked one by one: a killed shard's reserved port
# accepts but never answers).
held_step() {
  for s in 0 1 2; do
    [ "$s" = "$1" ] && continue
    "$admin" --port "$(port_of "$cluster" "$s")" status 2> /dev/null | sed -n 's/^global step *\([0-9]*\)$/\1/p'
  done | sort -n | tail -1
}
wait_serving() {  # $1: seconds
  local deadline=$((SECONDS + $1))
  while [ $SECONDS -lt $deadline ]; do
    [ -n "$(serving_step)" ] && return 0
    sleep 0.1
  done
  return 1
}
wait_serving 60 || fail "the cluster did not start serving"
chief_of() { grep -l "is the chief for term" "$run"/s*.log | xargs ls -t | head -1 | sed 's/.*\/s\([0-9]\)-.*/\1/'; }

declare -a times_chief times_other lost_chief lost_other
n=0
for _ in $(seq 1 "$kills"); do
  for victim in chief other; do
    n=$((n + 1))
    sleep 2  # training goes on; a checkpoint or more is sealed
    [ -n "$(serving_step)" ] || fail "kill $n: the cluster is not serving before the kill"
    chief=$(chief_of)
    k=$chief
    [ "$victim" = other ] && k=$(((chief + 1) % 3))
    formed=$(cat "$run"/s*.log | grep -c "running at epoch" || true)
    kill_ms=$(date +%s%3N)
    kill -9 "$(real_pid "${shard_pid[$k]}")"
    wait "${shard_pid[$k]}" 2> /dev/null  # (no "Killed" notice)
    before=$(held_step "$k")  # the survivors keep the steps committed before the kill until they restore
    sleep "$(awk -v ms="$restart_ms" 'BEGIN { printf "%.3f", ms / 1000 }')"
    start_shard "$k" "s$k-$n"
    deadline=$((SECONDS + 60))
    while [ "$(cat "$run"/s*.log | grep -c "running at epoch" || true)" -le "$formed" ]; do
      [ $SECONDS -lt $deadline ] || fail "kill $n ($victim, shard $k): the cluster did not serve again within 60 s"
      sleep 0.05
    done
    line=$(cat "$run"/s*.log | grep "running at epoch" | sort | tail -1)
    took=$(($(log_ms "$line") - kill_ms))
    restored=$(echo "$line" | sed -n 's/.*from \(checkpoint step\|the live copies of step\) \([0-9]*\).*/\2/p')
    source=$(echo "$line" | sed -n 's/.*from \(checkpoint step\|the live copies of step\) .*/\1/p')
    if echo "$line" | grep -q "newest live copy"; then  # async/ssp: each part's own, the chief's count
      restored=$(echo "$line" | sed -n 's/.*newest live copy (step \([0-9]*\) on the chief).*/\1/p')
      source="each part's newest live copy, chief's count"
    fi
    # No survivor answered in time: the step at the kill is unknown, and so are the steps lost
    # (counting from 0 would print a negative number). Left out of the statistics.
    lost=n/a
    [ -n "$before" ] && lost=$((before - ${restored:-0}))
    echo "kill $n: $victim shard $k at step ${before:-n/a}; serving again after $took ms from ${source:-checkpoint step} ${restored:-none} ($lost step(s) to recompute)"
    if [ "$victim" = chief ]; then
      times_chief+=("$took")
      [ "$lost" != n/a ] && lost_chief+=("$lost")
    else
      times_other+=("$took")
      [ "$lost" != n/a ] && lost_other+=("$lost")
    fi
  done
done
# min, median (an even count: the mean of the two middle values), max; n/a for no values.
stats() {
  [ $# -gt 0 ] || { printf 'n/a'; return; }
  printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 }
    END {
      m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
      printf "min %d, median %s, max %d", a[1], (m == int(m) ? sprintf("%d", m) : sprintf("%.1f", m)), a[NR]
    }'
}
echo
echo "mode $mode, --replicas-per-shard $replicas, restart after $restart_ms ms, checkpoint every $every steps$([ "$shared" = 1 ] && echo ", one shared checkpoint directory"), $kills kill(s) of each kind:"
# Kills whose steps lost are unknown (no survivor answered right after the kill), if any.
unknown() { [ "$1" -gt 0 ] && printf ' (over the others: %d kill(s) n/a)' "$1"; }
echo "  chief killed:     kill-to-serving ms $(stats "${times_chief[@]}"); steps lost $(stats "${lost_chief[@]}")$(unknown $((${#times_chief[@]} - ${#lost_chief[@]})))"
echo "  non-chief killed: kill-to-serving ms $(stats "${times_other[@]}"); steps lost $(stats "${lost_other[@]}")$(unknown $((${#times_other[@]} - ${#lost_other[@]})))"
exec 2> /dev/null  # the EXIT trap's kills are not news
