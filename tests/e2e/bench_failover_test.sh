#!/usr/bin/env bash
# psd_bench through a failover: 3 real psd shards with --replicas-per-shard 2, psd_bench's workers
# on them (--connect with every shard's address, --retry-s), the chief killed with SIGKILL mid-run
# and started again 200 ms later. The variable is sliced over every shard, so every worker's next
# step needs the killed one: the workers retry (they would exit 1 at the first UNAVAILABLE
# without --retry-s), the cluster serves again from the live copies, and the bench finishes with
# every step done and reports the retries and the longest stall.
#
# Usage: bench_failover_test.sh PSD PSD_BENCH PSD_ADMIN
set -u -o pipefail
psd=$1 bench=$2 admin=$3
source "$(dirname "$0")/cluster_lib.sh"
source "$(dirname "$0")/replica_lib.sh"
begin_e2e
reserve_cluster 3
flags=(--cluster "$cluster" -R 3 -N 3 --init-tokens 0 --replicas-per-shard 2 --slice-bytes 1M --summary-interval-s 0
  --heartbeat-ms 100 --election-timeout-ms 1000)
for k in 0 1 2; do start_shard "$k" "s$k-0"; done
wait_for "$run/s*.log" "running at epoch" 30 || fail "the cluster did not start serving"

steps=400
timeout 300 "$bench" --connect "$cluster" --workers 3 --model-bytes 4M --fused --pull-in-push --steps "$steps" \
  --warmup 3 --retry-s 60 --token-timeout-ms 20000 --timeout-s 240 --finish > "$run/bench.log" 2>&1 &
bench_pid=$!
pids+=($bench_pid)
# Mid-run: a few dozen steps in.
deadline=$((SECONDS + 60))
until [ "$("$admin" --cluster "$cluster" status 2> /dev/null | sed -n 's/^global step *\([0-9]*\)$/\1/p')" -ge 30 ] 2> /dev/null; do
  [ $SECONDS -lt $deadline ] || fail "the bench did not reach step 30 (log: $(tail -3 "$run/bench.log"))"
  kill -0 "$bench_pid" 2> /dev/null || fail "the bench ended before the kill: $(tail -5 "$run/bench.log")"
  sleep 0.05
done
kill_victim chief 1
sleep 0.2
start_shard "$k" "s$k-1"
wait "$bench_pid" || fail "psd_bench exited $? through the failover: $(tail -8 "$run/bench.log")"
cat "$run/bench.log"
line=$(cat "$run"/s*.log | grep "running at epoch" | sort | tail -1)
echo "$line" | grep -q "from the live copies of step" || fail "the cluster did not form again from the live copies: $line"
retries=$(sed -n 's/^ *retries *\([0-9]*\) steps retried.*/\1/p' "$run/bench.log")
[ "${retries:-0}" -ge 1 ] || fail "the bench reports no retry, though every step needed the killed shard"
grep -q "longest stall [0-9.]* ms" "$run/bench.log" || fail "the bench reports no stall"
echo "ok: shard $k (the chief) killed mid-run; psd_bench retried $retries step(s) and finished its $steps steps"
