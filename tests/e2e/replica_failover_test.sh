#!/usr/bin/env bash
# Shard replicas (--replicas-per-shard 2) with real processes, kill -9 under load, and the final
# parameters bit-identical to an undisturbed run's.
#
# 3 psd shards (--replicas-per-shard 2 --deterministic) train the example model with 3 workers
# that read the minibatch of each global step by its number (--data-by-step): a step computed
# again after a failover reads the same rows, and the sum is formed in worker order, so the model
# after S steps depends on nothing but S. Run 1 is undisturbed. In run 2 the chief and a non-chief
# are killed with SIGKILL in turn, KILLS times each, and started again 200 ms later; each time the
# cluster must serve again from the live copies the next shard keeps (never a checkpoint: the
# shards have none), and at the end every worker's parameter hash must equal run 1's.
# Prints each kill's kill-to-serving time and min/median/max per kind. Run 3 kills a shard and the
# next one together (with checkpoints on): no copy of shard 1's part is left, and the cluster falls
# back to the newest common checkpoint, with the error line that says so.
#
# Usage: replica_failover_test.sh PSD WORKER [KILLS (default 3)] [STEPS (default 2000)]
set -u -o pipefail
psd=$1 worker=$2 kills=${3:-3} steps=${4:-2000}
source "$(dirname "$0")/cluster_lib.sh"
source "$(dirname "$0")/replica_lib.sh"
begin_e2e
reserve_cluster 3
flags=(--cluster "$cluster" -R 3 -N 3 --init-tokens 0 --learning-rate 0.3 --replicas-per-shard 2 --deterministic
  --summary-interval-s 0 --exit-when-done --heartbeat-ms 100 --election-timeout-ms 1000)

# --- run 1: undisturbed ---------------------------------------------------------------------------
undisturbed_run

# --- run 2: the chief and a non-chief killed in turn ------------------------------------------------
for k in 0 1 2; do start_shard "$k" "s$k-0"; done
start_workers b
wait_for "$run/s*.log" "running at epoch" 30 || fail "run 2: the cluster did not start serving"
times_chief=() times_other=()
n=0
for round in $(seq 1 "$kills"); do
  for victim in chief other; do
    n=$((n + 1))
    sleep 0.4  # training goes on
    # Workers finished early (a fast machine): the kills so far still count.
    kill -0 "${wpid[0]}" 2> /dev/null || break 2
    kill_victim "$victim" "$n"
    sleep 0.2
    start_shard "$k" "s$k-$n"
    deadline=$((SECONDS + 60))
    while [ "$(running)" -le "$formed" ]; do
      [ $SECONDS -lt $deadline ] || fail "kill $n ($victim, shard $k): the cluster did not serve again within 60 s"
      sleep 0.02
    done
    line=$(cat "$run"/s*.log | grep "running at epoch" | sort | tail -1)
    echo "$line" | grep -q "from the live copies of step" ||
      fail "kill $n ($victim, shard $k): the cluster did not form from the live copies: $line"
    took=$(($(log_ms "$line") - kill_ms))
    echo "kill $n: $victim (shard $k): serving again after $took ms, $(echo "$line" | sed 's/.*from //')"
    if [ "$victim" = chief ]; then times_chief+=("$took"); else times_other+=("$took"); fi
  done
done
check_run2
echo "chief killed ${#times_chief[@]} times: kill-to-serving $(stats "${times_chief[@]}")"
echo "non-chief killed ${#times_other[@]} times: kill-to-serving $(stats "${times_other[@]}")"
echo "run 2: $n kills, every one recovered from the live copies; final parameters bit-identical to the undisturbed run ($want)"

# --- run 3: a shard and the next one killed together: part 1 has no copy left ----------------------
# The cluster falls back to the newest checkpoint every shard can restore, and says so.
rm -f "$run"/s*.log
flags+=(--checkpoint-every-steps 50)
start_shard_ckpt() {  # $1: index, $2: log name
  timeout 600 "${serve_on[@]}" "$(port_of "$cluster" "$1")" -- "$psd" "${flags[@]}" --shard-index "$1" --listen-fd 3 \
    --checkpoint-dir "$run/ckpt-$1" 2> "$run/$2.log" &
  shard_pid[$1]=$!
  pids+=($!)
}
for k in 0 1 2; do start_shard_ckpt "$k" "s$k-c"; done
start_workers c
wait_for "$run/s0-c.log" "checkpoint at step [1-9][0-9]*0 sealed" 60 || fail "run 3: no checkpoint sealed"
kill -9 "$(real_pid "${shard_pid[1]}")" "$(real_pid "${shard_pid[2]}")"
wait "${shard_pid[1]}" "${shard_pid[2]}" 2> /dev/null
sleep 0.2
start_shard_ckpt 1 s1-d
start_shard_ckpt 2 s2-d
wait_workers c
grep -q "no live copy of some shard's state is left" "$run"/s*.log || fail "run 3: the fallback was not logged"
line=$(cat "$run"/s*.log | grep "running at epoch" | sort | tail -1)
echo "$line" | grep -q "from checkpoint step" || fail "run 3: the cluster did not restore a checkpoint: $line"
echo "run 3: shards 1 and 2 killed together: $(echo "$line" | sed 's/.*from //'), logged; the job finished"
echo "PASS"
